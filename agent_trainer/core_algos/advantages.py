"""Single-sequence advantage estimators: GAE, GRPO, RLOO, REINFORCE++, ReMax.

Shapes: B = batch rows, T = tokens of the WHOLE sequence (prompt, every turn,
observations, padding). ``response_mask`` [B, T] is 1 exactly on tokens the
policy generated. ``token_level_rewards`` [B, T] holds each turn's reward on
the last generated token of that turn; rewards on mask-0 tokens are ignored.
Group ids (``index``) are [B]: an int64 tensor, or verl-style numpy / list ids
(``_masked.as_group_index``). Every estimator returns
``(advantages, returns)``, both [B, T], zero outside the mask.
"""

from __future__ import annotations

import torch

from ._masked import as_group_index, check_same_shape, group_mean_std, masked_whiten
from .estimators import register_estimator


def gae_scan(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    segment_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked GAE recursion, right to left; mask-0 tokens are skipped entirely.

    For masked tokens t with next masked token t' (same row):
        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
    with V_{t'} = A_{t'} = 0 when t has no next masked token, or when
    ``segment_end[b, t]`` is True (bool [B, T]; cuts the sequence into
    independent segments, used by bi-level GAE for turns).
    Returns unwhitened advantages [B, T], zeros outside the mask.
    Loops over T (vectorised over B), like verl's GAE.
    """
    mask = response_mask.bool()
    rewards = token_level_rewards.to(values.dtype)
    zero = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    next_value, next_adv = zero, zero
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        if segment_end is not None:
            next_value = torch.where(segment_end[:, t], zero, next_value)
            next_adv = torch.where(segment_end[:, t], zero, next_adv)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        advantages[:, t] = torch.where(m, adv_t, zero)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    return advantages


@register_estimator("gae", needs_critic=True, batch_keys=("values",), hyperparameters=("gamma", "lam"))
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
):
    """Generalized Advantage Estimation over generated tokens only (Schulman et al. 2016,
    arXiv:1506.02438).

    Mask-0 tokens inside a sequence (environment observations between turns)
    are treated as absent: the value bootstrap and the lambda trace jump from
    a turn's last token straight to the next turn's first token.
    With t' the next generated token after t (V_{t'} = A_{t'} = 0 past the last):
        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        returns_t    = A_t + V_t                       (unwhitened)
        advantages_t = (A_t - mean(A)) / sqrt(var(A) + 1e-8)   over all masked tokens of the batch

    Args:
        token_level_rewards: [B, T] float.
        values: [B, T] critic values (entries outside the mask are ignored).
        response_mask: [B, T] 0/1.
        gamma, lam: discount and GAE lambda.
    Returns:
        (advantages, returns), each [B, T], zeros outside the mask.
    """
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    with torch.no_grad():
        values = values.float()
        raw = gae_scan(token_level_rewards, values, response_mask, gamma, lam)
        mask = response_mask.bool()
        returns = torch.where(mask, raw + values, torch.zeros_like(raw))
        advantages = masked_whiten(raw, response_mask)
    return advantages, returns


@register_estimator("grpo", batch_keys=("uid",), options={"epsilon": "algorithm.advantage_epsilon"},
                    hyperparameters=("norm_adv_by_std_in_grpo",))
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
):
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    Score s_i = sum_t r_{i,t} (masked tokens). For rows sharing ``index`` g:
        A_i = (s_i - mean_g) / (std_g + epsilon)     norm_adv_by_std_in_grpo=True
        A_i =  s_i - mean_g                          False: Dr.GRPO (Liu et al. 2025, arXiv:2503.20783)
    std_g is the unbiased (n - 1) standard deviation. A group of one row uses
    mean 0 and std 1 (its advantage is its score, verl's convention). A group
    whose scores are all equal gets advantage 0.
    A_i is broadcast to every generated token of row i. Rows without any
    generated token (padding rows) get 0 and do not count in their group.

    Args:
        token_level_rewards, response_mask: [B, T]. index: [B] group ids (int64, or hashable ids).
    Returns:
        (advantages, returns), both equal, [B, T], zeros outside the mask.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    index = as_group_index("index", index, token_level_rewards.shape[0], token_level_rewards.device)
    with torch.no_grad():
        scores = torch.where(response_mask.bool(), token_level_rewards, 0.0).sum(-1)
        valid = response_mask.bool().any(-1)
        adv = normalize_by_group(scores, index, epsilon, norm_adv_by_std_in_grpo, valid)
        advantages = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


def normalize_by_group(scores: torch.Tensor, group_ids: torch.Tensor, epsilon: float, divide_by_std: bool,
                       valid: torch.Tensor | None = None):
    """GRPO group normalisation of [N] scores (float64 result).

    (s - mean_g) / (std_g + epsilon), or s - mean_g; singleton groups use mean 0, std 1.
    Entries with ``valid`` False (bool [N]) are left out of the statistics and get 0.
    """
    if valid is not None:
        out = torch.zeros(scores.shape, dtype=torch.float64, device=scores.device)
        out[valid] = normalize_by_group(scores[valid], group_ids[valid], epsilon, divide_by_std)
        return out
    mean, std, count = group_mean_std(scores, group_ids)
    single = count < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    centred = scores.double() - mean
    return centred / (std + epsilon) if divide_by_std else centred


def _group_centred(scores: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor, leave_one_out: bool):
    """s - mean_g over valid rows (mean 0 for a group of one); leave_one_out scales by n / (n - 1)."""
    out = torch.zeros(scores.shape, dtype=torch.float64, device=scores.device)
    x = scores[valid].double()
    mean, _, count = group_mean_std(x, group_ids[valid])
    centred = torch.where(count > 1, x - mean, x)
    if leave_one_out:
        centred = torch.where(count > 1, centred * count / (count - 1).clamp_min(1), centred)
    out[valid] = centred
    return out


@register_estimator("rloo", batch_keys=("uid",), options={"epsilon": "algorithm.advantage_epsilon"})
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

    Score s_i = sum_t r_{i,t}. In a group g of n > 1 rows:
        A_i = s_i - (1 / (n - 1)) * sum_{j != i} s_j  =  n / (n - 1) * (s_i - mean_g)
    A group of one has no baseline: A_i = s_i. Broadcast to the generated tokens.
    Padding rows (no generated token) get 0 and do not count in their group.
    ``epsilon`` is accepted for verl signature compatibility and unused.
    Returns (advantages, returns), both equal, [B, T].
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    index = as_group_index("index", index, token_level_rewards.shape[0], token_level_rewards.device)
    with torch.no_grad():
        scores = torch.where(response_mask.bool(), token_level_rewards, 0.0).sum(-1)
        adv = _group_centred(scores, index, response_mask.bool().any(-1), leave_one_out=True)
        advantages = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_estimator("reinforce_plus_plus", hyperparameters=("gamma",))
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return, whitened over the batch.

    G_t = r_t + gamma * G_{t'} over generated tokens (t' = next generated token;
    observation tokens between turns are skipped, not a reset).
        advantages = (G - mean(G)) / sqrt(var(G) + 1e-8)   over masked tokens of the batch
        returns    = G
    Returns (advantages, returns), [B, T], zeros outside the mask.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    with torch.no_grad():
        zeros = torch.zeros_like(token_level_rewards, dtype=torch.float32)
        returns = gae_scan(token_level_rewards, zeros, response_mask, gamma, 1.0)
        advantages = masked_whiten(returns, response_mask)
    return advantages, returns


@register_estimator("reinforce_plus_plus_baseline", batch_keys=("uid",),
                    options={"epsilon": "algorithm.advantage_epsilon"})
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
):
    """REINFORCE++ with group baseline (Hu 2025, arXiv:2501.03262).

    Score s_i = sum_t r_{i,t}; subtract the group mean (a group of one uses mean 0),
    broadcast to generated tokens, then whiten over all masked tokens of the batch
    (padding rows do not count in their group):
        A = whiten((s_i - mean_g) on every generated token of row i)
    ``epsilon`` is accepted for verl signature compatibility (whitening uses 1e-8).
    Returns (advantages, returns), both equal, [B, T].
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    index = as_group_index("index", index, token_level_rewards.shape[0], token_level_rewards.device)
    with torch.no_grad():
        scores = torch.where(response_mask.bool(), token_level_rewards, 0.0).sum(-1)
        centred = _group_centred(scores, index, response_mask.bool().any(-1), leave_one_out=False)
        per_token = centred.to(torch.float32).unsqueeze(-1).expand_as(response_mask)
        advantages = masked_whiten(per_token.contiguous(), response_mask)
    return advantages, advantages


@register_estimator("remax", batch_keys=("reward_baselines",))
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
):
    """ReMax (Li et al. 2023, arXiv:2310.10505): greedy-rollout reward as baseline.

    G_t = sum_{t' >= t, generated} r_{t'}  (undiscounted return-to-go)
        advantages_t = G_t - b_i,   returns_t = G_t
    reward_baselines: [B], the reward of the greedy response for the same prompt.
    Returns (advantages, returns), [B, T], zeros outside the mask.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if reward_baselines.shape != (token_level_rewards.shape[0],):
        raise ValueError(f"reward_baselines must have shape [{token_level_rewards.shape[0]}], "
                         f"got {tuple(reward_baselines.shape)}")
    with torch.no_grad():
        zeros = torch.zeros_like(token_level_rewards, dtype=torch.float32)
        returns = gae_scan(token_level_rewards, zeros, response_mask, 1.0, 1.0)
        advantages = (returns - reward_baselines.to(returns.dtype).unsqueeze(-1)) * response_mask
    return advantages, returns
