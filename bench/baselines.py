"""Baselines no model is needed for, played on the RL config's own held-out episodes; and ``make train``'s report.

    python bench/baselines.py --config-name frozenlake                       # the baseline table
    python bench/baselines.py --config-name frozenlake \\
        --sft-dir outputs/agent_trainer/sft_frozenlake      # + the runs (RL: trainer.default_local_dir)

Every policy plays the validation seeds the RL run evaluates on (``es_manager.val``: seed
``es_manager.seed + 2**30 + group``) for ``agent_proxy.max_turn`` moves, through the env
itself (``envs.make_env``), one action per turn:

- ``random valid``: a uniformly random action of the env's action list each turn;
- ``random Down/Right`` (FrozenLake): Down or Right at random, never reading the map;
- ``best fixed sequence``: the expert's most common action sequence on training seeds
  (seeds below the validation range), replayed blindly on every held-out map: the best a
  policy that ignores the observation can do when one sequence solves many maps;
- ``safe Down/Right`` (FrozenLake): Down or Right at random among those not leading into a
  hole or off the map: a heuristic that reads the tiles next to the player;
- ``expert``: the env's expert solver (``expert_action``).

Random policies play ``--repeats`` episodes per seed (seeded); the table gives greedy
success rates of the model runs (val/success_rate of the RL run's first and last validation:
step 0 is the SFT warm start on exactly these seeds) beside the baselines.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent_trainer.episode.es_manager import held_out_seeds  # noqa: E402
from agent_trainer.agents.demonstrations import has_expert as has_expert_solver, valid_actions  # noqa: E402
from envs import make_env  # noqa: E402
from envs.frozen_lake import FrozenLakeEnv, down_right_neighbours  # noqa: E402
from envs.registry import normalize_tags  # noqa: E402

Policy = Callable[[object, random.Random, int], str]
"""(env after reset/steps, rng, turn index) -> action text."""


@dataclass
class Score:
    """A policy's mean over episodes: success rate and total env reward."""

    success: float
    reward: float
    episodes: int


def random_valid(env, rng: random.Random, turn: int) -> str:
    """A uniformly random valid action (an env that describes its actions in prose: that description)."""
    return rng.choice(valid_actions(env) or [env.action_description().strip()])


def random_down_right(env, rng: random.Random, turn: int) -> str:
    """Down or Right at random (FrozenLake's goal is always down and to the right)."""
    return rng.choice(["Down", "Right"])


def safe_down_right(env, rng: random.Random, turn: int) -> str:
    """Down or Right at random among the moves that stay on the map and out of holes (reads the neighbours)."""
    safe = [name for name, (r, c) in down_right_neighbours(env.desc, *env.position).items() if env.desc[r][c] != "H"]
    return rng.choice(safe or ["Down", "Right"])


def expert(env, rng: random.Random, turn: int) -> str:
    """The env's expert solver."""
    return env.expert_action()


def fixed_sequence(actions: list[str]) -> Policy:
    """Replay ``actions`` whatever the observation (the last one repeats if the episode runs longer)."""
    def policy(env, rng: random.Random, turn: int) -> str:
        return actions[min(turn, len(actions) - 1)]
    return policy


def play(tag: str, env_tags: dict, seeds: list[int], policy: Policy, max_turn: int, repeats: int = 1,
         rng_seed: int = 0) -> Score:
    """Mean success and reward of ``policy`` over ``seeds`` x ``repeats`` episodes of ``max_turn`` moves at most."""
    env = make_env(tag, env_tags)
    limit = min(max_turn, normalize_tags(env_tags)[tag].max_actions_per_traj)
    rng = random.Random(rng_seed)
    wins = reward = 0.0
    try:
        for seed in seeds:
            for _ in range(repeats):
                env.reset(seed=seed)
                info: dict = {}
                for turn in range(limit):
                    _, r, done, info = env.step(policy(env, rng, turn))
                    reward += r
                    if done:
                        break
                wins += bool(info.get("success", False))
    finally:
        env.close()
    n = len(seeds) * repeats
    return Score(success=wins / n, reward=reward / n, episodes=n)


def expert_sequence(tag: str, env_tags: dict, seed: int, max_turn: int) -> tuple[str, ...]:
    """The expert's actions on the episode of ``seed``."""
    env = make_env(tag, env_tags)
    try:
        env.reset(seed=seed)
        actions = []
        for _ in range(max_turn):
            actions.append(env.expert_action())
            if env.step(actions[-1])[2]:
                break
        return tuple(actions)
    finally:
        env.close()


