"""A rollout's result: the training batch the agent builds from the played episodes, checked against the
token-in/token-out contract, with the episodes' metrics and the faults met on the way (:func:`assemble`)."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from agent_trainer.common import profiling
from agent_trainer.agents.base import Agent
from agent_trainer.agents.contract import check_batch_contract
from agent_trainer.common.batch import TensorBatch
from agent_trainer.agents.condensed_ctx import CondensedEpisode
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import Split
from agent_trainer.agents.ctx_manager import EpisodeContext
from agent_trainer.episode.es_manager import EpisodeState
from agent_trainer.config import split_config
from agent_trainer.episode.rollout_shaping import trained_rewards
from agent_trainer.trajectory_rewards.judge import JudgeVerdict

logger = logging.getLogger(__name__)


@dataclass
class RolloutResult:
    """A rollout's training batch, its metrics, and the raw per-episode states."""

    batch: TensorBatch
    metrics: dict[str, float]
    states: list[EpisodeState]
    group_seeds: list[int] = field(default_factory=list)
    """The seed each group (``uid``) was reset with; the remax_baseline split replays them."""
    judge: dict[int, JudgeVerdict] = field(default_factory=dict)
    """With ``judge.enable``: each judged episode's verdict by env id (its trajectory record shows it)."""


class EnvFailure(RuntimeError):
    """Too many of a split's episodes failed in their environment (``es_manager.max_failed_reset_fraction``,
    ``es_manager.max_env_error_fraction``): the run stops with this one line (``agent_trainer.main.train``)."""


def check_env_errors(states: list[EpisodeState], limit: float, split: Split, describe: Callable[[int], str]) -> None:
    """Stop (:class:`EnvFailure`) when more than ``limit`` of the started episodes (``states``) ended in an
    environment error (``EpisodeState.error``: step raised, or returned the wrong shape or types), naming the
    first one, its seed and its error; below it they stay in the step (``env/<tag>/error``). A service failure
    (``EpisodeState.service_failure``) is the service's fault, not the env's: it is not counted here
    (:func:`leave_out_service_failures`)."""
    errored = sorted((s for s in states if s.error is not None and not s.service_failure), key=lambda s: s.env_id)
    if errored and len(errored) > limit * len(states):
        first = errored[0]
        raise EnvFailure(
            f"{len(errored)} of {len(states)} episodes of the {split} split ended in an environment error (more "
            f"than es_manager.max_env_error_fraction = {limit:g}); the first: {describe(first.env_id)}: "
            f"{' '.join(first.error.split())[:500]}. Fix the environment's step (docs/writing_an_environment.md, "
            "\"Check it\"), or raise the fraction")


