"""Rollout shaping from RAGEN / StarPO-S (Wang et al. 2025, arXiv:2504.20073).

Both functions work on per-episode scores (one float per episode, [N]) before the
advantage estimator runs: reward normalisation rescales them, rollout filtering
drops whole groups whose episodes all scored alike (no learning signal).
"""

from __future__ import annotations

import math

import torch

from ._masked import check_ids, group_mean_std

REWARD_NORM_GROUPINGS = ("state", "batch", "inductive")
REWARD_NORM_METHODS = ("identity", "mean", "mean_std", "asym_clip")
ROLLOUT_FILTER_STRATEGIES = ("top_k", "top_p", "min_p")
NONFINITE_REWARD_POLICIES = ("error", "drop")
"""``algorithm.nonfinite_reward``: stop at an episode with a NaN/inf reward, or drop the episode."""
STD_EPS = 1e-6
"""A group whose standard deviation is at most this counts as constant."""


def normalize_scores(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    tags: torch.Tensor,
    grouping: str,
    method: str,
) -> torch.Tensor:
    """Normalise episode scores within groups (RAGEN ``agent_proxy.reward_normalization``).

    grouping: "state" -> groups are ``group_ids`` (episodes from one initial state);
              "batch" -> one group; "inductive" -> groups are ``tags`` (env tag id).
    method, per group g with mean m_g and unbiased std s_g:
        "identity":  x
        "mean":      x - m_g
        "mean_std":  (x - m_g) / (s_g + 1e-6), and 0 when s_g <= 1e-6 (constant group or a group of one)
        "asym_clip": "mean_std" clamped to [-1, 3] (penalise less, reward more)
    Args: scores float [N]; group_ids, tags int64 [N]. Returns [N] in the dtype of scores.
    """
    if grouping not in REWARD_NORM_GROUPINGS:
        raise ValueError(f"reward normalization grouping = {grouping!r} is not one of {list(REWARD_NORM_GROUPINGS)}")
    if method not in REWARD_NORM_METHODS:
        raise ValueError(f"reward normalization method = {method!r} is not one of {list(REWARD_NORM_METHODS)}")
    n = scores.shape[0]
    check_ids("group_ids", group_ids, n)
    check_ids("tags", tags, n)
    if method == "identity" or n == 0:
        return scores.clone()
    groups = {"state": group_ids, "inductive": tags, "batch": torch.zeros_like(group_ids)}[grouping]
    mean, std, _ = group_mean_std(scores, groups)
    centred = scores.double() - mean
    if method == "mean":
        return centred.to(scores.dtype)
    z = torch.where(std > STD_EPS, centred / (std + STD_EPS), torch.zeros_like(centred))
    if method == "asym_clip":
        z = z.clamp(-1.0, 3.0)
    return z.to(scores.dtype)


def filter_groups(scores: torch.Tensor, group_ids: torch.Tensor, strategy: str, value: float):
    """Keep the groups with the most in-group reward spread (StarPO-S variance filtering).

    s_g = unbiased std of the scores of group g (0 for a group of one). Groups are
    ranked by s_g, largest first (ties: the group with the smaller id first).
        "top_k": keep the first max(1, floor(value * G)) groups; value in (0, 1] is a ratio.
        "top_p": keep the shortest prefix whose cumulative sum of s_g reaches
                 value * sum_g s_g; value in (0, 1]. If every s_g is 0, keep all.
        "min_p": keep groups with s_g >= value * max_g s_g; value in [0, 1].
    Args: scores float [N], group_ids int64 [N].
    Returns (keep_mask bool [N], kept_ratio = kept groups / groups, a float; 1.0 for N = 0).
    """
    if strategy not in ROLLOUT_FILTER_STRATEGIES:
        raise ValueError(f"rollout filter strategy = {strategy!r} is not one of {list(ROLLOUT_FILTER_STRATEGIES)}")
    low_ok = 0.0 <= value if strategy == "min_p" else 0.0 < value
    if not (low_ok and value <= 1.0):
        interval = "[0, 1]" if strategy == "min_p" else "(0, 1]"
        raise ValueError(f"rollout filter value = {value} must lie in {interval} for strategy {strategy!r}")
    n = scores.shape[0]
    check_ids("group_ids", group_ids, n)
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=scores.device), 1.0

    unique_ids, row_group = torch.unique(group_ids, return_inverse=True)
    _, std, _ = group_mean_std(scores, row_group)
    group_std = torch.zeros(len(unique_ids), dtype=torch.float64, device=scores.device).scatter(0, row_group, std)
    order = torch.argsort(-group_std, stable=True)
    ranked = group_std[order]
    n_groups = len(unique_ids)

    if strategy == "top_k":
        n_keep = max(1, math.floor(value * n_groups + 1e-9))
    elif strategy == "top_p":
        total = float(ranked.sum())
        if total <= 0.0:
            n_keep = n_groups
        else:
            reached = torch.cumsum(ranked, 0) >= value * total * (1 - 1e-12)
            n_keep = int(reached.nonzero()[0]) + 1
    else:
        n_keep = int((ranked >= value * ranked[0]).sum())
    keep_group = torch.zeros(n_groups, dtype=torch.bool, device=scores.device)
    keep_group[order[:n_keep]] = True
    return keep_group[row_group], n_keep / n_groups
