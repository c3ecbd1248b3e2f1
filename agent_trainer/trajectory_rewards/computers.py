"""The multi-turn GRPO reward computer (seed 004's names) and its batched, threaded form."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agent_trainer.config.rewards import RewardComputationConfig
from agent_trainer.trajectory_rewards import answers
from agent_trainer.trajectory_rewards.base import (
    FinishedTrajectory,
    GroundTruth,
    TrajectoryReward,
    TrajectoryRewardComputer,
    get_reward_computer_cls,
    register_reward_computer,
)
from agent_trainer.trajectory_rewards.sandbox import isolation
from envs.base import read_records


def load_ground_truth(path: str | Path) -> dict[str, GroundTruth]:
    """Ground truths keyed by question id from a JSON or JSONL file.

    Accepted shapes: a JSON object ``{id: answer}`` or ``{id: {answer|tests: ...}}``,
    or records (a JSON list, or one JSON object a line) each with ``id`` (or
    ``question_id``) and ``answer`` and/or ``tests`` (see ``GroundTruth.from_record``).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"reward_computation.ground_truth_file {str(path)!r} does not exist; give a JSON/JSONL file")
    if path.suffix == ".json":
        raw = json.loads(path.read_text())
        if isinstance(raw, dict):
            return {str(qid): GroundTruth.from_record(v if isinstance(v, dict) else {"answer": v}, f"{path}[{qid!r}]")
                    for qid, v in raw.items()}
    records = read_records(path)
    out = {}
    for i, rec in enumerate(records):
        qid = rec.get("id", rec.get("question_id"))
        if qid is None:
            raise ValueError(f"{path} record {i} has no 'id' or 'question_id'; it has keys {sorted(rec)}")
        out[str(qid)] = GroundTruth.from_record(rec, f"{path} record {i}")
    return out


@register_reward_computer("grpo")
class GRPOTrajectoryRewardComputer(TrajectoryRewardComputer):
    """0 for bad format, 0 for a wrong answer, ``efficiency_scale / max_context_length`` otherwise."""

    def __init__(self, config: RewardComputationConfig):
        super().__init__(config)
        self.ground_truths = load_ground_truth(config.ground_truth_file) if config.ground_truth_file else {}
        if config.domain == "coding":
            isolation()  # probe the sandbox now: a host that cannot run it fails at start-up, not at step 1

    def ground_truth(self, trajectory: FinishedTrajectory) -> GroundTruth:
        """The row's ground truth, else the file's entry for the question id."""
        if trajectory.ground_truth is not None:
            return trajectory.ground_truth
        if trajectory.question_id in self.ground_truths:
            return self.ground_truths[trajectory.question_id]
        where = (f"reward_computation.ground_truth_file {self.config.ground_truth_file!r}"
                 if self.config.ground_truth_file else "no reward_computation.ground_truth_file is set")
        raise ValueError(f"question {trajectory.question_id!r} has no ground truth in its row, and {where} "
                         "does not hold it; add it to the data or the ground-truth file")

    def compute(self, trajectory: FinishedTrajectory) -> TrajectoryReward:
        """Format rules, then correctness against the ground truth, then the efficiency term."""
        start = time.monotonic()
        truth = self.ground_truth(trajectory)
        answer, verdict = answers.check_format(trajectory, self.config.format_validation)
        format_ok = verdict.ok
        if verdict.ok:
            verdict = self.check_answer(answer, truth)
        length = trajectory.max_context_length
        reward = self.config.efficiency_scale / length if verdict.ok and length > 0 else 0.0
        return TrajectoryReward(reward=reward, format_ok=format_ok, correct=format_ok and verdict.ok,
                                reason=verdict.reason, max_context_length=length, seconds=time.monotonic() - start)

    def check_answer(self, answer: str, truth: GroundTruth) -> answers.Verdict:
        """Correctness in the configured domain."""
        domain = self.config.domain
        if domain == "math":
            return answers.check_math(answer, truth)
        if domain == "coding":
            return answers.check_coding(answer, truth, self.config.sandbox)
        return answers.check_general(answer, truth)


def make_reward_computer(config: RewardComputationConfig) -> TrajectoryRewardComputer:
    """The computer ``reward_computation.type`` names, built from the config."""
    return get_reward_computer_cls(config.type)(config)


@dataclass
class BatchRewards:
    """Rewards of a batch, in input order, with the batch's wall time."""

    rewards: list[TrajectoryReward]
    seconds: float

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        """Mean reward, format and correctness rates, and per-item timing."""
        n = max(len(self.rewards), 1)
        times = [r.seconds for r in self.rewards] or [0.0]
        return {f"{prefix}trajectory_reward_mean": sum(r.reward for r in self.rewards) / n,
                f"{prefix}format_ok_rate": sum(r.format_ok for r in self.rewards) / n,
                f"{prefix}correct_rate": sum(r.correct for r in self.rewards) / n,
                "timing_s/reward_item_mean": sum(times) / len(times),
                "timing_s/reward_item_max": max(times),
                "timing_s/reward_batch": self.seconds}


class BatchTrajectoryRewardComputer:
    """Computes many trajectories' rewards in parallel (threads; coding checks are sandboxed subprocesses)."""

    def __init__(self, computer: TrajectoryRewardComputer, num_workers: int | None = None):
        self.computer = computer
        self.num_workers = num_workers or computer.config.num_workers

    @classmethod
    def from_config(cls, config: RewardComputationConfig) -> "BatchTrajectoryRewardComputer":
        return cls(make_reward_computer(config), config.num_workers)

    def compute_batch(self, trajectories: list[FinishedTrajectory]) -> BatchRewards:
        """One reward per trajectory, in order; each carries its own ``seconds``."""
        start = time.monotonic()
        if self.num_workers == 1 or len(trajectories) <= 1:
            rewards = [self.computer.compute(t) for t in trajectories]
        else:
            with ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="traj-reward") as pool:
                rewards = list(pool.map(self.computer.compute, trajectories))
        return BatchRewards(rewards=rewards, seconds=time.monotonic() - start)
