"""Rollout shaping on the driver (RAGEN / StarPO-S, arXiv:2504.20073): filter groups, normalise episode rewards.

Runs on the training rollout's batch right after the rollout, before any log
prob is computed, in this order:

1. **Filter** (``actor_rollout_ref.rollout.rollout_filter_strategy`` / ``rollout_filter_value``):
   ``core_algos.filter_groups`` ranks the groups (``uid``) by the std of their
   episodes' *raw* scores and keeps whole groups; every row of a dropped episode
   goes. Raw scores, because the in-group spread of the real returns is the
   signal StarPO-S filters on (after ``state`` normalisation every group's std is
   1 or 0). The kept batch may no longer fill whole mini-batches; the trainer pads
   each update with zero-mask rows (``agent_trainer.training.trainer.pad_for_update``).
2. **Normalise** (``agent_proxy.reward_normalization``): ``core_algos.normalize_scores``
   over the kept episodes (so ``batch`` / ``inductive`` statistics describe the
   data that is trained on). The difference between an episode's normalised and
   raw score is added to its last generated token, so the episode's token rewards
   sum to the normalised score while earlier per-turn rewards keep their place.

With ``algorithm.adv_estimator=remax`` the trainer first attaches ``reward_baselines``
(:func:`attach_reward_baselines`: the reward of each group's greedy episode); filtering
keeps it row-aligned.

An episode is a trajectory (``traj_uid``): one row in full mode (a gateway
agent's step-wise episode: one row per call), one row per turn in condensed
mode (rows of an episode in turn order, as the context managers build them). Its score is the sum of its token rewards on generated
tokens, the quantity every outcome estimator sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_trainer import core_algos
from agent_trainer.common.batch import TensorBatch


@dataclass
class EpisodeScores:
    """Per-episode view of a batch: N episodes, B rows."""

    scores: torch.Tensor
    """float64 [N]: sum of the episode's token rewards on generated tokens."""
    group_ids: torch.Tensor
    """int64 [N]: the episode's ``uid``."""
    tag_ids: torch.Tensor | None
    """int64 [N]: the episode's ``tag_ids`` (None when the batch has none)."""
    row_to_episode: torch.Tensor
    """int64 [B]: which episode each row belongs to."""


def episode_scores(batch: TensorBatch) -> EpisodeScores:
    """Sum each episode's token rewards over its rows (generated tokens only)."""
    mask = batch["response_mask"].bool()
    row_scores = torch.where(mask, batch["token_level_rewards"], 0.0).double().sum(-1)
    _, row_to_episode = torch.unique(batch["traj_uid"], return_inverse=True)
    n = int(row_to_episode.max()) + 1 if len(batch) else 0
    scores = torch.zeros(n, dtype=torch.float64).index_add(0, row_to_episode, row_scores)
    group_ids = torch.zeros(n, dtype=torch.long).scatter(0, row_to_episode, batch["uid"])
    tag_ids = None
    if "tag_ids" in batch:
        tag_ids = torch.zeros(n, dtype=torch.long).scatter(0, row_to_episode, batch["tag_ids"])
    return EpisodeScores(scores=scores, group_ids=group_ids, tag_ids=tag_ids, row_to_episode=row_to_episode)


def trained_rewards(batch: TensorBatch) -> dict[int, float]:
    """Per episode (``traj_uid``): the sum of the token-level rewards over its training rows, generated tokens
    only (:func:`episode_scores`): the episode's reward as the policy is trained on it, before any shaping."""
    if not len(batch):
        return {}
    uids = torch.unique(batch["traj_uid"])
    return dict(zip(uids.tolist(), episode_scores(batch).scores.tolist()))


def filter_rollout(batch: TensorBatch, strategy: str, value: float) -> tuple[TensorBatch, dict[str, float]]:
    """Keep the rows of whole groups chosen by ``core_algos.filter_groups`` (row order kept).

    Metrics: ``rollout/filter_kept_ratio`` (kept groups / groups) and
    ``rollout/filter_kept_episodes``.
    """
    ep = episode_scores(batch)
    keep, kept_ratio = core_algos.filter_groups(ep.scores, ep.group_ids, strategy, value)
    metrics = {"rollout/filter_kept_ratio": float(kept_ratio), "rollout/filter_kept_episodes": float(keep.sum())}
    if bool(keep.all()):
        return batch, metrics
    rows = keep[ep.row_to_episode].nonzero().flatten()
    return batch.index(rows), metrics


