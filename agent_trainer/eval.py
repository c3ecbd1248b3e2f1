"""Evaluate a checkpoint (--checkpoint, with its run's own config) or any HF model on the validation split.

    python -m agent_trainer.eval --checkpoint <run dir>/global_step_N [key=value ...]
    python -m agent_trainer.eval --checkpoint <run dir> eval.k=4        (its newest checkpoint)
    python -m agent_trainer.eval --config-name frozenlake model_path=<any HF model> eval.k=4

With ``--checkpoint`` the config is the one the run saved in the checkpoint (``global_step_N/config.yaml``,
YAML, already resolved), so none of the training overrides is repeated; the model is its ``actor`` folder and
the outputs go beside it, in ``global_step_N/eval/``. Overrides on the command line apply on top, key by key;
an alias of config/base.yaml or of the schema (``model_path``, ``micro_batch_size_per_gpu``,
``ppo_mini_batch_size``, ``trainer.seed``, ...) still carries to the keys that follow it (:func:`aliases`).

Only the rollout engines and the val env actors start: no FSDP actor, optimizer, critic or
reference. Two passes over the same validation seeds (``es_manager.val``):

- greedy: temperature 0, one episode per seed;
- sampled: ``eval.k`` episodes per seed with the training sampling (``rollout.temperature``,
  ``top_p``, ``top_k``); pass@k = the fraction of seeds where any of the k succeeded.

``<eval.output_dir>/eval_report.json`` holds both passes, overall and per env tag; every episode of both
goes to ``<eval.output_dir>/trajectories/`` with its ``viewer.html``. The config is
validated exactly as for training (one line naming the key on a mistake, before Ray starts).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent_trainer.common import checkpoint
from agent_trainer import cli_args
from agent_trainer.checks.prepare import CONFIG_DIR, CONFIG_ERRORS, compose, compose_and_prepare, prepare, refusal
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import Split

if TYPE_CHECKING:
    from agent_trainer.episode.es_manager import EpisodeState

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = "frozenlake"
"""The config ``--config-name`` names when it is not given (as for agent_trainer.main)."""
REPORT = "eval_report.json"
CHECKPOINT_FLAG = "--checkpoint"
EVAL_FOLDER = "eval"
"""``--checkpoint``'s outputs: ``<checkpoint>/eval/`` (eval.output_dir unless given)."""


USAGE = (__doc__.splitlines()[0] + "\n\n  --checkpoint PATH             a checkpoint folder (<run dir>/global_step_N) or a "
         "run folder (its newest):\n                                its saved config and its actor; outputs in "
         "<checkpoint>/eval/\n                                (instead of --config-name)")


def summarize(states: list[EpisodeState], pass_key: str | None = None) -> dict:
    """Success rate and mean episode reward, overall and per env tag; with ``pass_key`` also pass@group under it.

    An episode's reward is its state's ``total_reward``: the figure the rollout's metrics show (the sum of its
    training rows' rewards, docs/rewards.md "One reward figure").

    pass@group of an episode: any episode of its group (same seed) succeeded; its mean over
    episodes is the fraction of seeds solved, every group being the same size.
    """
    def stats(group: list[EpisodeState]) -> dict:
        n = max(1, len(group))
        out = {"episodes": len(group), "success_rate": sum(s.metrics.get("success", 0.0) for s in group) / n,
               "episode_reward_mean": sum(s.total_reward for s in group) / n}
        if pass_key:
            out[pass_key] = sum(s.metrics.get("pass@group", 0.0) for s in group) / n
        return out

    by_tag: dict[str, list[EpisodeState]] = defaultdict(list)
    for s in states:
        by_tag[s.tag].append(s)
    return {**stats(states), "per_tag": {tag: stats(group) for tag, group in sorted(by_tag.items())}}


def greedy_config(cfg: AgentTrainerConfig) -> AgentTrainerConfig:
    """The val split, one episode per seed, temperature 0 (whatever ``val_kwargs`` say)."""
    greedy = copy.deepcopy(cfg)
    greedy.es_manager.val.group_size = 1
    greedy.actor_rollout_ref.rollout.val_kwargs.temperature, greedy.actor_rollout_ref.rollout.val_kwargs.top_p = 0.0, 1.0
    return greedy


def sampled_config(cfg: AgentTrainerConfig) -> AgentTrainerConfig:
    """The val split with ``eval.k`` episodes per seed, sampled like training rollouts."""
    sampled = copy.deepcopy(cfg)
    sampled.es_manager.val.group_size = cfg.eval.k
    r = sampled.actor_rollout_ref.rollout
    r.val_kwargs.temperature, r.val_kwargs.top_p = r.temperature, r.top_p
    return sampled


