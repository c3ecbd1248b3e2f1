"""Advantage estimators, policy/value losses, KL penalties and rollout shaping (pure torch).

Per-token tensors are [B, T] over the WHOLE sequence (prompt, every turn, environment
observations, padding); ``response_mask`` is 1 exactly on tokens the policy generated.
Group / trajectory ids are [B]: int64 tensors, or (as verl's ``non_tensor_batch["uid"]``)
numpy arrays / lists of hashable ids such as strings, converted in one place
(``as_group_index``). Function names and argument order follow verl's ``core_algos``
so a verl user reads them at once.

Modules: advantages (GAE, GRPO, RLOO, REINFORCE++, ReMax), multiturn (bi-level GAE,
multi-turn GRPO), gigpo, losses, rollout_correction (truncated IS between engine and
trainer), collapse (RAGEN-2's prompt-response mutual information), kl, shaping (RAGEN reward
normalisation and rollout filtering), estimators
(``@register_estimator``: each estimator's properties, recorded where it is defined), registry
(``compute_advantage``, the name tables derived from the specs, the estimator a config section selects).
A new estimator is one module of this package with a decorated function: every module here is imported with
the package (``agent_trainer.common.plugins.import_package_modules``; docs/algorithms.md).
See docs/algorithms.md for the table of estimators and losses.
"""

from ._masked import as_group_index, masked_mean, masked_sum, masked_var, masked_whiten
from .advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from .distill import DISTILL_MODES, apply_distillation, distill_signal
from .gigpo import GIGPO_MODES, compute_gigpo_outcome_advantage
from .kl import (
    KL_CTRL_TYPES,
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from .losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss_fn,
)
from .rollout_correction import (ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS, compute_rollout_is_weights,
                                 compute_rollout_rs_mask, mismatch_kl)
from .collapse import mutual_information_estimates
from .multiturn import compute_bi_level_gae_advantage_return, compute_grpo_multiturn_advantage, turn_segments
from .estimators import EstimatorSpec, estimator_names, estimator_spec, register_estimator
from . import registry
from .registry import (
    DERIVED_TABLES,
    compute_advantage,
    critic_enabled,
    estimator,
    estimator_options,
    get_adv_estimator_fn,
    resolve_adv_estimator,
    trainer_splits,
)
from .shaping import (
    NONFINITE_REWARD_POLICIES,
    REWARD_NORM_GROUPINGS,
    REWARD_NORM_METHODS,
    ROLLOUT_FILTER_STRATEGIES,
    filter_groups,
    normalize_scores,
)
from agent_trainer.common.plugins import import_package_modules

import_package_modules(__name__, __path__)  # a new estimator is one module here: its @register_estimator runs now

__all__ = [
    "ADV_ESTIMATOR_NAMES", "CRITIC_ESTIMATORS", "DISTILL_MODES", "apply_distillation", "distill_signal", "ESTIMATOR_OPTIONS", "GIGPO_MODES", "KL_CTRL_TYPES", "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES", "NONFINITE_REWARD_POLICIES", "POLICY_LOSS_MODES", "REWARD_NORM_GROUPINGS", "REWARD_NORM_METHODS",
    "ROLLOUT_FILTER_STRATEGIES", "ROLLOUT_IS_LEVELS", "ROLLOUT_RS_LEVELS", "compute_rollout_is_weights",
    "compute_rollout_rs_mask", "mismatch_kl",
    "AdaptiveKLController", "FixedKLController", "agg_loss", "as_group_index", "apply_kl_penalty",
    "compute_advantage", "compute_bi_level_gae_advantage_return", "compute_entropy_loss",
    "compute_gae_advantage_return", "compute_gigpo_outcome_advantage", "compute_grpo_multiturn_advantage",
    "compute_grpo_outcome_advantage", "compute_policy_loss", "compute_policy_loss_gspo",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage", "compute_rloo_outcome_advantage", "compute_value_loss",
    "entropy_from_logits", "filter_groups", "get_adv_estimator_fn", "get_kl_controller",
    "get_policy_loss_fn", "kl_penalty", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "critic_enabled", "trainer_splits", "estimator", "estimator_options", "EstimatorSpec", "estimator_names",
    "estimator_spec",
    "register_estimator", "mutual_information_estimates", "normalize_scores", "resolve_adv_estimator", "turn_segments",
]


def __getattr__(name: str):
    """``ADV_ESTIMATOR_NAMES``, ``CRITIC_ESTIMATORS``, ``ESTIMATOR_OPTIONS``: derived from the specs on each read."""
    if name in DERIVED_TABLES:
        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
