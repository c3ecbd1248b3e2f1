"""Rollout-vs-trainer importance-sampling correction (truncated IS, "TIS").

The engine that sampled a batch (vLLM) and the trainer that updates on it (FSDP) compute
slightly different probabilities for the same tokens: other kernels, other batching, and
with overlap of rollout and training, older weights. PPO's ratio only compares the trainer
with itself (``log_prob - old_log_prob``), so the mismatch between the sampler pi_rollout
and the trainer's pi_old goes unseen. Truncated importance sampling reweights each token's
policy-gradient term by how much more likely the trainer finds it than the sampler did,
capped so a rare token cannot blow the gradient up (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's ``algorithm.rollout_correction``;
TRL's ``vllm_importance_sampling_correction``):

    token level:     w_t = min(exp(old_t - rollout_t), C)
    sequence level:  w_i = min(exp(sum_t m_it (old_it - rollout_it)), C)   (the same w for every token of row i)

``old`` are the trainer's log-probs of the sampled tokens before the update (``old_log_probs``,
or the detached current ones when the update is exactly on-policy), ``rollout`` the engine's
(``rollout_log_probs``), C = ``rollout_is_threshold``. The log-ratio is clamped to [-20, 20]
before ``exp`` (verl's safety bound). Weights are constants (no gradient) that multiply the
per-token policy loss before aggregation. Outside ``response_mask`` they are 1.

Masking (IcePop, Ling team 2025; verl's ``rollout_rs`` "token", MIS): instead of (or on top of) reweighting, a
token whose ratio falls outside [lower, upper] contributes no gradient at all:

    m_t = 1 if lower <= exp(old_t - rollout_t) <= upper else 0        (the loss of token t is multiplied by m_t)

A token the two policies disagree on that much (a numerics outlier, or a token generated many versions ago in an
asynchronous run) is more likely noise than signal; TIS would still pass it with weight C.
"""

from __future__ import annotations

import math

import torch

from ._masked import check_same_shape, masked_mean

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token",)
"""``algorithm.rollout_correction.rollout_rs``: where tokens are masked by their ratio (null = off)."""
"""``algorithm.rollout_correction.rollout_is``: where one importance weight is computed (null = off)."""
LOG_RATIO_BOUND = 20.0
"""|old - rollout| is clamped to this before exp (as in verl), so one weight is at most e^20 before truncation."""


def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights pi_old / pi_rollout, and their statistics.

    Args:
        old_log_prob, rollout_log_prob, response_mask: [B, T] (aligned with ``input_ids``).
        rollout_is: "token" (one weight per generated token) | "sequence" (one per row, the
            product of its token ratios).
        rollout_is_threshold: C, the upper truncation (> 0).
    Returns:
        weights: [B, T], detached, 1 outside the mask.
        metrics (0-d tensors, over masked tokens for "token", over non-empty rows for "sequence"):
            ``rollout_is_mean`` (of the truncated weights), ``rollout_is_max`` (of the untruncated
            ones, the largest mismatch seen), ``rollout_is_truncated_frac`` (share of weights capped at C).
    """
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is = {rollout_is!r} is not one of {list(ROLLOUT_IS_LEVELS)}")
    if not rollout_is_threshold > 0:
        raise ValueError(f"rollout_is_threshold = {rollout_is_threshold} must be > 0")
    mask = response_mask.bool()
    with torch.no_grad():
        log_ratio = torch.where(mask, old_log_prob.detach().float() - rollout_log_prob.detach().float(), 0.0)
        if rollout_is == "sequence":
            log_ratio = log_ratio.sum(-1)
            mask = mask.any(-1)
        raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        weights = raw.clamp(max=rollout_is_threshold)
        metrics = {
            "rollout_is_mean": masked_mean(weights, mask),
            "rollout_is_max": torch.where(mask, raw, torch.zeros_like(raw)).max() if mask.any() else raw.new_zeros(()),
            "rollout_is_truncated_frac": masked_mean((raw > rollout_is_threshold).float(), mask),
        }
        weights = torch.where(mask, weights, torch.ones_like(weights))
        if rollout_is == "sequence":
            weights = weights.unsqueeze(-1).expand_as(old_log_prob)
    return weights.to(old_log_prob.dtype), metrics


def compute_rollout_rs_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    lower: float = 0.5,
    upper: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The IcePop mask: 1 on each generated token whose ratio pi_old / pi_rollout is within [lower, upper], 0 on
    the others, 1 outside ``response_mask``; and ``rollout_rs_masked_frac``, the share of generated tokens masked.

    Args: [B, T] each (aligned with ``input_ids``); 0 < lower <= 1 <= upper. Returns the mask as a detached
    tensor of ``old_log_prob``'s dtype (it multiplies the per-token loss like the IS weights)."""
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    if not 0 < lower <= 1 <= upper:
        raise ValueError(f"need 0 < lower <= 1 <= upper, got lower = {lower}, upper = {upper}")
    mask = response_mask.bool()
    with torch.no_grad():
        log_ratio = (old_log_prob.detach().float() - rollout_log_prob.detach().float()).clamp(
            -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        outside = (log_ratio < math.log(lower)) | (log_ratio > math.log(upper))
        masked = outside & mask
        keep = (~masked).to(old_log_prob.dtype)
    return keep, {"rollout_rs_masked_frac": masked_mean(masked.float(), mask)}


def mismatch_kl(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """KL(pi_rollout || pi_old) per generated token, averaged over ``response_mask``: how far the policy the
    trainer updates from has moved away from the one that sampled (engine/trainer numerics, and the staleness of
    an off-policy batch). The k3 estimator over tokens sampled from pi_rollout (Schulman's low-variance, >= 0):

        d_t = old_t - rollout_t,   kl_t = exp(d_t) - 1 - d_t       (d_t clamped to [-20, 20])

    Args: [B, T] each (aligned with ``input_ids``). Returns a 0-d tensor (0 when the mask is empty).
    """
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    with torch.no_grad():
        d = (old_log_prob.detach().float() - rollout_log_prob.detach().float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return masked_mean(torch.exp(d) - 1 - d, response_mask.float())