def run_pass(cfg: AgentTrainerConfig, tokenizer, engines, env_worker_cls, env_tags: dict, name: str,
             pass_key: str | None = None) -> dict:
    """One validation rollout; its summary. Its env actors are killed after (the next pass reuses their names)."""
    from agent_trainer.training import lifecycle
    from agent_trainer.rollout import make_rollout
    from agent_trainer.observe.trajectories import write_step

    rollout = make_rollout(cfg, tokenizer, engines, env_worker_cls, env_tags, split=Split.VAL,
                           num_env_actors=cfg.agent_proxy.num_env_actors)
    try:
        result = rollout.rollout(0)
    finally:
        rollout.close()
        lifecycle.kill_actors(rollout.env_actors)
    # every episode the pass evaluated (trainer.log_trajectories_per_tag samples a training step's, not these)
    write_step(cfg.eval.output_dir, 0, f"val_{name}", result.states, result.batch, tokenizer, len(result.states))
    return summarize(result.states, pass_key)


def evaluate(cfg: AgentTrainerConfig, env_tags: dict) -> dict:
    """Start engines and val env actors, run the greedy and the sampled pass, write the report; return it."""
    import dataclasses

    import torch
    from transformers import AutoTokenizer

    from agent_trainer.ray_cluster import init_ray, shutdown_ray
    from agent_trainer.workers.build import build_engines, env_actor_class, resolve_device

    out = Path(cfg.eval.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    init_ray(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, default_local_dir=str(out))))
    engine_group = build_engines(cfg, resolve_device(cfg.trainer.device))
    env_worker_cls = env_actor_class(cfg)
    try:
        report = {"model_path": cfg.actor_rollout_ref.model.path, "seeds": cfg.es_manager.val.env_groups,
                  "greedy": run_pass(greedy_config(cfg), tokenizer, engine_group.workers, env_worker_cls, env_tags, "greedy")}
        if cfg.eval.k > 0:
            sampled = run_pass(sampled_config(cfg), tokenizer, engine_group.workers, env_worker_cls, env_tags,
                               "sampled", pass_key=f"pass@{cfg.eval.k}")
            report["sampled"] = {"k": cfg.eval.k, "temperature": cfg.actor_rollout_ref.rollout.temperature, **sampled}
    finally:
        engine_group.shutdown()
        shutdown_ray()
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    logger.info("evaluation report: %s; episodes: %s", out / REPORT, out / "trajectories" / "viewer.html")
    return report


def find_checkpoint(path: str) -> Path:
    """The checkpoint folder ``--checkpoint`` names: a ``global_step_N`` folder, or a run folder (its newest).

    Raises ValueError in one line when it is neither, or when its actor has no Hugging Face weights.
    """
    folder = Path(os.path.abspath(Path(path).expanduser()))
    if not checkpoint.is_complete(folder):
        latest = checkpoint.find_latest(folder) if folder.is_dir() else None
        if latest is None:
            raise ValueError(f"{CHECKPOINT_FLAG} {path}: not a checkpoint folder (<run dir>/global_step_N with "
                             f"{checkpoint.STATE_FILE}) nor a run folder holding one; give a checkpoint of a "
                             "finished save (trainer.save_freq)")
        folder = latest
    if not (folder / "config.yaml").is_file():
        raise ValueError(f"{CHECKPOINT_FLAG} {path}: {folder} has no config.yaml (saved by an older version); "
                         f"evaluate its actor with --config-name NAME model_path={folder / 'actor'}")
    if not list((folder / "actor").glob("*.safetensors")):
        raise ValueError(f"{CHECKPOINT_FLAG} {path}: {folder / 'actor'} holds only shards (the run had "
                         f"trainer.save_hf_model=false); write its Hugging Face weights with `python -m "
                         f"agent_trainer.export {folder} --out <folder>` and evaluate that as model_path")
    return folder


@functools.lru_cache(maxsize=1)
def aliases() -> dict[str, str]:
    """``{key: its ${...} expression}`` for every key of config/base.yaml and the schema that follows another one.

    A checkpoint's config is resolved; an override of the key an alias follows (``model_path=...``) puts the
    alias's expression back first, so it follows as it did in training (:func:`checkpoint_config`).
    """
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(compose("base"), resolve=False)
    out: dict[str, str] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{path}.")
            elif isinstance(value, str) and "${" in value:
                out[path] = value
    walk(base, "")
    return out


def override_key(override: str) -> str:
    """The key a ``key=value`` (``+key=``, ``++key=``, ``~key``) override sets."""
    return override.split("=", 1)[0].lstrip("+~")


