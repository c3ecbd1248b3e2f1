"""Single-key rules of the typed config: numeric ranges and closed choices, each refused in one line.

``validate_config`` (``agent_trainer.checks.rl``) and ``validate_sft_config`` (``agent_trainer.checks.sft``)
read these tables; rules that relate several keys live with them.
"""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass
from functools import reduce
from typing import Any, Callable

from agent_trainer import core_algos
from agent_trainer.config.choices import (
    ASYNC_MODES,
    REFILL_UNITS,
    CTX_MODES,
    DTYPES,
    FILTER_GROUPS_METRICS,
    LR_SCHEDULERS,
    MIXED_PRECISIONS,
    RECOMPUTE_OLD_LOG_PROB,
    RESUME_MODES,
    ROLLOUT_MODES,
    STALE_GROUP_POLICIES,
    WEIGHT_SYNC_TRANSPORTS,
)
from agent_trainer.config.errors import check_choice
from agent_trainer.config.rewards import RM_INPUTS
from agent_trainer.config.schema import AgentTrainerConfig


@dataclass(frozen=True)
class Rule:
    """A range rule for one numeric key: the test and how it reads in an error."""

    test: Callable[[float], bool]
    text: str
    allow_none: bool = False


def at_least(n: float, note: str = "") -> Rule:
    """value >= n."""
    return Rule(lambda v: v >= n, f"must be >= {n}{note}")


def above(n: float, note: str = "") -> Rule:
    """value > n."""
    return Rule(lambda v: v > n, f"must be > {n}{note}")


def at_most(n: float, note: str = "") -> Rule:
    """value <= n."""
    return Rule(lambda v: v <= n, f"must be <= {n}{note}")


def between(low: float, high: float, low_open: bool, high_open: bool) -> Rule:
    """value in the interval, each end open or closed."""
    text = f"must lie in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return Rule(lambda v: (v > low if low_open else v >= low) and (v < high if high_open else v <= high), text)


def optional(rule: Rule) -> Rule:
    """The rule, or null."""
    return Rule(rule.test, f"{rule.text} (or null)", allow_none=True)


def sections(template: list[tuple[str, Rule, str]], *prefixes: str) -> list[tuple[str, Rule, str]]:
    """The same rules for a sub-section (optim, fsdp) of several sections."""
    return [(f"{p}.{key}", rule, example) for p in prefixes for key, rule, example in template]


_OPTIM = [("optim.lr", above(0), "1e-5"), ("optim.weight_decay", at_least(0), "0.0"),
          ("optim.warmup_steps", at_least(0), "0"), ("optim.min_lr_ratio", between(0, 1, False, False), "0.1")]
_FSDP = [("fsdp.world_size", at_least(1), "1"), ("fsdp.num_cpus_per_rank", at_least(0), "0.25"),
         ("fsdp.num_threads", at_least(1), "1")]
_ROLLOUT = "actor_rollout_ref.rollout"

