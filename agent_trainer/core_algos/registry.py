"""Estimator registry, the trainer's single dispatch call, and the estimator a config section selects."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from agent_trainer.config.schema import AgentTrainerConfig, AlgorithmConfig

from .advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from .gigpo import compute_gigpo_outcome_advantage
from .multiturn import compute_bi_level_gae_advantage_return, compute_grpo_multiturn_advantage

ADV_ESTIMATORS: dict[str, Callable] = {
    "gae": compute_gae_advantage_return,
    "bi_level_gae": compute_bi_level_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_multiturn": compute_grpo_multiturn_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "gigpo": compute_gigpo_outcome_advantage,
}
ADV_ESTIMATOR_NAMES = tuple(ADV_ESTIMATORS)
CRITIC_ESTIMATORS = ("gae", "bi_level_gae")
"""Estimators that need ``batch["values"]`` (and therefore a critic)."""
ESTIMATOR_OPTIONS: dict[str, tuple[str, ...]] = {
    "grpo": ("epsilon",),
    "grpo_multiturn": ("epsilon",),
    "rloo": ("epsilon",),
    "reinforce_plus_plus_baseline": ("epsilon",),
    "gigpo": ("epsilon", "step_advantage_w", "mode"),
}
"""Extra keyword options ``compute_advantage`` forwards to each estimator (others take none)."""


def get_adv_estimator_fn(name: str) -> Callable:
    """The estimator registered as ``name``; unknown names raise ValueError listing the known ones."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known estimators: {list(ADV_ESTIMATOR_NAMES)}")
    return ADV_ESTIMATORS[name]


def _need(batch: Mapping[str, torch.Tensor], key: str, name: str, what: str) -> torch.Tensor:
    if key not in batch or batch[key] is None:
        raise ValueError(f"adv_estimator {name!r} needs batch[{key!r}] ({what}); the batch has {sorted(batch)}")
    return batch[key]


def compute_advantage(
    batch: Mapping[str, torch.Tensor],
    adv_estimator: str,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    high_level_gamma: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    **estimator_kwargs,
):
    """Run the estimator named ``adv_estimator`` on a training batch.

    batch keys (per-token tensors are [B, T] over the whole sequence):
        "token_level_rewards", "response_mask"      always
        "values"            gae, bi_level_gae (critic values)
        "uid"               [B] group id: grpo, grpo_multiturn, rloo,
                            reinforce_plus_plus_baseline, gigpo
        "traj_uid"          [B] trajectory id: grpo_multiturn, gigpo with one row per step
                            (ids are int64 tensors, or, as verl's ``non_tensor_batch["uid"]``,
                            numpy arrays / lists of hashable ids such as strings)
        "turn_ids"          optional int64 [B, T]: explicit turns for bi_level_gae / gigpo
        "anchor_obs_ids"    gigpo: int64 [B, T] (one row per episode: the hashed observation
                            each turn answered, constant over the turn's tokens) or [B]
                            (one row per step; int64 or hashable ids such as the observation text)
        "step_rewards"      optional float [B], gigpo with one row per step
        "reward_baselines"  remax: float [B], reward of the greedy response
    gamma / lam go to the estimators that discount (gae, bi_level_gae,
    reinforce_plus_plus, gigpo's step returns); high_level_gamma to bi_level_gae;
    norm_adv_by_std_in_grpo to grpo and grpo_multiturn; ``estimator_kwargs``
    (see ESTIMATOR_OPTIONS: epsilon; step_advantage_w and mode for gigpo) are
    passed through; any other option raises ValueError.

    Returns (advantages, returns), [B, T]. Estimators without a critic return
    returns = advantages (verl convention), except reinforce_plus_plus and remax,
    which return the discounted / undiscounted return-to-go as ``returns``.
    """
    fn = get_adv_estimator_fn(adv_estimator)
    accepted = ESTIMATOR_OPTIONS.get(adv_estimator, ())
    unknown = [k for k in estimator_kwargs if k not in accepted]
    if unknown:
        raise ValueError(f"adv_estimator {adv_estimator!r} does not take {unknown}; its options are {list(accepted)}")
    name = adv_estimator
    rewards = _need(batch, "token_level_rewards", name, "[B, T] float")
    mask = _need(batch, "response_mask", name, "[B, T] 0/1")
    if name == "gae":
        return fn(rewards, _need(batch, "values", name, "[B, T] critic values"), mask, gamma, lam)
    if name == "bi_level_gae":
        values = _need(batch, "values", name, "[B, T] critic values")
        return fn(rewards, values, mask, gamma, lam, high_level_gamma, turn_ids=batch.get("turn_ids"))
    if name == "reinforce_plus_plus":
        return fn(rewards, mask, gamma=gamma)
    if name == "remax":
        return fn(rewards, _need(batch, "reward_baselines", name, "[B] greedy-response reward"), mask)
    uid = _need(batch, "uid", name, "[B] group id")
    if name == "grpo":
        return fn(rewards, mask, uid, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, **estimator_kwargs)
    if name == "grpo_multiturn":
        traj = _need(batch, "traj_uid", name, "[B] trajectory id")
        return fn(rewards, mask, uid, traj, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, **estimator_kwargs)
    if name == "gigpo":
        anchors = _need(batch, "anchor_obs_ids", name, "int64 [B, T] or [B] hashed anchor observation")
        return fn(rewards, batch.get("step_rewards"), mask, anchors, uid, batch.get("traj_uid"),
                  gamma=gamma, turn_ids=batch.get("turn_ids"), **estimator_kwargs)
    return fn(rewards, mask, uid, **estimator_kwargs)  # rloo, reinforce_plus_plus_baseline


def resolve_adv_estimator(adv_estimator: str, bi_level_gae: bool = False) -> str:
    """Map RAGEN-style ``algorithm.adv_estimator=gae`` + ``algorithm.bi_level_gae=True`` to "bi_level_gae"."""
    if not bi_level_gae:
        return adv_estimator
    if adv_estimator not in CRITIC_ESTIMATORS:
        raise ValueError(f"algorithm.bi_level_gae = True needs algorithm.adv_estimator = gae, got {adv_estimator!r}; "
                         "set algorithm.adv_estimator=gae or algorithm.bi_level_gae=False")
    return "bi_level_gae"


def estimator(algorithm: AlgorithmConfig) -> str:
    """The estimator ``algorithm`` (the config's section) actually uses (``bi_level_gae: true`` upgrades ``gae``)."""
    return resolve_adv_estimator(algorithm.adv_estimator, algorithm.bi_level_gae)


def estimator_options(algorithm: AlgorithmConfig) -> dict:
    """Extra keyword options of the estimator in use (``ESTIMATOR_OPTIONS``), read from ``algorithm``."""
    if estimator(algorithm) == "gigpo":
        return {"step_advantage_w": algorithm.gigpo.step_advantage_w, "mode": algorithm.gigpo.mode,
                "epsilon": algorithm.gigpo.epsilon}
    if "epsilon" in ESTIMATOR_OPTIONS.get(estimator(algorithm), ()):
        return {"epsilon": algorithm.advantage_epsilon}
    return {}


def critic_enabled(cfg: AgentTrainerConfig) -> bool:
    """Whether a run of ``cfg`` starts a critic worker: ``critic.enable`` as set, else whether its estimator reads
    values."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return estimator(cfg.algorithm) in CRITIC_ESTIMATORS