def checkpoint_config(folder: Path, overrides: Sequence[str]) -> dict:
    """The config of an evaluation of checkpoint ``folder``: the run's saved config (YAML, never a pickle), its
    ``actor`` as the model, ``<folder>/eval`` as eval.output_dir, then (by :func:`compose_checkpoint`) the
    overrides. Aliases of an overridden key get their ``${...}`` back (:func:`aliases`)."""
    import yaml

    raw = yaml.safe_load((folder / "config.yaml").read_text())
    raw["model_path"] = str(folder / "actor")
    raw.setdefault("eval", {})["output_dir"] = str(folder / EVAL_FOLDER)
    given = {override_key(o) for o in overrides} | {"model_path", "eval.output_dir"}
    for key, expression in aliases().items():
        sources = set(re.findall(r"\$\{([\w.]+)\}", expression))
        if key not in given and sources & given and not key.startswith("hydra."):
            *parents, leaf = key.split(".")
            node = raw
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = expression
    return raw


def compose_checkpoint(folder: Path, overrides: Sequence[str]) -> tuple[AgentTrainerConfig, dict]:
    """What ``--checkpoint`` evaluates: :func:`checkpoint_config` with the command line's overrides composed on
    top by hydra, onto the typed schema as any config/<name>.yaml; validated as for training."""
    import tempfile

    import yaml

    raw = {"defaults": ["agent_trainer_schema", "_self_"], **checkpoint_config(folder, overrides)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "checkpoint.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
            composed = compose("checkpoint", overrides, config_dir=tmp)
        return prepare(composed, overrides)
    except CONFIG_ERRORS as err:
        raise SystemExit(refusal(err, overrides)) from None


def beside_the_checkpoint(cfg: AgentTrainerConfig) -> None:
    """A model_path that is a checkpoint's ``actor`` folder, with eval.output_dir left at its default: the outputs
    go beside the checkpoint (``<checkpoint>/eval``), as with ``--checkpoint``, not into the config's run folder."""
    model = Path(cfg.actor_rollout_ref.model.path)
    if model.name == "actor" and checkpoint.is_complete(model.parent) and \
            cfg.eval.output_dir == f"{cfg.trainer.default_local_dir}/{EVAL_FOLDER}":
        cfg.eval.output_dir = str(model.parent / EVAL_FOLDER)
        logger.info("model_path is checkpoint %s's actor: the outputs go beside it, in %s (--checkpoint %s would "
                    "also take the run's own config)", model.parent, cfg.eval.output_dir, model.parent)


def split_checkpoint_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """``--checkpoint PATH`` (or ``--checkpoint=PATH``) taken out of ``argv``; the rest. One line on a mistake."""
    path, rest = None, []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == CHECKPOINT_FLAG:
            if not args or args[0].startswith("-") or "=" in args[0]:
                raise SystemExit(f"agent-trainer eval: {CHECKPOINT_FLAG} needs a folder, e.g. "
                                 f"{CHECKPOINT_FLAG} outputs/<project>/<experiment>/global_step_10")
            path = args.pop(0)
        elif arg.startswith(f"{CHECKPOINT_FLAG}="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if path is not None and any(a in cli_args.CONFIG_NAME_FLAGS or a.startswith("--config-name=") for a in rest):
        raise SystemExit(f"agent-trainer eval: {CHECKPOINT_FLAG} takes the run's own config from the checkpoint; "
                         "drop --config-name (key=value overrides apply on top)")
    return path, rest


def main(argv: Sequence[str] | None = None) -> dict | None:
    """Console entry point (``--config-name NAME`` and ``key=value`` overrides, ``--help``; ``agent_trainer.cli_args``);
    a config mistake exits with one line before Ray starts."""
    from agent_trainer.checks.rl import check_eval

    checkpoint_path, argv = split_checkpoint_flag(list(sys.argv[1:] if argv is None else argv))
    args = cli_args.command_line(argv, "python -m agent_trainer.eval", USAGE, DEFAULT_CONFIG, CONFIG_DIR)
    if args is None:
        return None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = args.overrides
    if checkpoint_path is None:
        cfg, env_tags = compose_and_prepare(overrides, config_name=args.config_name)
        beside_the_checkpoint(cfg)
    else:
        try:
            folder = find_checkpoint(checkpoint_path)
        except ValueError as err:
            raise SystemExit(f"agent-trainer eval: {err}") from None
        logger.info("evaluating checkpoint %s with its run's config (%s)", folder, folder / "config.yaml")
        cfg, env_tags = compose_checkpoint(folder, overrides)
    try:
        check_eval(cfg)
    except ValueError as err:
        raise SystemExit(refusal(err, overrides)) from None
    report = evaluate(cfg, env_tags)
    print(json.dumps({k: v for k, v in report.items() if k != "per_tag"}, indent=2))
    return report


if __name__ == "__main__":
    main()
