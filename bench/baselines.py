"""Baselines no model is needed for, played on the RL config's own held-out episodes; and ``make train``'s report.

    python bench/baselines.py --config-name frozenlake                       # the baseline table
    python bench/baselines.py --config-name frozenlake \\
        --sft-dir outputs/agent_trainer/sft_frozenlake      # + the runs (RL: trainer.default_local_dir)

Every policy plays the validation seeds the RL run evaluates on (``es_manager.val``: seed
``es_manager.seed + 2**30 + group``) for ``agent_proxy.max_turn`` moves, through the env
itself (``envs.make_env``), one action per turn:

- ``random valid``: a uniformly random action of the env's action list each turn;
- ``random Down/Right`` (FrozenLake): Down or Right at random, never reading the map;
- ``best fixed sequence``: the one action sequence that wins the most training episodes
  (seeds below the validation range) played blind, replayed on every held-out seed: the best
  of the expert's most common paths and a beam search over the actions the expert plays
  (``best_fixed_sequence``); what a policy that ignores the observation can reach;
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


def play_episode(env, seed: int, policy: Policy, limit: int, rng: random.Random | None = None) -> tuple:
    """One episode of ``policy`` from ``seed``, ``limit`` moves at most: (last observation, total reward, done,
    last info)."""
    observation, reward, done, info = env.reset(seed=seed), 0.0, False, {}
    for turn in range(limit):
        observation, r, done, info = env.step(policy(env, rng, turn))
        reward += r
        if done:
            break
    return observation, reward, done, info


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
                _, r, _, info = play_episode(env, seed, policy, limit, rng)
                reward += r
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


def blind_outcome(env, seeds, actions: tuple[str, ...]) -> tuple[int, int, tuple]:
    """Play ``actions`` blind on each of ``seeds``: (episodes won, episodes still running, what each seed's
    episode shows now: its last observation, None once it ended)."""
    wins = running = 0
    shown = []
    policy = fixed_sequence(list(actions))
    for seed in seeds:
        observation, _, done, info = play_episode(env, seed, policy, len(actions))
        wins += done and bool(info.get("success", False))
        running += not done
        shown.append(None if done else observation)
    return wins, running, tuple(shown)


def best_fixed_sequence(tag: str, env_tags: dict, train_seeds: range, max_turn: int, paths: int = 20,
                        width: int = 8, search_seeds: int = 256, max_plays: int = 200_000) -> list[str]:
    """The action sequence that wins the most of the first ``search_seeds`` training episodes played blind.

    Candidates: the expert's ``paths`` most common paths on ``train_seeds``, and a beam search over the
    actions the expert plays there and the env lists: ``width`` prefixes a depth, ranked by episodes won plus
    still running (what a longer sequence could still win), a prefix whose episodes all stand where a shorter
    prefix's stood dropped (a move into a wall changes nothing). Ties: the first found, the expert's paths first.
    A sequence shorter than the turn limit ends every episode it plays. The search stops after ``max_plays``
    episodes (an env with many actions and long episodes: the best found by then).
    """
    limit = min(max_turn, normalize_tags(env_tags)[tag].max_actions_per_traj)
    counts = collections.Counter(expert_sequence(tag, env_tags, s, limit) for s in train_seeds)
    seeds = list(train_seeds)[:search_seeds]
    env = make_env(tag, env_tags)
    try:
        env.reset(seed=seeds[0])
        vocabulary = sorted({a for path in counts for a in path} | set(valid_actions(env)))
        best, best_wins = (), -1
        for path, _ in counts.most_common(paths):
            path += (path[-1],) * (limit - len(path))  # as fixed_sequence replays it
            wins = blind_outcome(env, seeds, path)[0]
            if wins > best_wins:
                best, best_wins = path, wins
        beam, seen = [()], {blind_outcome(env, seeds, ())[2]}
        plays = 0
        for depth in range(1, limit + 1):
            ranked = []
            for candidate in (prefix + (action,) for prefix in beam for action in vocabulary):
                plays += len(seeds)
                if plays > max_plays:
                    break
                wins, running, shown = blind_outcome(env, seeds, candidate)
                if (depth == limit or not running) and wins > best_wins:  # complete: a win is kept for good
                    best, best_wins = candidate, wins
                if running and wins + running > best_wins and shown not in seen:
                    seen.add(shown)
                    ranked.append((wins + running, wins, candidate))
            ranked.sort(key=lambda r: (-r[0], -r[1]))
            beam = [candidate for _, _, candidate in ranked[:width]]
            if not beam or plays > max_plays:
                break
    finally:
        env.close()
    return list(best)


def baselines(tag: str, env_tags: dict, val_seeds: list[int], max_turn: int, repeats: int = 8,
              train_seeds: range = range(1000)) -> dict[str, Score]:
    """Every baseline that applies to ``tag``: FrozenLake's heuristics on FrozenLake only, random valid actions
    where the env lists its actions, the best fixed sequence and the expert where it has an expert."""
    env = make_env(tag, env_tags)
    try:
        is_frozen_lake = isinstance(env, FrozenLakeEnv)
        has_expert = has_expert_solver(env)
        env.reset(seed=val_seeds[0])
        lists_actions = bool(valid_actions(env))  # prose actions ("a whole number from 1 to 10"): none to draw from
    finally:
        env.close()
    policies: dict[str, tuple[Policy, int]] = {"random valid": (random_valid, repeats)} if lists_actions else {}
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


def baseline_rows(scores: dict[str, Score]) -> list[dict]:
    """The baselines as data: name, success, whether the policy looks at the observation."""
    return [{"name": name, "success": round(score.success, 4), "reads_observation": _reads(name)}
            for name, score in scores.items()]


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
        "baselines": baseline_rows(scores),
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


DISTILL_TARGET = 0.9
"""make distill's bar: held-out greedy success each method must reach (the teacher is checked against it too)."""