def best_fixed_sequence(tag: str, env_tags: dict, train_seeds: range, max_turn: int) -> list[str]:
    """The expert's most common action sequence on ``train_seeds`` (ties: the first seen)."""
    counts = collections.Counter(expert_sequence(tag, env_tags, s, max_turn) for s in train_seeds)
    return list(counts.most_common(1)[0][0])


def baselines(tag: str, env_tags: dict, val_seeds: list[int], max_turn: int, repeats: int = 8,
              train_seeds: range = range(1000)) -> dict[str, Score]:
    """Every baseline that applies to ``tag`` (FrozenLake-only heuristics are skipped elsewhere)."""
    env = make_env(tag, env_tags)
    is_frozen_lake = isinstance(env, FrozenLakeEnv)
    has_expert = has_expert_solver(env)
    env.close()
    policies: dict[str, tuple[Policy, int]] = {"random valid": (random_valid, repeats)}
    if is_frozen_lake:
        policies["random Down/Right"] = (random_down_right, repeats)
    if has_expert:
        policies["best fixed sequence"] = (fixed_sequence(best_fixed_sequence(tag, env_tags, train_seeds, max_turn)), 1)
    if is_frozen_lake:
        policies["safe Down/Right (reads the neighbours)"] = (safe_down_right, repeats)
    if has_expert:
        policies["expert"] = (expert, 1)
    return {name: play(tag, env_tags, val_seeds, policy, max_turn, n) for name, (policy, n) in policies.items()}


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` (data: ``json.loads`` only)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def val_points(records: list[dict], key: str = "val/success_rate") -> list[tuple[int, float]]:
    """(step, value) of every record holding ``key``."""
    return [(int(r["step"]), float(r[key])) for r in records if key in r]


def training_window_means(records: list[dict], window: int = 5,
                          key: str = "rollout/success_rate") -> tuple[float, float] | None:
    """Mean of ``key`` over the first and over the last ``window`` training steps (None for a shorter run)."""
    values = [float(r[key]) for r in records if key in r]
    if len(values) < 2 * window:
        return None
    return sum(values[:window]) / window, sum(values[-window:]) / window


def training_trend(records: list[dict], window: int = 5, key: str = "rollout/success_rate") -> str | None:
    """The sampled training episodes' success over the first and the last ``window`` steps (what RL trains on)."""
    means = training_window_means(records, window, key)
    if means is None:
        return None
    return (f"Sampled training success (the episodes RL trains on): {means[0]:.3f} over steps 1-{window}"
            f" -> {means[1]:.3f} over the last {window} steps.")


READS_OBSERVATION = {"random valid": False, "random Down/Right": False, "best fixed sequence": False,
                     "safe Down/Right (reads the neighbours)": True, "expert": True}
"""Whether each baseline looks at the observation: a trained policy must beat the ones that do not."""
GOAL_GAIN, GOAL_MARGIN = 0.20, 0.10
"""What learning from reward should show on make train: held-out greedy success up by GOAL_GAIN from the RL
start, and GOAL_MARGIN above every baseline that ignores the observation."""


def baseline_scores(cfg, env_tags: dict, repeats: int = 8) -> dict[str, Score]:
    """Every baseline of every validation tag on the RL run's held-out seeds, named ``<policy> [<tag>]``."""
    seeds = held_out_seeds(cfg)
    return {f"{name} [{tag}]": score for tag in cfg.es_manager.val.tags
            for name, score in baselines(tag, env_tags, seeds, cfg.agent_proxy.max_turn, repeats).items()}


def _reads(name: str) -> bool:
    return READS_OBSERVATION[name.rsplit(" [", 1)[0]]


def learning_summary(cfg, records: list[dict], scores: dict[str, Score], wall_s: float | None) -> dict:
    """make train's result as data (``learning_summary.json``): the RL run's first and last held-out greedy
    success, its sampled training success over the first and last 5 steps, and the baselines on the same seeds."""
    success = val_points(records)
    sampled = training_window_means(records)
    return {
        "task": ", ".join(cfg.es_manager.val.tags),
        "held_out_episodes": cfg.es_manager.val.env_groups * cfg.es_manager.val.group_size,
        "rl_start": success[0][1] if success else None,
        "rl_end": success[-1][1] if success else None,
        "sampled_first5": round(sampled[0], 4) if sampled else None,
        "sampled_last5": round(sampled[1], 4) if sampled else None,
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "baselines": [{"name": name, "success": round(score.success, 4), "reads_observation": _reads(name)}
                      for name, score in scores.items()],
    }


def verdict(summary: dict) -> str | None:
    """One line: the RL gain and the margin over the best baseline that ignores the observation, against the goal."""
    if summary["rl_start"] is None:
        return None
    gain = summary["rl_end"] - summary["rl_start"]
    blind = max((b for b in summary["baselines"] if not b["reads_observation"]), key=lambda b: b["success"],
                default=None)
    line = (f"RL gain over its start: {gain:+.3f} ({'meets' if gain >= GOAL_GAIN else 'short of'} the goal of "
            f"+{GOAL_GAIN:.3f})")
    if blind is not None:
        margin = summary["rl_end"] - blind["success"]
        line += (f"; RL end {margin:+.3f} against the best policy that ignores the observation ({blind['name']}, "
                 f"{blind['success']:.3f}): {'meets' if margin >= GOAL_MARGIN else 'short of'} the goal of "
                 f"+{GOAL_MARGIN:.3f}")
    return line + "."


def report(cfg, env_tags: dict, sft_dir: Path | None, records: list[dict], repeats: int = 8,
           scores: dict[str, Score] | None = None) -> str:
    """The comparison table: model runs (greedy, held-out; ``records``: the RL run's metrics) and baselines on the
    same seeds."""
    seeds = held_out_seeds(cfg)
    rows: list[tuple[str, str, str]] = []
    if sft_dir is not None:
        sft = val_points(read_metrics(sft_dir))
        if sft:
            rows.append((f"SFT (its own evaluation after step {sft[-1][0]})", f"{sft[-1][1]:.3f}", ""))
    success, reward = val_points(records), dict(val_points(records, "val/episode_reward_mean"))
    if success:
        (s0, v0), (s1, v1) = success[0], success[-1]
        rows.append((f"RL start (step {s0})", f"{v0:.3f}", f"{reward.get(s0, float('nan')):.3f}"))
        rows.append((f"RL end (step {s1})", f"{v1:.3f}", f"{reward.get(s1, float('nan')):.3f}"))
    scores = baseline_scores(cfg, env_tags, repeats) if scores is None else scores
    rows += [(name, f"{score.success:.3f}", f"{score.reward:.3f}") for name, score in scores.items()]
    width = max(len(r[0]) for r in rows)
    lines = [f"Held-out greedy success on {len(seeds)} validation seeds ({', '.join(cfg.es_manager.val.tags)}, "
             f"{cfg.agent_proxy.max_turn} turns):",
             f"{'policy'.ljust(width)}  success  reward", f"{'-' * width}  -------  ------"]
    lines += [f"{name.ljust(width)}  {succ:>7}  {rew:>6}" for name, succ, rew in rows]
    trend = training_trend(records)
    summary_line = verdict(learning_summary(cfg, records, scores, None))
    return "\n".join(lines + ([trend] if trend else []) + ([summary_line] if summary_line else []))


def main(argv: list[str] | None = None) -> None:
    """Compose the RL config (validated like a run), print the table."""
    from agent_trainer.main import compose_and_prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-name", default="frozenlake", help="the RL config (config/<name>.yaml)")
    parser.add_argument("--sft-dir", type=Path, default=None, help="an SFT run folder (metrics.jsonl)")
    parser.add_argument("--rl-dir", type=Path, default=None,
                        help="an RL run folder (metrics.jsonl); default: the RL config's trainer.default_local_dir")
    parser.add_argument("--repeats", type=int, default=8, help="episodes per seed of the random policies")
    parser.add_argument("--started-at", type=float, default=None,
                        help="Unix time the whole job started (make train passes it): wall_s in the summary")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the RL config")
    args = parser.parse_args(argv)
    cfg, env_tags = compose_and_prepare(args.overrides, config_name=args.config_name)
    rl_dir = args.rl_dir or Path(cfg.trainer.default_local_dir)
    scores = baseline_scores(cfg, env_tags, args.repeats)
    records = read_metrics(rl_dir)
    print(report(cfg, env_tags, args.sft_dir, records, args.repeats, scores), flush=True)
    if records:
        wall = None if args.started_at is None else time.time() - args.started_at
        path = rl_dir / "learning_summary.json"
        path.write_text(json.dumps(learning_summary(cfg, records, scores, wall), indent=2) + "\n")
        print(f"Wrote {path}", flush=True)


if __name__ == "__main__":
    main()