@dataclass
class RolloutFaults:
    """What went wrong in one rollout, for its metrics (docs/reliability.md)."""

    actor_failures: int = 0
    """Env actor calls that died or raised."""
    timeouts: int = 0
    """Env actor calls that missed their deadline (the actor was replaced)."""
    reset_failures: int = 0
    """Episodes dropped because their reset raised or their actor was lost."""
    tag_timeouts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per env tag: episodes ended by an env actor timeout."""
    engine_failures: int = 0
    """Engine calls that died or timed out and were generated once more."""

    def count_call(self, call) -> None:
        """Count an env actor call's failed and timed-out actors."""
        self.actor_failures += len(call.failed)
        self.timeouts += len(call.timed_out)

    def metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/env_actor_failures``, ``env_timeouts``, ``reset_failures``, ``engine_failures`` and
        ``env/<tag>/timeouts``."""
        env_prefix = "env" if prefix == "rollout" else f"{prefix}/env"
        m = {f"{prefix}/env_actor_failures": float(self.actor_failures),
             f"{prefix}/env_timeouts": float(self.timeouts),
             f"{prefix}/reset_failures": float(self.reset_failures)}
        m.update({f"{env_prefix}/{tag}/timeouts": float(n) for tag, n in self.tag_timeouts.items()})
        m[f"{prefix}/engine_failures"] = float(self.engine_failures)
        return m


def assemble(cfg: AgentTrainerConfig, agent: Agent, split: Split, ctxs: dict[int, EpisodeContext | CondensedEpisode],
             states: list[EpisodeState], *, seeds: list[int], temperature: float, faults: RolloutFaults,
             reset_prefetched: bool, generations: dict[int, list[list[int]]], timings: profiling.TurnTimings,
             describe: Callable[[int], str], num_episodes: int,
             versions: dict[int, list[int]] | None = None) -> RolloutResult:
    """The batch of the episodes that played a turn (``algorithm.nonfinite_reward`` screens them,
    :func:`screen_nonfinite`), checked against the engine's ``generations``, with the split's metrics. With
    ``versions`` (each episode's turns' policy versions) the batch gets ``token_versions`` (:func:`token_versions`)."""
    played = [ctxs[k] for k in sorted(ctxs) if ctxs[k].num_replies > 0]
    if not played:
        raise RuntimeError(f"no episode of the {split} split played a turn ({num_episodes} episodes, "
                           f"{faults.reset_failures} failed to reset, the others' first prompt exceeded "
                           "actor_rollout_ref.rollout.max_model_len minus the turn budget); see the errors above")
    played, service_failures = leave_out_service_failures(played, states, split, describe)
    played, actor_lost = leave_out_lost_actors(played, split)
    episodes, dropped = screen_nonfinite(played, cfg.algorithm.nonfinite_reward, describe)
    episodes, small_groups = drop_small_groups(episodes, split_config(cfg, split).group_size,
                                               cfg.es_manager.min_group_left, split)
    batch = agent.build_update_batch(episodes)
    check_batch_contract(batch, generations, type(agent).__qualname__, describe)
    if versions is not None:
        batch["token_versions"] = token_versions(batch, generations, versions)
    batch.meta.temperature = temperature if temperature > 0 else 1.0
    batch.meta.group_seeds = list(seeds)
    prefix = split.metric_prefix
    rewards = episode_rewards(ctxs, batch)
    for state in states:  # the reports read the episode's reward from its state (trajectories, eval report)
        state.reward = rewards.get(int(state.env_id), state.total_reward)
    metrics = rollout_metrics(list(ctxs.values()), states, prefix=prefix, rewards=rewards)
    metrics.update(faults.metrics(prefix))
    metrics[f"{prefix}/nonfinite_dropped"] = float(dropped)
    metrics[f"{prefix}/service_failures"] = float(service_failures)
    metrics[f"{prefix}/env_actor_lost"] = float(actor_lost)
    metrics[f"{prefix}/small_groups_dropped"] = float(small_groups)
    metrics[f"{prefix}/reset_prefetched"] = float(reset_prefetched)
    metrics.update(profiling.rollout_profile(cfg, agent, timings, played, prefix))
    return RolloutResult(batch=batch, metrics=metrics, states=states, group_seeds=seeds)


def token_versions(batch: TensorBatch, generations: dict[int, list[list[int]]],
                   versions: dict[int, list[int]]) -> torch.Tensor:
    """[B, T] int64: the policy version that generated each token under ``response_mask``, -1 elsewhere.

    The batch contract (:func:`~agent_trainer.agents.contract.check_batch_contract`, checked before) makes an
    episode's masked tokens, its rows in order, exactly its generated tokens, turn after turn; so turn k's
    ``len(generations[episode][k])`` tokens there carry ``versions[episode][k]``, whatever the agent's layout
    (one row per episode or per turn)."""
    out = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
    mask = batch["response_mask"]
    rows_of: dict[int, list[int]] = defaultdict(list)
    for row, uid in enumerate(batch["traj_uid"].tolist()):
        rows_of[int(uid)].append(row)
    for uid, rows in rows_of.items():
        per_token = torch.tensor([v for turn, v in zip(generations[uid], versions[uid]) for _ in turn],
                                 dtype=torch.long)
        start = 0
        for row in rows:
            cols = mask[row].nonzero().flatten()
            out[row, cols] = per_token[start:start + len(cols)]
            start += len(cols)
    return out


def leave_out_service_failures(played: list, states: list[EpisodeState], split: Split,
                               describe: Callable[[int], str]) -> tuple[list, int]:
    """The played episodes without those a service failure ended (``EpisodeState.service_failure``: the env's
    server unreachable, the connection lost, no answer in time), and how many those were.

    Such an episode stopped where the service did, not where the policy took it: its reward says nothing of the
    policy, so it is left out of the batch (all its rows) and of its group's statistics, and counted
    (``<prefix>/service_failures``); the rest of the group trains. When it leaves nothing, the rollout stops
    with :class:`EnvFailure` naming the first one."""
    failed = {int(s.env_id) for s in states if s.service_failure}
    kept = [e for e in played if int(e.env_id) not in failed]
    lost = len(played) - len(kept)
    if played and not kept:
        first = min(s.env_id for s in states if s.service_failure)
        error = next(s.error for s in states if s.env_id == first) or ""
        raise EnvFailure(f"all {len(played)} episodes of the {split} split that played a turn ended in a service "
                         f"failure; the first: {describe(first)}: {' '.join(error.split())[:500]}. Check that the "
                         "env's server is up (docs/environments.md, \"Services\")")
    if lost:
        logger.warning("left out %d episode(s) of the %s split ended by a service failure (%s/service_failures)",
                       lost, split, split.metric_prefix)
    return kept, lost


def leave_out_lost_actors(played: list, split: Split) -> tuple[list, int]:
    """The played episodes without those their env actor's loss ended (died, missed
    ``es_manager.env_step_timeout_s``: ``env_actor_lost``), and how many those were.

    Such an episode stopped where the infrastructure did: scored as it stands (often 0) it would pull its group's
    baseline down for nothing the policy did, so it is left out of the batch and of its group's statistics and
    counted (``<prefix>/env_actor_lost``). When it leaves nothing, the rollout stops with :class:`EnvFailure`."""
    kept = [e for e in played if not e.env_actor_lost]
    lost = len(played) - len(kept)
    if played and not kept:
        raise EnvFailure(f"all {len(played)} episodes of the {split} split that played a turn ended because their env "
                         "actor died or missed es_manager.env_step_timeout_s (see the errors above); nothing is left "
                         "to train on: raise the timeout or fix what kills the env actors")
    if lost:
        logger.warning("left out %d episode(s) of the %s split ended by a lost env actor (%s/env_actor_lost)", lost,
                       split, split.metric_prefix)
    return kept, lost


def drop_small_groups(episodes: list, group_size: int, min_left: int, split: Split) -> tuple[list, int]:
    """Drop each group that lost episodes (fewer than ``group_size`` left) and has fewer than ``min_left``
    (``es_manager.min_group_left``); returns the kept episodes and how many groups were dropped
    (``<prefix>/small_groups_dropped``). When none is left, the rollout stops with :class:`EnvFailure`."""
    sizes: dict[int, int] = defaultdict(int)
    for e in episodes:
        sizes[e.group_id] += 1
    small = {g for g, n in sizes.items() if n < group_size and n < min_left}
    if not small:
        return episodes, 0
    kept = [e for e in episodes if e.group_id not in small]
    if not kept:
        raise EnvFailure(f"every group of the {split} split lost episodes to faults and kept fewer than "
                         f"es_manager.min_group_left = {min_left} (see the errors above); nothing is left to train on: "
                         "fix the faults, or lower es_manager.min_group_left")
    logger.warning("dropped %d group(s) of the %s split left with fewer than es_manager.min_group_left = %d "
                   "episodes (%s/small_groups_dropped)", len(small), split, min_left, split.metric_prefix)
    return kept, len(small)


def tool_call_metrics(states: list[EpisodeState], prefix: str) -> dict[str, float]:
    """The MCP tool calls of the episodes' turns (``EnvTurn.tool_calls``; none: no metric): calls per episode, the
    share that answered with an error (the episode goes on) or failed (the server: the episode ended as a service
    failure), their mean latency, and the turns spent on tools alone."""
    calls = [c for s in states for t in s.history for c in t.tool_calls]
    if not calls:
        return {}
    tool_turns = sum(1 for s in states for t in s.history if t.tool_calls and t.info.get("tool_turn"))
    return {f"{prefix}/tool_calls_per_episode": len(calls) / max(1, len(states)),
            f"{prefix}/tool_call_error_rate": sum(bool(c.get("error")) for c in calls) / len(calls),
            f"{prefix}/tool_call_failures": float(sum(bool(c.get("service_failure")) for c in calls)),
            f"{prefix}/tool_call_latency_s_mean": float(np.mean([float(c.get("latency_s", 0.0)) for c in calls])),
            f"{prefix}/tool_turns_per_episode": tool_turns / max(1, len(states))}


def screen_nonfinite(episodes: list, policy: str, describe: Callable[[int], str]) -> tuple[list, int]:
    """Keep the episodes whose total reward is finite; returns them and how many were dropped.

    An episode's total reward is finite exactly when every turn's reward is (a NaN or inf
    anywhere makes the sum NaN or inf). ``policy`` "error" raises naming the first such
    episode (``describe(env_id)``); "drop" leaves them out (all rows of the episode).
    """
    bad = [e for e in episodes if not math.isfinite(e.total_reward)]
    if not bad:
        return episodes, 0
    if policy != "drop":
        raise RuntimeError(
            f"non-finite episode reward {bad[0].total_reward} in {describe(bad[0].env_id)} ({len(bad)} of "
            f"{len(episodes)} episodes); the environment returned it: fix the env's reward, or set "
            "algorithm.nonfinite_reward=drop to leave such episodes out of training")
    kept = [e for e in episodes if math.isfinite(e.total_reward)]
    if not kept:
        raise RuntimeError(f"all {len(episodes)} episodes of the rollout had a non-finite reward (first: "
                           f"{describe(bad[0].env_id)}); nothing is left to train on: fix the env's reward")
    logger.warning("dropped %d episode(s) with a non-finite reward, first: %s", len(bad), describe(bad[0].env_id))
    return kept, len(bad)


def episode_rewards(ctxs: dict[int, EpisodeContext | CondensedEpisode], batch: TensorBatch) -> dict[int, float]:
    """Each episode's reward, the one figure the console, the metrics, the Prometheus gauge, the eval report, the
    trajectories and the viewer show (docs/rewards.md, "One reward figure"): the sum of the token-level rewards
    on its training rows (``rollout_shaping.trained_rewards``: the turns' env rewards with each turn's format
    penalty counted once, as the agent placed them), before rollout shaping and a reward model's score. An
    episode with no row in the batch (no turn played, a non-finite reward dropped) has the agent's own total."""
    trained = trained_rewards(batch)
    return {env_id: trained.get(int(env_id), ctx.total_reward) for env_id, ctx in ctxs.items()}


