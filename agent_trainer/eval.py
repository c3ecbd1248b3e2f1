"""Evaluate a model (a checkpoint's ``actor`` folder, or any HF model) on the validation split; no training.

    python -m agent_trainer.eval --config-name frozenlake model_path=<run dir>/global_step_N/actor eval.k=4

Only the rollout engines and the val env actors start: no FSDP actor, optimizer, critic or
reference. Two passes over the same validation seeds (``es_manager.val``):

- greedy: temperature 0, one episode per seed;
- sampled: ``eval.k`` episodes per seed with the training sampling (``rollout.temperature``,
  ``top_p``, ``top_k``); pass@k = the fraction of seeds where any of the k succeeded.

``<eval.output_dir>/eval_report.json`` holds both passes, overall and per env tag; a sample of
episodes goes to ``<eval.output_dir>/trajectories/`` with its ``viewer.html``. The config is
validated exactly as for training (one line naming the key on a mistake, before Ray starts).
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent_trainer import cli_args
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import Split
from agent_trainer.worker_registry import worker_api

if TYPE_CHECKING:
    from agent_trainer.es_manager import EpisodeState

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = "frozenlake"
"""The config ``--config-name`` names when it is not given (as for agent_trainer.main)."""
REPORT = "eval_report.json"


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
    from agent_trainer import lifecycle
    from agent_trainer.rollout import SyncMultiTurnRollout
    from agent_trainer.trajectories import write_step

    rollout = SyncMultiTurnRollout(cfg, tokenizer, engines, env_worker_cls, env_tags, split=Split.VAL,
                                   num_env_actors=cfg.agent_proxy.num_env_actors)
    try:
        result = rollout.rollout(0)
    finally:
        lifecycle.kill_actors(rollout.env_actors)
    write_step(cfg.eval.output_dir, 0, f"val_{name}", result.states, result.batch, tokenizer,
               cfg.trainer.log_trajectories_per_tag)
    return summarize(result.states, pass_key)


def evaluate(cfg: AgentTrainerConfig, env_tags: dict) -> dict:
    """Start engines and val env actors, run the greedy and the sampled pass, write the report; return it."""
    import dataclasses

    import ray
    import torch
    from transformers import AutoTokenizer

    from agent_trainer.main import init_ray
    build_engines, resolve_device = worker_api("build_engines"), worker_api("resolve_device")

    out = Path(cfg.eval.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    init_ray(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, default_local_dir=str(out))))
    engine_group = build_engines(cfg, resolve_device(cfg.trainer.device))
    env_worker_cls = worker_api("env_actor_class")(cfg)
    try:
        report = {"model_path": cfg.actor_rollout_ref.model.path, "seeds": cfg.es_manager.val.env_groups,
                  "greedy": run_pass(greedy_config(cfg), tokenizer, engine_group.workers, env_worker_cls, env_tags, "greedy")}
        if cfg.eval.k > 0:
            sampled = run_pass(sampled_config(cfg), tokenizer, engine_group.workers, env_worker_cls, env_tags,
                               "sampled", pass_key=f"pass@{cfg.eval.k}")
            report["sampled"] = {"k": cfg.eval.k, "temperature": cfg.actor_rollout_ref.rollout.temperature, **sampled}
    finally:
        engine_group.shutdown()
        ray.shutdown()
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    logger.info("evaluation report: %s; episodes: %s", out / REPORT, out / "trajectories" / "viewer.html")
    return report


def main(argv: Sequence[str] | None = None) -> dict | None:
    """Console entry point (``--config-name NAME`` and ``key=value`` overrides, ``--help``; ``agent_trainer.cli_args``);
    a config mistake exits with one line before Ray starts."""
    from agent_trainer.checks.rl import check_eval
    from agent_trainer.main import CONFIG_DIR, compose_and_prepare, refusal

    args = cli_args.command_line(sys.argv[1:] if argv is None else argv, "python -m agent_trainer.eval",
                                 __doc__.splitlines()[0], DEFAULT_CONFIG, CONFIG_DIR)
    if args is None:
        return None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = args.overrides
    cfg, env_tags = compose_and_prepare(overrides, config_name=args.config_name)
    try:
        check_eval(cfg)
    except ValueError as err:
        raise SystemExit(refusal(err, overrides)) from None
    report = evaluate(cfg, env_tags)
    print(json.dumps({k: v for k, v in report.items() if k != "per_tag"}, indent=2))
    return report


if __name__ == "__main__":
    main()
