"""Check environment tags against the env contract before training on them.

    python -m agent_trainer.check_env [--envs-file my_envs.yaml] [--tag MyTag ...] [--junk N] [--seed S]

For each tag (every tag of the file unless ``--tag`` names some), the tag is loaded (its ``env_type`` resolved:
a registered name or ``module:Class``), the env is built, and the checks the repository's own environments pass
(``agent_trainer.checks.env_contract``: determinism under a seed, render / legend / action_description text,
``step``'s return shape and ``info`` keys over junk actions, the expert reaching success, ``close`` twice) run,
then the training run's preflight (``agent_trainer.checks.preflight``). One line per check: ``PASS`` or ``FAIL``
with what came back and the fix. Exit 0 when every check passed, 1 otherwise, 2 on a usage error.

A tag's ``module:Class`` is imported as in the training run: from the directory the command starts in, the tags
file's folder, or PYTHONPATH.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from agent_trainer.checks.env_contract import CheckResult, run_contract
from envs import parse_env_tags
from envs.import_paths import close_names
from envs.registry import import_beside

DEFAULT_ENVS_FILE = Path(__file__).resolve().parents[1] / "config" / "envs.yaml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agent_trainer.check_env",
        description="Run the env contract checks (the ones the repository's own environments pass) and the "
                    "training run's preflight on env tags; one line per check, exit 0 only when all pass.",
        epilog="example: python -m agent_trainer.check_env --envs-file my_envs.yaml --tag MyTag "
               "(docs/writing_an_environment.md, \"Check it\")")
    p.add_argument("--envs-file", default=str(DEFAULT_ENVS_FILE), metavar="F",
                   help="a YAML file of env tags, like config/envs.yaml (default: the shipped config/envs.yaml)")
    p.add_argument("--tag", action="append", default=None, metavar="T",
                   help="a tag of the file to check (repeat for several; default: every tag of the file)")
    p.add_argument("--junk", type=int, default=1000, metavar="N",
                   help="how many junk action strings step is given (default 1000; the repo's tests use 10000)")
    p.add_argument("--seed", type=int, default=0, help="the seed of reset and of the junk strings (default 0)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="the preflight's deadline for each reset and step, in seconds (default 60)")
    return p


def read_raw_tags(path: str) -> dict:
    """The file's tag name -> fields, unvalidated (each tag is validated on its own, so one broken tag is one
    failure). Raises ValueError with one line when the file is missing or no mapping."""
    import yaml

    if not Path(path).is_file():
        raise ValueError(f"--envs-file {path!r} is not a file; give a YAML of env tags (like config/envs.yaml)")
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"--envs-file {path!r} is not valid YAML: {' '.join(str(err).split())}") from None
    if isinstance(raw, dict) and "custom_envs" in raw:
        raw = raw["custom_envs"] or {}
    if not isinstance(raw, dict):
        raise ValueError(f"--envs-file {path!r} holds {type(raw).__name__}, not a mapping of tag -> fields")
    return raw


def check_tags(path: str, tags: Sequence[str] | None, *, junk: int = 1000, seed: int = 0,
               timeout_s: float = 60.0) -> list[CheckResult]:
    """Every check of every tag asked for; a tag that is not in the file or does not load is one failure."""
    raw = read_raw_tags(path)
    import_beside(path)  # the tags' modules import from beside the file, as in a training run
    results: list[CheckResult] = []
    for tag in (tags or list(raw)):
        if tag not in raw:
            close = close_names(tag, list(raw))
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            results.append(CheckResult(tag, "tag in the envs file", False,
                                       f"{path} has no tag {tag!r}; {hint}its tags: {sorted(raw)}"))
            continue
        try:
            env_tags = parse_env_tags({tag: raw[tag]})
        except Exception as err:  # noqa: BLE001 - a tag that does not load is one failed check
            text = err if isinstance(err, (ValueError, ImportError)) else f"{type(err).__name__}: {err}"
            results.append(CheckResult(tag, "load the tag (env_type, env_config)", False, " ".join(str(text).split())))
            continue
        results.append(CheckResult(tag, "load the tag (env_type, env_config)", True, env_tags[tag].env_type))
        results += run_contract(tag, env_tags, junk=junk, seed=seed, timeout_s=timeout_s)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        results = check_tags(args.envs_file, args.tag, junk=args.junk, seed=args.seed, timeout_s=args.timeout_s)
    except ValueError as err:
        print(f"agent-trainer check_env: {err}", file=sys.stderr)
        return 2
    for r in results:
        print(r.line(), flush=True)
    failed = [r for r in results if not r.ok]
    tags = dict.fromkeys(r.tag for r in results)
    bad = dict.fromkeys(r.tag for r in failed)
    print(f"{len(results) - len(failed)} of {len(results)} checks passed"
          + (f"; failing tags: {', '.join(bad)}" if bad else f" ({len(tags)} tag{'s' if len(tags) != 1 else ''})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
