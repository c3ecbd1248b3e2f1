"""Rollout time with and without the turn barrier on a slow env (benchmark P6 of docs/benchmarks.md, not a test).

Plays the training split of ``config/frozenlake.yaml`` (8 groups x 4 episodes, up to 6 turns)
against one vLLM engine on the tiny model, with FrozenLake steps that sleep a seeded 50-500 ms
long-tailed latency (``bench/slow_envs.yaml``), once per rollout mode
(``actor_rollout_ref.rollout.mode`` = sync | async) and env-actor count. Both modes play the same
group seeds on the same engine and actors in one process; medians over ``--rollouts`` rollouts
after one warm-up. Writes ``turn_barrier_<env>.json`` to a results folder (``bench/results/<UTC stamp>``
unless ``--out``). ``--env fast`` measures the default job's env (no latency) instead.

    python bench/bench_turn_barrier.py [--actors 2 4] [--rollouts 3] [--env slow|fast] [--out DIR] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results import results_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


SLOW_ENV = [f"envs_file={REPO / 'bench' / 'slow_envs.yaml'}", "es_manager.train.env_configs.tags=[SlowFrozenLake3x3]",
            "es_manager.val.env_configs.tags=[SlowFrozenLake3x3]"]


def _config(actors: int, overrides: list[str]):
    from agent_trainer.checks.prepare import compose, prepare

    return prepare(compose("frozenlake", [f"model_path={REPO / 'models' / 'tiny-qwen2'}",
                                          f"agent_proxy.num_env_actors={actors}",
                                          "actor_rollout_ref.rollout.mode=async", *overrides]))


def _release(rollout) -> None:
    """Kill a rollout's env actors and wait until Ray frees their names for the next rollout."""
    import ray

    for i, actor in enumerate(rollout.env_actors):
        ray.kill(actor, no_restart=True)
        while True:
            try:
                ray.get_actor(rollout.env_pool.name(i))
                time.sleep(0.2)
            except ValueError:
                break


def measure(actors: int, rollouts: int, overrides: list[str], engine, tokenizer) -> dict:
    """Median rollout seconds of each mode on the same seeds, and what the episodes did."""
    from agent_trainer.rollout import SyncMultiTurnRollout
    from envs import load_env_tags
    from agent_trainer.workers.env_worker import EnvWorker

    cfg, tags = _config(actors, overrides)
    rollout = SyncMultiTurnRollout(cfg, tokenizer, [engine], EnvWorker, tags or load_env_tags(), split="train",
                                   num_env_actors=actors)
    out: dict = {"env_actors": actors}
    try:
        seeds = [rollout.next_group_seeds() for _ in range(rollouts + 1)]
        for mode in ("sync", "async"):
            rollout.barrier_free = mode == "async"
            seconds, metrics = [], []
            for k, group_seeds in enumerate(seeds):
                start = time.perf_counter()
                result = rollout.rollout(step=k, seeds=group_seeds)
                if k:  # the first rollout is a warm-up
                    seconds.append(time.perf_counter() - start)
                    metrics.append(result.metrics)
            out[mode] = {"rollout_s": statistics.median(seconds), "all_s": seconds,
                         **{key: statistics.mean(m[f"rollout/{key}"] for m in metrics)
                            for key in ("num_turns_mean", "format_error_rate", "response_length_mean")}}
            print(f"env_actors={actors} mode={mode}: {out[mode]}", flush=True)
        out["speedup"] = out["sync"]["rollout_s"] / out["async"]["rollout_s"]
    finally:
        _release(rollout)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actors", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--env", choices=("slow", "fast"), default="slow",
                        help="slow: bench/slow_envs.yaml (50-500 ms per step); fast: config/envs.yaml's FrozenLake3x3")
    parser.add_argument("--out", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    overrides = (SLOW_ENV if args.env == "slow" else []) + overrides
    import ray
    from transformers import AutoTokenizer

    from agent_trainer.ray_cluster import shutdown_ray
    from agent_trainer.workers.rollout import VLLMRolloutWorker

    model = str(REPO / "models" / "tiny-qwen2")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = ray.remote(VLLMRolloutWorker).options(num_cpus=0.5).remote(model, max_model_len=1536)
    tokenizer = AutoTokenizer.from_pretrained(model)
    results = {"config": "frozenlake", "env": args.env, "overrides": overrides,
               "runs": [measure(n, args.rollouts, overrides, engine, tokenizer) for n in args.actors]}
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"turn_barrier_{args.env}.json").write_text(json.dumps(results, indent=2))
    for run in results["runs"]:
        print(f"{run['env_actors']} env actors: sync {run['sync']['rollout_s']:.2f} s, "
              f"async {run['async']['rollout_s']:.2f} s, speedup {run['speedup']:.2f}x")
    print(f"wrote {out / f'turn_barrier_{args.env}.json'}")
    shutdown_ray()


if __name__ == "__main__":
    main()
