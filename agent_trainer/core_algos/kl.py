"""KL penalties between the policy and the reference model, and KL coefficient controllers.

Two ways to use them (verl convention):
- KL loss (``actor_rollout_ref.actor.use_kl_loss``, ``kl_loss_type``): the actor adds
  ``kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), mask)``.
- KL in reward (``algorithm.use_kl_in_reward``, ``algorithm.kl_ctrl``):
  :func:`apply_kl_penalty` subtracts ``beta * KL`` from the token rewards before the
  advantage estimator runs.
"""

from __future__ import annotations

import torch

from ._masked import check_same_shape, masked_mean

KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_CTRL_TYPES = ("fixed", "adaptive")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs (Schulman 2020,
    "Approximating KL divergence", http://joschu.net/blog/kl-approx.html).

    With d = logprob - ref_logprob:
        "kl" / "k1":          d                     (unbiased, high variance, can be < 0)
        "abs":                |d|
        "mse" / "k2":         0.5 * d^2
        "low_var_kl" / "k3":  exp(-d) - 1 + d  with -d clamped to [-20, 20],
                              result clamped to [-10, 10]  (unbiased, >= 0, low variance)
    Shapes: any matching shapes (usually [B, T]); output has the same shape.
    """
    if kl_penalty not in KL_PENALTY_TYPES:
        raise ValueError(f"kl_penalty = {kl_penalty!r} is not one of {list(KL_PENALTY_TYPES)}")
    diff = logprob - ref_logprob
    if kl_penalty in ("kl", "k1"):
        return diff
    if kl_penalty == "abs":
        return diff.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * diff.square()
    log_ratio = torch.clamp(-diff, -20.0, 20.0)  # log(pi_ref / pi)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


class FixedKLController:
    """Constant KL coefficient: ``value`` never changes."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, section 2.2).

        e      = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + e * n_steps / horizon
    The coefficient grows when the measured KL is above target and shrinks below it.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0, "
                             f"got target_kl={target_kl}, horizon={horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """Build the controller for ``algorithm.kl_ctrl.type`` ("fixed" or "adaptive")."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"algorithm.kl_ctrl.type = {kl_ctrl_type!r} is not one of {list(KL_CTRL_TYPES)}")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl,
    kl_penalty_type: str = "kl",
):
    """KL-in-reward: r_t = score_t - beta * KL_t on generated tokens (beta = kl_ctrl.value).

        KL_t       = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * mask_t
        current_kl = mean over rows with tokens of (masked mean of KL over the row)
    then ``kl_ctrl.update(current_kl, n_steps=B)`` (as verl does). Padding rows do
    not count in current_kl.
    Args: [B, T] tensors; kl_ctrl: a Fixed/AdaptiveKLController.
    Returns (token_level_rewards [B, T], metrics) with metrics
    {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}.
    """
    check_same_shape(token_level_scores=token_level_scores, old_log_prob=old_log_prob,
                     ref_log_prob=ref_log_prob, response_mask=response_mask)
    beta = kl_ctrl.value
    kld = torch.where(response_mask.bool(), kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type), 0.0)
    token_level_rewards = token_level_scores - beta * kld
    per_row = masked_mean(kld, response_mask, dim=-1)
    current_kl = float(masked_mean(per_row, response_mask.sum(-1) > 0))
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