def episodes_per_step(cfg) -> int:
    """Episodes one RL step samples (``es_manager.train``: groups x group size)."""
    return cfg.es_manager.train.env_groups * cfg.es_manager.train.group_size


def reached(records: list[dict], target: float, per_step: int) -> dict:
    """When a run's held-out greedy success first reached ``target``: the validation step, the sampled episodes
    up to it (step x ``per_step``) and the validation before it (the step lies after that one: validations are
    ``trainer.test_freq`` apart); None where it never did. Also the run's start, end and steps run."""
    points = val_points(records)
    steps = [int(r["step"]) for r in records if "rollout/success_rate" in r]
    first = next((i for i, (_, v) in enumerate(points) if v >= target), None)
    last_step = max(steps, default=points[-1][0] if points else 0)
    return {
        "start": points[0][1] if points else None,
        "end": points[-1][1] if points else None,
        "best": max((v for _, v in points), default=None),
        "steps": last_step,
        "sampled_episodes": last_step * per_step,
        "reached_at_step": None if first is None else points[first][0],
        "episodes_to_reach": None if first is None else points[first][0] * per_step,
        "previous_validation_step": None if not first else points[first - 1][0],
    }


def check_teacher(sft_dir: Path, target: float = DISTILL_TARGET) -> str | None:
    """None when the SFT run's last evaluation reaches ``target``; else the one line saying why it cannot teach."""
    points = val_points(read_metrics(sft_dir))
    if not points:
        return f"{sft_dir}: no evaluation in metrics.jsonl (val/success_rate); the teacher was not checked"
    step, value = points[-1]
    print(f"Teacher {sft_dir}: held-out greedy success {value:.3f} at step {step}", flush=True)
    if value < target:
        return (f"{sft_dir}: held-out greedy success {value:.3f} at step {step}, below {target}: a teacher that does "
                "not read the map cannot show distillation (docs/distillation.md, \"Pilots\": on make train's "
                "model the noting reader's SFT did not read)")
    return None


def distill_summary(cfg, distill_records: list[dict], rl_records: list[dict], teacher_records: list[dict],
                    scores: dict[str, Score], wall_s: float | None, target: float = DISTILL_TARGET) -> dict:
    """make distill's result as data (``distill_summary.json``): the teacher's held-out greedy success (its SFT
    run's last evaluation, on the same seeds), the student's start, the distillation run and the RL run on reward
    alone from the same start (each: start, end, and the sampled episodes it needed to reach ``target``), the ratio
    of the two (RL's whole budget where it never got there) and the baselines on the same seeds."""
    per_step = episodes_per_step(cfg)
    teacher = val_points(teacher_records)
    distill, rl = reached(distill_records, target, per_step), reached(rl_records, target, per_step)
    rl_needed = rl["episodes_to_reach"] if rl["episodes_to_reach"] is not None else rl["sampled_episodes"]
    ratio = (distill["episodes_to_reach"] / rl_needed
             if distill["episodes_to_reach"] is not None and rl_needed else None)
    return {
        "task": ", ".join(cfg.es_manager.val.tags),
        "held_out_episodes": cfg.es_manager.val.env_groups * cfg.es_manager.val.group_size,
        "target": target,
        "episodes_per_step": per_step,
        "teacher": teacher[-1][1] if teacher else None,
        "student_start": distill["start"],
        "distill": distill,
        "rl": rl,
        "episode_ratio": None if ratio is None else round(ratio, 4),
        "rl_reached": rl["episodes_to_reach"] is not None,
        "meets": bool(ratio is not None and ratio <= 0.5 and (distill["end"] or 0) >= target),
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "baselines": baseline_rows(scores),
    }


