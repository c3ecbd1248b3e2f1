"""The command line of ``python -m agent_trainer.eval`` and ``.sft``: hydra's spelling, as ``agent_trainer.main``.

    python -m agent_trainer.<entry> [--config-name NAME | --config-name=NAME | -cn NAME] [key=value ...]
    python -m agent_trainer.<entry> --help [--config-name NAME] [key=value ...]

``agent_trainer.main`` reads the same spelling through ``@hydra.main``; these two entries compose their config
with hydra's ``compose`` themselves (no run folder of hydra's, no change of directory), so they read the
arguments here. ``--help`` (``-h``) prints the usage and the config the arguments compose to, and exits 0; any
other option is refused in one line naming what to write instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from agent_trainer.checks.prepare import compose

CONFIG_NAME_FLAGS = ("--config-name", "-cn")
HELP_FLAGS = ("--help", "-h")


@dataclass
class Args:
    """What a command line asks for."""

    config_name: str
    overrides: list[str] = field(default_factory=list)
    help: bool = False


def parse_args(argv: Sequence[str], default_config: str) -> Args:
    """``--config-name NAME`` (``--config-name=NAME``, ``-cn NAME``; default ``default_config``), ``--help``,
    and the ``key=value`` overrides in order. Raises ValueError with one line on any other option."""
    args, rest = Args(default_config), list(argv)
    while rest:
        arg = rest.pop(0)
        if arg in HELP_FLAGS:
            args.help = True
        elif arg in CONFIG_NAME_FLAGS:
            if not rest or rest[0].startswith("-") or "=" in rest[0]:
                raise ValueError(f"{arg} needs a config name, e.g. {arg} {default_config} (a config/<name>.yaml)")
            args.config_name = rest.pop(0)
        elif arg.startswith("--config-name="):
            args.config_name = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ValueError(f"{arg} is not an option here; give --config-name NAME and key=value overrides "
                             "(--help shows them and the config they compose to)")
        else:
            args.overrides.append(arg)
    return args


NOT_CONFIGS = ("envs.yaml",)
"""YAML files of config/ that are no ``--config-name`` choice (the env tags file)."""


def config_choices(config_dir: Path) -> list[tuple[str, str]]:
    """``(name, description)`` of every ``config/<name>.yaml`` a ``--config-name`` can name, sorted; the
    description is the file's first comment line."""
    out = []
    for path in sorted(Path(config_dir).glob("*.yaml")):
        if path.name in NOT_CONFIGS:
            continue
        first = next((line for line in path.read_text().splitlines() if line.strip()), "")
        out.append((path.stem, first.lstrip("#").strip() if first.lstrip().startswith("#") else ""))
    return out


def config_choices_text(config_dir: Path, entry: str = "agent_trainer.main") -> str:
    """The ``--config-name`` choices as help text: one line each, the name and its description. The ``sft_*``
    configs are ``agent_trainer.sft``'s (its schema), the others ``agent_trainer.main``'s and
    ``agent_trainer.eval``'s."""
    choices = config_choices(config_dir)
    width = max((len(name) for name, _ in choices), default=0)
    sft = entry.endswith(".sft")
    lines = [f"== --config-name choices (config/<name>.yaml; for python -m {entry}) =="]
    lines += [f"  {name:<{width}}  {text}" for name, text in choices if name.startswith("sft_") == sft]
    other = "agent_trainer.main / agent_trainer.eval" if sft else "agent_trainer.sft"
    lines += [f"  for python -m {other}: " + ", ".join(name for name, _ in choices if name.startswith("sft_") != sft)]
    return "\n".join(lines) + "\n"


def usage(prog: str, summary: str, args: Args, default_config: str, config_dir: Path) -> str:
    """The ``--help`` text: the usage lines, ``summary``, and the config ``args`` compose to (hydra's help shows
    it the same way), or why it does not compose."""
    lines = [f"usage: {prog} [--config-name NAME] [key=value ...]",
             f"       {prog} --help [--config-name NAME] [key=value ...]", "", summary, "",
             f"  --config-name NAME, -cn NAME  a config/<NAME>.yaml (default {default_config})",
             "  key=value                     override any key of it (as on the command line of agent_trainer.main)",
             "  --help, -h                    this text, then exit", ""]
    try:
        composed = compose(args.config_name, args.overrides, config_dir)
        text = OmegaConf.to_yaml(composed, resolve=False)
        lines += [f"== Config (config/{args.config_name}.yaml with the overrides) ==", text]
    except Exception as err:  # noqa: BLE001 (a help text shows why the config does not compose, never raises)
        lines += [f"config/{args.config_name}.yaml does not compose: {' '.join(str(err).split())}"]
    return "\n".join(lines).rstrip() + "\n"


def command_line(argv: Sequence[str], prog: str, summary: str, default_config: str, config_dir: Path) -> Args | None:
    """An entry point's arguments; ``None`` after printing the ``--help`` text. A wrong option exits with one line
    naming the entry (``agent-trainer <entry>: ...``)."""
    try:
        args = parse_args(argv, default_config)
    except ValueError as err:
        raise SystemExit(f"agent-trainer {prog.rsplit('.', 1)[-1]}: {err}") from None
    if args.help:
        print(usage(prog, summary, args, default_config, config_dir), end="")
        return None
    return args
