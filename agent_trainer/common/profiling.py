"""Trajectory profiling (``trajectory_profiling.*``): where a multi-turn rollout spends its time and context.

Per training step, with ``trajectory_profiling.enable`` (names for the train split; other
splits put their metric prefix in front, e.g. ``val/timing_s/generate``):

| metric | meaning |
| --- | --- |
| ``timing_s/generate``, ``timing_s/generate_turn_<k>`` | engine time of the turns (not summaries): total, per turn |
| ``timing_s/env_step``, ``timing_s/env_step_turn_<k>`` | env actor time of the turns |
| ``timing_s/condensation`` | building every condensed prompt, the summaries' generation included |
| ``timing_s/summary_generate`` | the engine calls that wrote summaries (part of condensation) |
| ``profile/context_tokens_before_turn_<k>`` | mean over episodes of turn k's prompt as the full conversation |
| ``profile/context_tokens_after_turn_<k>`` | mean over episodes of turn k's condensed prompt, in tokens |
| ``profile/context_tokens_max`` / ``_before_max`` | the largest condensed / uncondensed prompt of the step |
| ``profile/tokens_saved`` | sum over rows of (before - after): prompt tokens condensation kept out of the rows |
| ``profile/summaries``, ``profile/summary_tokens`` | summaries the policy wrote and their tokens (never trained on) |
| ``timing_s/reward_computation``, ``timing_s/reward_item_max`` | reward computers: the batch, its slowest item |

The condensation group (``ctx_manager.mode=condensed`` only) and the reward group follow
``profile_context_condensation`` and ``profile_reward_computation``. Trajectory reward rates (``rollout/trajectory_reward_mean``,
``rollout/correct_rate``, ``rollout/format_ok_rate``) are logged whenever
``reward_computation.enable``, profiling or not.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import numpy as np

PHASES = ("generate", "env_step")
"""The per-turn phases the rollout times (``TurnTimings.phase``)."""


class TurnTimings:
    """Seconds spent per (phase, turn) in one rollout; filled by the rollout's turn loop."""

    def __init__(self):
        self.seconds: dict[tuple[str, int], float] = defaultdict(float)
        self._lock = threading.Lock()  # rollout.mode=async times phases from several lane threads

    @contextmanager
    def phase(self, name: str, turn: int) -> Iterator[None]:
        """Time the block as ``name`` of turn ``turn`` (0-based; reported 1-based)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[(name, turn + 1)] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``timing_s/<phase>`` totals and ``timing_s/<phase>_turn_<k>``."""
        out = {f"timing_s/{name}": 0.0 for name in PHASES}
        for (name, turn), sec in sorted(self.seconds.items()):
            out[f"timing_s/{name}_turn_{turn}"] = sec
            out[f"timing_s/{name}"] = out.get(f"timing_s/{name}", 0.0) + sec
        return out


def condensation_metrics(episodes: list) -> dict[str, float]:
    """Context lengths per turn before/after condensation, tokens saved, condensation and summary time."""
    before, after = defaultdict(list), defaultdict(list)
    rows = [r for e in episodes for r in getattr(e, "rows", [])]
    for r in rows:
        before[r.turn].append(r.uncondensed_tokens)
        after[r.turn].append(len(r.prompt_ids))
    summaries = [s for e in episodes for s in getattr(e, "summaries", [])]
    out = {
        "timing_s/condensation": float(sum(r.condense_seconds for r in rows)),
        "timing_s/summary_generate": float(sum(s.seconds for s in summaries)),
        "profile/context_tokens_max": float(max((len(r.prompt_ids) for r in rows), default=0)),
        "profile/context_tokens_before_max": float(max((r.uncondensed_tokens for r in rows), default=0)),
        "profile/tokens_saved": float(sum(r.uncondensed_tokens - len(r.prompt_ids) for r in rows)),
        "profile/summaries": float(len(summaries)),
        "profile/summary_tokens": float(sum(len(s.output_ids) for s in summaries)),
    }
    for turn in sorted(before):
        out[f"profile/context_tokens_before_turn_{turn}"] = float(np.mean(before[turn]))
        out[f"profile/context_tokens_after_turn_{turn}"] = float(np.mean(after[turn]))
    return out


def reward_rates(rewards, prefix: str) -> dict[str, float]:
    """Mean trajectory reward, correct and format-ok rates of a ``BatchRewards``."""
    items = rewards.rewards
    n = max(len(items), 1)
    return {f"{prefix}/trajectory_reward_mean": sum(r.reward for r in items) / n,
            f"{prefix}/correct_rate": sum(r.correct for r in items) / n,
            f"{prefix}/format_ok_rate": sum(r.format_ok for r in items) / n}


def reward_timing(rewards) -> dict[str, float]:
    """The reward batch's wall time and its slowest item."""
    return {"timing_s/reward_computation": rewards.seconds,
            "timing_s/reward_item_max": max((r.seconds for r in rewards.rewards), default=0.0)}


def rollout_profile(cfg, ctx_manager, timings: TurnTimings | None, episodes: list, prefix: str) -> dict[str, float]:
    """The profile metrics of one rollout (``cfg`` is the whole ``AgentTrainerConfig``).

    ``episodes``: the rollout's played episodes; ``ctx_manager`` holds the last
    trajectory rewards (``CondensedContextManager.last_rewards``) when they are on.
    """
    rewards = getattr(ctx_manager, "last_rewards", None)
    out = reward_rates(rewards, prefix) if rewards is not None else {}
    prof = cfg.trajectory_profiling
    if not prof.enable:
        return out
    found: dict[str, float] = dict(timings.metrics()) if timings is not None else {}
    if prof.profile_context_condensation and getattr(ctx_manager, "condenser", None) is not None:
        found.update(condensation_metrics(episodes))  # ctx_manager.mode=condensed: full mode condenses nothing
    if prof.profile_reward_computation and rewards is not None:
        found.update(reward_timing(rewards))
    split = "" if prefix == "rollout" else f"{prefix}/"
    out.update({f"{split}{key}": value for key, value in found.items()})
    return out