def rollout_metrics(episodes: list[EpisodeContext | CondensedEpisode], states: list[EpisodeState],
                    prefix: str, rewards: dict[int, float] | None = None) -> dict[str, float]:
    """Episode-level metrics: success, valid actions, reward, turns, lengths, format errors; per-tag env metrics.

    ``num_turns_mean`` counts env steps (turns) and ``format_error_rate`` is per turn; ``response_length_mean``
    is the generated tokens per reply (``num_replies``: a gateway agent's calls).

    ``rewards`` (env_id -> the episode's reward, :func:`episode_rewards`; default each episode's
    ``total_reward``) gives ``<prefix>/episode_reward_mean|max`` and, over the same figures,
    ``env/<tag>/episode_reward_mean``. ``sequence_length_mean`` is the mean over episodes of the longest
    training row: the whole episode in full mode, one turn's prompt + reply in condensed mode.
    ``valid_action_rate`` is the mean over episodes of each one's ``action_is_valid`` share (a turn without an
    action counts as invalid): over one tag, ``env/<tag>/action_is_valid``.
    """
    m: dict[str, float] = {}
    reward_of = {e.env_id: (rewards[e.env_id] if rewards is not None and e.env_id in rewards else e.total_reward)
                 for e in episodes}
    rewards_list = [reward_of[e.env_id] for e in episodes]
    gen_lens = [e.num_generated_tokens for e in episodes]
    turns = [e.num_turns for e in episodes]
    m[f"{prefix}/episode_reward_mean"] = float(np.mean(rewards_list))
    m[f"{prefix}/episode_reward_max"] = float(np.max(rewards_list))
    m[f"{prefix}/num_turns_mean"] = float(np.mean(turns))
    replies = [e.num_replies for e in episodes]
    m[f"{prefix}/response_length_mean"] = float(np.mean(gen_lens)) / max(1.0, float(np.mean(replies)))
    m[f"{prefix}/sequence_length_mean"] = float(np.mean([e.longest_row for e in episodes]))
    m[f"{prefix}/truncated_rate"] = float(np.mean([e.truncated for e in episodes]))
    m[f"{prefix}/context_overflow_rate"] = float(np.mean([e.context_overflow for e in episodes]))
    m[f"{prefix}/format_error_rate"] = float(sum(e.format_errors for e in episodes) / max(1, sum(turns)))
    success = [bool(s.metrics.get("success", False)) for s in states]
    m[f"{prefix}/success_rate"] = float(np.mean(success)) if success else 0.0
    valid = [float(s.metrics.get("action_is_valid", 0.0)) for s in states]  # each episode's share of valid actions
    m[f"{prefix}/valid_action_rate"] = float(np.mean(valid)) if valid else 0.0
    m.update(tool_call_metrics(states, prefix))
    by_tag: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in states:
        for key, value in s.metrics.items():
            if isinstance(value, (bool, int, float)):
                by_tag[s.tag][key].append(float(value))
    env_prefix = "env" if prefix == "rollout" else f"{prefix}/env"
    for tag, values in by_tag.items():
        for key, vals in values.items():
            m[f"{env_prefix}/{tag}/{key}"] = float(np.mean(vals))
    tag_rewards: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        tag_rewards[e.tag].append(reward_of[e.env_id])
    for tag, vals in tag_rewards.items():
        m[f"{env_prefix}/{tag}/episode_reward_mean"] = float(np.mean(vals))
    return m
