"""PPO / GSPO policy losses, the clipped value loss, entropy, and loss aggregation.

Shapes: [B, T] per-token tensors over the whole sequence; ``response_mask``
marks generated tokens (the loss mask). All outputs are 0-d tensors.
"""

from __future__ import annotations

from typing import Callable

import torch

from ._masked import check_same_shape, masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss into a scalar.

    With m the mask, n_i = sum_t m_it, and S the rows with n_i > 0:
        "token-mean":              sum_it m l / sum_it m          (DAPO, arXiv:2503.14476)
        "seq-mean-token-sum":      mean_{i in S} sum_t m l
        "seq-mean-token-mean":     mean_{i in S} (sum_t m l / n_i)   (original GRPO)
        "seq-mean-token-sum-norm": mean_{i in S} (sum_t m l) / C     (Dr.GRPO, arXiv:2503.20783)
    C = ``loss_scale_factor`` (default T = loss_mask.shape[-1]; keep it constant
    across training). Rows with an all-zero mask (padding rows) are left out of
    every sequence mean; an all-empty batch gives 0, never NaN.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode = {loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    n_tokens = loss_mask.to(loss_mat.dtype).sum(-1)
    seq_sum = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_loss = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_sum / n_tokens.clamp_min(1e-8)
    else:
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        seq_loss = seq_sum / scale
    return masked_mean(seq_loss, n_tokens > 0)


def _clip_range(cliprange, cliprange_low, cliprange_high):
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("set cliprange, or both cliprange_low and cliprange_high "
                         f"(got cliprange={cliprange}, cliprange_low={cliprange_low}, cliprange_high={cliprange_high})")
    return low, high


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
):
    """PPO clipped surrogate with decoupled ranges and dual-clip ("vanilla" mode).

    PPO: Schulman et al. 2017 (arXiv:1707.06347); decoupled clip ("clip-higher"):
    DAPO (arXiv:2503.14476), used by StarPO-S with 0.2 / 0.28 (RAGEN, arXiv:2504.20073);
    dual-clip: Ye et al. 2020 (arXiv:1912.09729).
        ratio_t = exp(clamp(log_prob - old_log_prob, -20, 20))
        L1 = -A ratio,  L2 = -A clamp(ratio, 1 - eps_low, 1 + eps_high)
        L  = max(L1, L2)                         if A >= 0
        L  = min(max(L1, L2), -A * clip_ratio_c) if A < 0   (dual-clip bounds the loss)
        pg_loss = agg_loss(L, mask, loss_agg_mode)
    eps_low / eps_high default to ``cliprange``.
    With ``rollout_is_weights`` (truncated IS between the rollout engine and the trainer,
    ``core_algos.rollout_correction``) each token's L is multiplied by its constant weight
    before aggregation, as in verl and TRL. ``loss_scale_factor``: see :func:`agg_loss`
    (the full sequence length when a micro-batch's padding columns were trimmed).

    Args: [B, T] tensors; clip_ratio_c > 1.
    Returns:
        pg_loss: scalar loss.
        pg_clipfrac: fraction of masked tokens where the clip is active (L2 > L1).
        ppo_kl: masked mean of old_log_prob - log_prob (k1 estimate of KL(old || new)).
        pg_clipfrac_lower: fraction of masked tokens where the dual clip is active.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c = {clip_ratio_c} must be > 1.0 (dual-clip lower bound)")
    low, high = _clip_range(cliprange, cliprange_low, cliprange_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    dual_clipped = torch.minimum(clipped, pg_losses3)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(clipped, pg_losses3) & negative).float(), response_mask)

    pg_losses = torch.where(negative, dual_clipped, clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
):
    """GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    One importance ratio per sequence, the geometric mean of token ratios:
        log s_i   = (1 / n_i) sum_t m_it (log_prob - old_log_prob)_it
        s_it      = sg[s_i] * pi(y_it) / sg[pi(y_it)]   (value s_i, per-token gradient)
        L_it      = max(-A_it s_it, -A_it clamp(s_it, 1 - eps_low, 1 + eps_high))
    log s_it is clamped to <= 10. The paper's clip ranges are tiny (3e-4 / 4e-4)
    and its aggregation is "seq-mean-token-mean" (the default here); a different
    ``loss_agg_mode`` passed in is honoured. ``clip_ratio_c`` is unused (no
    dual-clip); it is accepted so both modes share one signature, as are
    ``rollout_is_weights`` and ``loss_scale_factor`` (same meaning as in :func:`compute_policy_loss`).
    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower=0).
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    low, high = _clip_range(cliprange, cliprange_low, cliprange_high)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(pg_loss)


POLICY_LOSS_FNS: dict[str, Callable] = {"vanilla": compute_policy_loss, "gspo": compute_policy_loss_gspo}


def get_policy_loss_fn(mode: str) -> Callable:
    """The policy loss for ``actor_rollout_ref.actor.policy_loss_mode``; all share
    compute_policy_loss's signature and output tuple. Unknown mode -> ValueError."""
    if mode not in POLICY_LOSS_FNS:
        raise ValueError(f"unknown policy loss mode {mode!r}; known modes: {list(POLICY_LOSS_MODES)}")
    return POLICY_LOSS_FNS[mode]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
):
    """Clipped value loss (PPO2 style, as in verl / OpenAI baselines).

        v_clip = values + clamp(vpreds - values, -c, c)
        L_t    = max((vpreds - R)^2, (v_clip - R)^2)
        vf_loss = 0.5 * agg_loss(L, mask, loss_agg_mode)
    values: the old (rollout-time) critic values; returns R from the estimator.
    ``loss_scale_factor``: see :func:`agg_loss`.
    Returns (vf_loss, vf_clipfrac): clipfrac = fraction of masked tokens where the
    clipped term is the larger one.
    """
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    vpred_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, loss_scale_factor)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy per position: H = logsumexp(z) - sum softmax(z) * z.  [..., V] -> [...]"""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"):
    """Mean policy entropy over generated tokens: agg_loss(H(logits), mask, loss_agg_mode).

    logits: [B, T, V]; response_mask: [B, T]. Returns a scalar; the trainer
    subtracts entropy_coeff * this from the policy loss to encourage exploration.
    """
    if logits.dim() != 3 or logits.shape[:2] != response_mask.shape:
        raise ValueError(f"logits must be [B, T, V] matching response_mask {tuple(response_mask.shape)}, "
                         f"got {tuple(logits.shape)}")
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