def distill_report(summary: dict, scores: dict[str, Score]) -> str:
    """make distill's table: teacher, student start, student after distillation, RL on reward alone, baselines
    (held-out greedy success on the same seeds), with the sampled episodes each run needed to reach the target."""
    target = summary["target"]

    def needed(run: dict) -> str:
        if run["reached_at_step"] is None:
            return f"not within {run['sampled_episodes']} ({run['steps']} steps)"
        after = run["previous_validation_step"]
        return (f"{run['episodes_to_reach']} (step {run['reached_at_step']}"
                + (f"; not yet at step {after}" if after is not None else "") + ")")

    d, rl = summary["distill"], summary["rl"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    rows = [("teacher (its SFT run's last evaluation)", fmt(summary["teacher"]), ""),
            ("student start (make train's warm start)", fmt(summary["student_start"]), ""),
            (f"student after distillation (step {d['steps']})", fmt(d["end"]), needed(d)),
            (f"RL on reward alone (step {rl['steps']})", fmt(rl["end"]), needed(rl))]
    rows += [(name, f"{score.success:.3f}", "") for name, score in scores.items()]
    width = max(len(r[0]) for r in rows)
    lines = [f"Held-out greedy success on {summary['held_out_episodes']} validation seeds ({summary['task']}); "
             f"sampled episodes to reach {target} ({summary['episodes_per_step']} per step, measured at each "
             "validation):",
             f"{'policy'.ljust(width)}  success  sampled episodes to {target}",
             f"{'-' * width}  -------  {'-' * 26}"]
    lines += [f"{name.ljust(width)}  {succ:>7}  {need}".rstrip() for name, succ, need in rows]
    ratio = summary["episode_ratio"]
    if ratio is None:
        lines.append(f"Distillation did not reach {target}: no ratio.")
    else:
        of = "what RL needed" if summary["rl_reached"] else "RL's whole budget (RL never reached it)"
        lines.append(f"Distillation needed {ratio:.2f} of {of}: {'meets' if summary['meets'] else 'short of'} "
                     f"the goal of at most 0.50 with the student ending at {target} or above.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Compose the RL config (validated like a run), print the table."""
    from agent_trainer.checks.prepare import compose_and_prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-name", default="frozenlake", help="the RL config (config/<name>.yaml)")
    parser.add_argument("--sft-dir", type=Path, default=None, help="an SFT run folder (metrics.jsonl)")
    parser.add_argument("--rl-dir", type=Path, default=None,
                        help="an RL run folder (metrics.jsonl); default: the RL config's trainer.default_local_dir")
    parser.add_argument("--repeats", type=int, default=8, help="episodes per seed of the random policies")
    parser.add_argument("--started-at", type=float, default=None,
                        help="Unix time the whole job started (make train passes it): wall_s in the summary")
    parser.add_argument("--distill-dir", type=Path, default=None,
                        help="a distillation run folder (make distill): print its comparison with --rl-dir and "
                             "--teacher-dir instead, and write distill_summary.json there")
    parser.add_argument("--teacher-dir", type=Path, default=None,
                        help="the teacher's SFT run folder (its last evaluation is the teacher's held-out success)")
    parser.add_argument("--check-teacher", type=Path, default=None, metavar="SFT_DIR",
                        help=f"only check that this SFT run's last evaluation (held-out greedy success) reaches "
                             f"{DISTILL_TARGET}: exit 1 with the figure when it does not (make distill's teacher)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the RL config")
    args = parser.parse_args(argv)
    if args.check_teacher is not None:
        sys.exit(check_teacher(args.check_teacher))
    cfg, env_tags = compose_and_prepare(args.overrides, config_name=args.config_name)
    rl_dir = args.rl_dir or Path(cfg.trainer.default_local_dir)
    scores = baseline_scores(cfg, env_tags, args.repeats)
    records = read_metrics(rl_dir)
    if args.distill_dir is not None:
        wall = None if args.started_at is None else time.time() - args.started_at
        summary = distill_summary(cfg, read_metrics(args.distill_dir), records,
                                  read_metrics(args.teacher_dir) if args.teacher_dir else [], scores, wall)
        print(distill_report(summary, scores), flush=True)
        path = args.distill_dir / "distill_summary.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"Wrote {path}", flush=True)
        return
    print(report(cfg, env_tags, args.sft_dir, records, args.repeats, scores), flush=True)
    if records:
        wall = None if args.started_at is None else time.time() - args.started_at
        path = rl_dir / "learning_summary.json"
        path.write_text(json.dumps(learning_summary(cfg, records, scores, wall), indent=2) + "\n")
        print(f"Wrote {path}", flush=True)


if __name__ == "__main__":
    main()
