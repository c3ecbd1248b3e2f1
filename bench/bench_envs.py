"""Micro-benchmark of the environments and of the env actors.

Reports, per environment: env steps per second (time inside ``step`` only,
actions from the expert solver so episodes are realistic), resets per
second, and the expert's success rate and return (the oracle line). Then the
env-actor overhead: the time of one turn for N episodes through a Ray actor
(``agent_trainer.workers.env_worker.EnvWorker``) minus the same turn on a local
``EnvStateManager``.

    python bench/bench_envs.py                 # all envs + Ray round trip
    python bench/bench_envs.py --envs frozen_lake sokoban --no-ray --seconds 0.5
    python bench/bench_envs.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import envs  # noqa: E402

DEFAULT_CASES = {
    "frozen_lake": {"size": 4},
    "sokoban": {"dim_room": [6, 6], "num_boxes": 1},
    "bandit": {},
    "countdown": {"num_operands": 3},
    "metamathqa": {},
    "webshop": {},
    "textworld": {"num_games": 2, "world_size": 2, "nb_objects": 4, "quest_length": 2},
    "GuessNumber": {},
}


def bench_env(name: str, overrides: dict, seconds: float) -> dict:
    """Step an env with expert actions for about ``seconds`` of step time."""
    env = envs.make_env(name, **overrides)
    step_time = reset_time = 0.0
    steps = episodes = successes = 0
    returns = []
    seed = 0
    while step_time < seconds and episodes < 100_000:
        t0 = time.perf_counter()
        env.reset(seed=seed)
        reset_time += time.perf_counter() - t0
        total, info = 0.0, {}
        for _ in range(200):
            action = env.expert_action()
            t0 = time.perf_counter()
            _, reward, done, info = env.step(action)
            step_time += time.perf_counter() - t0
            steps += 1
            total += reward
            if done:
                break
        episodes += 1
        successes += bool(info.get("success"))
        returns.append(total)
        seed += 1
    env.close()
    return {"env": name, "steps_per_s": steps / step_time, "resets_per_s": episodes / reset_time,
            "episodes": episodes, "expert_success": successes / episodes,
            "expert_return": statistics.mean(returns)}


def bench_actor(tag: str, n_episodes: int, turns: int) -> dict:
    """Per-turn time of a local EnvStateManager vs the same calls through a Ray actor."""
    import ray

    from agent_trainer.episode.es_manager import EnvInput, EnvStateManager, EpisodeSpec
    from agent_trainer.ray_cluster import shutdown_ray
    from agent_trainer.workers.env_worker import EnvWorker

    tags = envs.load_env_tags()
    episodes = [EpisodeSpec(i, i, tag) for i in range(n_episodes)]
    seeds = {i: i for i in range(n_episodes)}
    # A cycle of valid actions so every turn executes one step per episode.
    inputs = [[EnvInput(i, "<answer>x</answer>", [a]) for i in range(n_episodes)]
              for a in ["Left", "Down", "Right", "Up"]]

    def run(call_reset, call_step) -> float:
        times = []
        for t in range(turns):
            if t % 8 == 0:
                call_reset(seeds)
            t0 = time.perf_counter()
            call_step(inputs[t % 4])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    local = EnvStateManager(tags, episodes)
    local_turn = run(local.reset, local.step)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = EnvWorker.remote(tags, episodes)
    ray.get(actor.reset.remote(seeds))
    remote_turn = run(lambda s: ray.get(actor.reset.remote(s)), lambda x: ray.get(actor.step.remote(x)))
    ray.kill(actor)
    if started:
        shutdown_ray()
    return {"tag": tag, "episodes": n_episodes, "local_turn_ms": local_turn * 1e3,
            "actor_turn_ms": remote_turn * 1e3, "overhead_ms_per_turn": (remote_turn - local_turn) * 1e3}


def main() -> None:
    """Run the benchmarks and print a table (and optionally JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="*", default=list(DEFAULT_CASES))
    parser.add_argument("--seconds", type=float, default=1.0, help="step time budget per env")
    parser.add_argument("--no-ray", action="store_true", help="skip the env-actor round trip")
    parser.add_argument("--episodes", type=int, default=16, help="episodes hosted by the benchmarked actor")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    results = {"envs": [], "actor": None}
    with tempfile.TemporaryDirectory() as tw_cache:
        print(f"{'env':<14} {'steps/s':>10} {'resets/s':>10} {'episodes':>9} {'expert success':>15} {'expert return':>14}")
        for name in args.envs:
            overrides = dict(DEFAULT_CASES.get(name, {}))
            if name == "textworld":
                overrides["cache_dir"] = tw_cache
            try:
                r = bench_env(name, overrides, args.seconds)
            except ImportError as exc:
                print(f"{name:<14} skipped: {exc}")
                continue
            results["envs"].append(r)
            print(f"{name:<14} {r['steps_per_s']:>10.0f} {r['resets_per_s']:>10.0f} {r['episodes']:>9d} "
                  f"{r['expert_success']:>15.2f} {r['expert_return']:>14.2f}")
    if not args.no_ray:
        r = bench_actor("FrozenLake", args.episodes, args.turns)
        results["actor"] = r
        print(f"\nenv actor, {r['episodes']} FrozenLake episodes per turn: local {r['local_turn_ms']:.2f} ms, "
              f"through Ray {r['actor_turn_ms']:.2f} ms, overhead {r['overhead_ms_per_turn']:.2f} ms per turn")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