def normalize_episode_rewards(batch: TensorBatch, grouping: str, method: str) -> dict[str, float]:
    """Replace each episode's total reward by its normalised score, in ``batch["token_level_rewards"]``.

    The difference (normalised - raw) goes on the episode's last generated
    token: the last generated token of its last row that has one. An episode
    without any generated token has nowhere to carry a reward and is left as is.
    Metrics: ``rollout/score_raw_mean`` and ``rollout/score_normalized_mean``
    (means over episodes).
    """
    ep = episode_scores(batch)
    if grouping == "inductive" and ep.tag_ids is None:
        raise ValueError("reward_normalization.grouping = 'inductive' needs batch['tag_ids'] (the env tag of each "
                         "row, set by the context manager); build the batch with collate_rows")
    tags = ep.tag_ids if ep.tag_ids is not None else torch.zeros_like(ep.group_ids)
    normalized = core_algos.normalize_scores(ep.scores, ep.group_ids, tags, grouping, method)
    metrics = {"rollout/score_raw_mean": float(ep.scores.mean()),
               "rollout/score_normalized_mean": float(normalized.mean())}
    if method == "identity":  # keep the rewards bit-for-bit
        return metrics
    row, col = _last_generated_token(batch, ep.row_to_episode, len(ep.scores))
    has_token = row >= 0
    delta = (normalized - ep.scores)[has_token].to(batch["token_level_rewards"].dtype)
    rewards = batch["token_level_rewards"].clone()
    rewards[row[has_token], col[has_token]] += delta
    batch["token_level_rewards"] = rewards
    return metrics


def _last_generated_token(batch: TensorBatch, row_to_episode: torch.Tensor, n_episodes: int):
    """Per episode: (row, column) of its last generated token, row -1 if it has none."""
    mask = batch["response_mask"].bool()
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last_col = torch.where(mask, positions, -1).max(-1).values
    row_index = torch.where(last_col >= 0, torch.arange(len(batch)), -1)
    row = torch.full((n_episodes,), -1, dtype=torch.long).scatter_reduce(0, row_to_episode, row_index, "amax")
    return row, last_col[row.clamp_min(0)]


def attach_reward_baselines(batch: TensorBatch, baseline: TensorBatch) -> tuple[TensorBatch, int]:
    """ReMax: ``batch["reward_baselines"]`` [B] = the total reward of the greedy episode of each row's group.

    ``baseline`` is the remax_baseline rollout's batch: one greedy episode per training group,
    reset with that group's seed and numbered with the same ``uid``. Its episode score (the sum
    of its token rewards, as :func:`episode_scores` sums every episode) is the baseline of every
    row of the group. A group whose baseline episode was dropped (a non-finite reward under
    ``algorithm.nonfinite_reward=drop``) has no baseline: its rows are dropped too.
    Returns the batch and the number of training episodes dropped that way.
    """
    base = episode_scores(baseline)
    groups = base.group_ids.tolist()
    if len(set(groups)) != len(groups):
        raise ValueError(f"the ReMax baseline batch must hold one episode per group, got groups {groups}")
    by_group = dict(zip(groups, base.scores.tolist()))
    has_baseline = torch.tensor([g in by_group for g in batch["uid"].tolist()], dtype=torch.bool)
    dropped = int(torch.unique(batch["traj_uid"][~has_baseline]).numel())
    if dropped:
        batch = batch.index(has_baseline.nonzero().flatten())
    batch["reward_baselines"] = torch.tensor([by_group[g] for g in batch["uid"].tolist()],
                                             dtype=batch["token_level_rewards"].dtype)
    return batch, dropped


def shape_rollout(batch: TensorBatch, *, filter_strategy: str, filter_value: float, norm_grouping: str,
                  norm_method: str) -> tuple[TensorBatch, dict[str, float]]:
    """Filter groups on raw scores, then normalise the kept episodes' rewards; returns the batch and metrics."""
    batch, metrics = filter_rollout(batch, filter_strategy, filter_value)
    metrics.update(normalize_episode_rewards(batch, norm_grouping, norm_method))
    return batch, metrics