RANGES: list[tuple[str, Rule, str]] = [
    # key, rule, an example of a value that works
    ("micro_batch_size_per_gpu", at_least(1), "4"),
    ("ppo_mini_batch_size", at_least(1), "8"),
    ("actor_rollout_ref.actor.ppo_epochs", at_least(1), "1"),
    ("actor_rollout_ref.actor.clip_ratio", optional(between(0, 1, True, True)), "0.2"),
    ("actor_rollout_ref.actor.clip_ratio_low", optional(between(0, 1, True, True)), "0.2"),
    ("actor_rollout_ref.actor.clip_ratio_high", optional(above(0)), "0.28"),
    ("actor_rollout_ref.actor.clip_ratio_c", above(1, " (dual-clip bound)"), "3.0"),
    ("actor_rollout_ref.actor.entropy_coeff", at_least(0), "0.0"),
    ("actor_rollout_ref.actor.kl_loss_coef", at_least(0), "0.001"),
    ("actor_rollout_ref.actor.grad_clip", above(0), "1.0"),
    ("actor_rollout_ref.actor.target_kl", optional(above(0, " (a mini-batch's approx_kl that stops the step)")),
     "0.02"),
    ("actor_rollout_ref.model.lora_rank", at_least(0, " (0 = no LoRA, the full model trains)"), "8"),
    ("actor_rollout_ref.model.lora_alpha", above(0), "16"),
    ("actor_rollout_ref.model.lora_dropout", between(0, 1, False, True), "0.0"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", at_least(1), "4"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", at_least(1), "16384"),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", at_least(1), "16384"),
    ("critic.ppo_max_token_len_per_gpu", at_least(1), "16384"),
    ("critic.forward_max_token_len_per_gpu", optional(at_least(1)), "null"),
    ("algorithm.rollout_correction.rollout_is_threshold", above(0, " (the upper truncation of each IS weight)"),
     "2.0"),
    ("algorithm.rollout_correction.rollout_rs_threshold", at_least(1, " (the largest ratio kept)"), "5.0"),
    ("algorithm.rollout_correction.rollout_rs_threshold_lower", between(0, 1, True, False), "0.5"),
    (f"{_ROLLOUT}.temperature", at_least(0, " (0 = greedy)"), "1.0"),
    (f"{_ROLLOUT}.top_p", between(0, 1, True, False), "1.0"),
    (f"{_ROLLOUT}.top_k", Rule(lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1"), "-1"),
    (f"{_ROLLOUT}.response_length", at_least(1), "100"),
    (f"{_ROLLOUT}.max_model_len", at_least(2), "2048"),
    (f"{_ROLLOUT}.num_workers", at_least(1), "1"),
    (f"{_ROLLOUT}.generate_timeout_s", above(0), "600"),
    (f"{_ROLLOUT}.kv_cache_space_gib", above(0), "1.0"),
    (f"{_ROLLOUT}.gpu_memory_utilization", between(0, 1, True, False), "0.5"),
    (f"{_ROLLOUT}.tensor_model_parallel_size", at_least(1), "1"),
    (f"{_ROLLOUT}.num_cpus_per_worker", at_least(0), "0.5"),
    (f"{_ROLLOUT}.num_threads", at_least(0, " (0 = auto)"), "0"),
    (f"{_ROLLOUT}.update_weights_bucket_megabytes", above(0), "256"),
    (f"{_ROLLOUT}.val_kwargs.temperature", at_least(0, " (0 = greedy)"), "0.0"),
    (f"{_ROLLOUT}.val_kwargs.top_p", between(0, 1, True, False), "1.0"),
    ("critic.ppo_epochs", at_least(1), "1"),
    ("critic.cliprange_value", above(0), "0.5"),
    ("critic.grad_clip", above(0), "1.0"),
    ("algorithm.kl_ctrl.kl_coef", at_least(0), "0.001"),
    ("algorithm.kl_ctrl.target_kl", above(0), "0.1"),
    ("algorithm.kl_ctrl.horizon", at_least(1), "10000"),
    ("agent_proxy.max_turn", at_least(1), "5"),
    ("agent_proxy.num_env_actors", at_least(1), "2"),
    ("agent_proxy.num_cpus_per_env_actor", at_least(0), "0.1"),
    ("ctx_manager.keep_last_n_turns", optional(at_least(0, " (0 = no history)")), "2"),
    ("trainer.total_training_steps", at_least(1), "10"),
    ("es_manager.min_group_left", at_least(1), "2"),
    ("trainer.max_off_policy_steps", at_least(0, " (0: on-policy, 1: one-step off-policy, k >= 2: asynchronous)"), "2"),
    ("trainer.rollouts_in_flight", optional(at_least(1)), "null"),
    ("algorithm.filter_groups.max_num_gen_batches", at_least(1), "10"),
    ("trainer.seed", at_least(0), "0"),
    ("trainer.ray_num_cpus", optional(above(0)), "null"),
    ("trainer.max_actor_ckpt_to_keep", optional(at_least(1)), "null"),
    ("trainer.max_critic_ckpt_to_keep", optional(at_least(1)), "null"),
    ("trainer.dashboard_port", optional(between(1, 65535, False, False)), "null"),
    ("trainer.max_restarts", at_least(0), "0"),
    ("trainer.collective_timeout_s", above(0), "600"),
    ("trainer.placement_timeout_s", above(0), "120"),
    ("trainer.log_trajectories_freq", at_least(0, " (0 = off)"), "10"),
    ("trainer.log_trajectories_per_tag", at_least(1), "4"),
    ("trainer.collapse_metrics_freq", at_least(0, " (0 = off)"), "10"),
    ("trainer.collapse_metrics_num_prompts", at_least(2, " (the mutual information over one prompt is 0)"), "8"),
    ("eval.k", at_least(0, " (0 = greedy only)"), "4"),
    ("es_manager.format_penalty", at_most(0, " (a penalty; a positive value would reward bad answers)"), "-0.1"),
    ("es_manager.seed", at_least(0), "0"),
    ("data.max_prompt_length", at_least(1), "1024"),
    ("data.max_turns", at_least(1, " (1 = single-turn)"), "1"),
    ("reward_model.max_length", at_least(1), "2048"),
    ("reward_model.micro_batch_size_per_gpu", at_least(1), "4"),
    ("reward_model.world_size", at_least(1), "1"),
    ("reward_model.num_cpus_per_rank", at_least(0), "0.25"),
    ("reward_model.reward_weight", Rule(lambda v: v != 0, "must not be 0 (the scores would be ignored; use "
                                                          "reward_model.enable=false)"), "1.0"),
    ("judge.reward_weight", Rule(lambda v: v != 0, "must not be 0 (the scores would be ignored; use "
                                                   "judge.enable=false)"), "1.0"),
    ("judge.env_reward_weight", at_least(0, " (0 = the judge's score alone)"), "1.0"),
    ("judge.temperature", at_least(0), "0.0"),
    ("judge.max_tokens", at_least(1), "1024"),
    ("judge.timeout_s", above(0), "60"),
    ("judge.max_retries", at_least(0), "2"),
    ("judge.max_concurrency", at_least(1), "8"),
    ("judge.cache_size", at_least(0, " (0 = no cache)"), "10000"),
    ("judge.max_unscored_fraction", between(0, 1, False, False), "0.5"),
    ("algorithm.distill.coef", above(0), "1.0"),
    ("algorithm.distill.log_prob_micro_batch_size_per_gpu", at_least(1), "4"),
    ("es_manager.env_step_timeout_s", above(0), "60"),
    ("es_manager.env_reset_timeout_s", above(0), "60"),
    ("es_manager.max_failed_reset_fraction", between(0, 1, False, False), "0.5"),
    ("es_manager.max_env_error_fraction", between(0, 1, False, False), "0.5"),
    ("es_manager.max_observation_chars", at_least(100), "20000"),
    *sections(_OPTIM, "actor_rollout_ref.actor", "critic"),
    *sections(_FSDP, "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "algorithm.distill"),
]
"""Single-key numeric ranges; a non-finite number (nan, inf) never passes."""


def choices(cfg: AgentTrainerConfig) -> list[tuple[str, Any, tuple]]:
    """Single-key choices: (key, value, allowed)."""
    norm = cfg.agent_proxy.reward_normalization
    return [  # the estimator, policy loss and KL choices are in core_algos.validate_algorithm_choices
        ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, core_algos.KL_PENALTY_TYPES),
        ("algorithm.rollout_correction.rollout_is", cfg.algorithm.rollout_correction.rollout_is,
         (None, *core_algos.ROLLOUT_IS_LEVELS)),
        ("algorithm.rollout_correction.rollout_rs", cfg.algorithm.rollout_correction.rollout_rs,
         (None, *core_algos.ROLLOUT_RS_LEVELS)),
        ("actor_rollout_ref.actor.recompute_old_log_prob", cfg.actor_rollout_ref.actor.recompute_old_log_prob,
         RECOMPUTE_OLD_LOG_PROB),
        ("actor_rollout_ref.model.dtype", cfg.actor_rollout_ref.model.dtype, DTYPES),
        ("actor_rollout_ref.rollout.dtype", cfg.actor_rollout_ref.rollout.dtype, (None, *DTYPES)),
        # actor_rollout_ref.rollout.name: the engine registry's names or an import path (checks.engines.engine_class)
        ("actor_rollout_ref.rollout.weight_sync", cfg.actor_rollout_ref.rollout.weight_sync, WEIGHT_SYNC_TRANSPORTS),
        ("actor_rollout_ref.rollout.mode", cfg.actor_rollout_ref.rollout.mode, ROLLOUT_MODES),
        ("trainer.async_mode", cfg.trainer.async_mode, ASYNC_MODES),
        ("trainer.stale_groups", cfg.trainer.stale_groups, STALE_GROUP_POLICIES),
        ("trainer.refill", cfg.trainer.refill, REFILL_UNITS),
        ("algorithm.filter_groups.metric", cfg.algorithm.filter_groups.metric, FILTER_GROUPS_METRICS),
        ("actor_rollout_ref.rollout.rollout_filter_strategy", cfg.actor_rollout_ref.rollout.rollout_filter_strategy,
         core_algos.ROLLOUT_FILTER_STRATEGIES),
        ("critic.model.dtype", cfg.critic.model.dtype, DTYPES),
        ("actor_rollout_ref.ref.dtype", cfg.actor_rollout_ref.ref.dtype, (None, *DTYPES)),
        ("algorithm.distill.dtype", cfg.algorithm.distill.dtype, (None, *DTYPES)),
        ("algorithm.distill.mode", cfg.algorithm.distill.mode, core_algos.DISTILL_MODES),
        *((f"{section}.fsdp.mixed_precision", role.fsdp.mixed_precision, MIXED_PRECISIONS) for section, role in (
            ("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor),
            ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref), ("critic", cfg.critic),
            ("algorithm.distill", cfg.algorithm.distill))),
        ("critic.loss_agg_mode", cfg.critic.loss_agg_mode, core_algos.LOSS_AGG_MODES),
        ("agent_proxy.reward_normalization.grouping", norm.grouping, core_algos.REWARD_NORM_GROUPINGS),
        ("agent_proxy.reward_normalization.method", norm.method, core_algos.REWARD_NORM_METHODS),
        ("ctx_manager.mode", cfg.ctx_manager.mode, CTX_MODES),
        ("trainer.device", cfg.trainer.device, ("auto", "cpu", "cuda")),
        ("trainer.resume_mode", cfg.trainer.resume_mode, RESUME_MODES),
        ("reward_model.input", cfg.reward_model.input, RM_INPUTS),
        ("judge.input", cfg.judge.input, RM_INPUTS),
        ("reward_model.model.dtype", cfg.reward_model.model.dtype, DTYPES),
    ]


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_optim(key: str, optim: Any) -> None:
    """An optimizer section's rules that relate its keys (``key``: where it sits, e.g. ``critic.optim``); the
    RL and the SFT configs share them."""
    betas = list(optim.betas)
    check(len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas),
          f"{key}.betas = {betas} must be two numbers in [0, 1); e.g. {key}.betas=[0.9,0.999]")
    check_choice(f"{key}.lr_scheduler_type", optim.lr_scheduler_type, LR_SCHEDULERS)
    check(optim.min_lr_ratio == 0 or optim.lr_scheduler_type == "cosine",
          f"{key}.min_lr_ratio = {optim.min_lr_ratio} is the floor of the cosine schedule, but "
          f"{key}.lr_scheduler_type = {optim.lr_scheduler_type!r} keeps the learning rate constant; set "
          f"{key}.lr_scheduler_type=cosine or drop min_lr_ratio")


def get_key(cfg: Any, key: str) -> Any:
    return reduce(getattr, key.split("."), cfg)


def changed_keys(value: Any, default: Any, prefix: str) -> list[str]:
    """The dotted keys under ``prefix`` where ``value`` differs from ``default`` (two dataclass instances; nested
    sections are followed): what a section's ``enable = False`` would ignore."""
    out = []
    for f in dataclasses.fields(default):
        a, b = getattr(value, f.name), getattr(default, f.name)
        out += changed_keys(a, b, f"{prefix}.{f.name}") if dataclasses.is_dataclass(b) else \
            ([f"{prefix}.{f.name}"] if a != b else [])
    return out


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_algorithm_choices(
    adv_estimator: str,
    loss_agg_mode: str,
    kl_loss_type: str,
    policy_loss_mode: str,
    kl_ctrl_type: str,
    *,
    bi_level_gae: bool = False,
    gamma: float | None = None,
    lam: float | None = None,
    high_level_gamma: float | None = None,
) -> None:
    """Check the algorithm-related config values at start-up; raise ValueError naming the key.

    Keys: algorithm.adv_estimator, actor_rollout_ref.actor.loss_agg_mode,
    actor_rollout_ref.actor.kl_loss_type, actor_rollout_ref.actor.policy_loss_mode,
    algorithm.kl_ctrl.type, and optionally algorithm.bi_level_gae and
    algorithm.gamma / lam / high_level_gamma (each must lie in [0, 1]).
    """
    check_choice("algorithm.adv_estimator", adv_estimator, core_algos.estimator_names())
    check_choice("actor_rollout_ref.actor.loss_agg_mode", loss_agg_mode, core_algos.LOSS_AGG_MODES)
    check_choice("actor_rollout_ref.actor.kl_loss_type", kl_loss_type, core_algos.KL_PENALTY_TYPES)
    check_choice("actor_rollout_ref.actor.policy_loss_mode", policy_loss_mode, core_algos.POLICY_LOSS_MODES)
    check_choice("algorithm.kl_ctrl.type", kl_ctrl_type, core_algos.KL_CTRL_TYPES)
    core_algos.resolve_adv_estimator(adv_estimator, bi_level_gae)
    for key, value in (("algorithm.gamma", gamma), ("algorithm.lam", lam),
                       ("algorithm.high_level_gamma", high_level_gamma)):
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"{key} = {value} must lie in [0, 1]; set it to a discount/lambda in that range")
