"""The trainer's single dispatch call, the name tables derived from the registered estimators
(``estimator_spec``), and the estimator a config section selects."""

from __future__ import annotations

from functools import reduce
from typing import Any, Callable, Mapping

import torch

from agent_trainer.config.schema import AgentTrainerConfig, AlgorithmConfig
from agent_trainer.config.splits import Split

from ._masked import as_group_index
from .estimators import ALWAYS_KEYS, ARGUMENT_NAMES, BATCH_KEY_DOCS, ESTIMATOR_SPECS, EstimatorSpec, estimator_spec
from .multiturn import EpisodeStitch

BI_LEVEL_GAE_FROM = ("gae", "bi_level_gae")
"""The estimators ``algorithm.bi_level_gae = True`` turns into bi_level_gae (RAGEN's spelling of it)."""


def __getattr__(name: str) -> Any:
    """The name tables, derived from the registered specs each time they are read (``@register_estimator``)."""
    if name == "ADV_ESTIMATORS":  # name -> function
        return {n: s.fn for n, s in ESTIMATOR_SPECS.items()}
    if name == "ADV_ESTIMATOR_NAMES":
        return tuple(ESTIMATOR_SPECS)
    if name == "CRITIC_ESTIMATORS":  # estimators that need batch["values"] (and therefore a critic)
        return tuple(n for n, s in ESTIMATOR_SPECS.items() if s.needs_critic)
    if name == "ESTIMATOR_OPTIONS":  # extra keyword options compute_advantage forwards (others take none)
        return {n: tuple(s.options) for n, s in ESTIMATOR_SPECS.items() if s.options}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DERIVED_TABLES = ("ADV_ESTIMATORS", "ADV_ESTIMATOR_NAMES", "CRITIC_ESTIMATORS", "ESTIMATOR_OPTIONS")
"""The module attributes :func:`__getattr__` derives from the specs."""


def get_adv_estimator_fn(name: str) -> Callable:
    """The estimator registered as ``name``; unknown names raise ValueError listing the known ones."""
    return estimator_spec(name).fn


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
    (the spec's ``options``: epsilon; step_advantage_w and mode for gigpo) are
    passed through; any other option raises ValueError. Which keys, hyperparameters and
    options an estimator gets is its ``@register_estimator`` spec.

    An episode that comes as several rows (``traj_uid`` repeats: a gateway agent's step-wise rows) is read by an
    estimator of the full layout as the one sequence its rows make one after another (:func:`episode_stitch`),
    and the results go back to its rows: each episode counts once in its group, and returns flow across its rows.

    Returns (advantages, returns), [B, T]. Estimators without a critic return
    returns = advantages (verl convention), except reinforce_plus_plus and remax,
    which return the discounted / undiscounted return-to-go as ``returns``.
    """
    spec = estimator_spec(adv_estimator)
    accepted = tuple(spec.options)
    unknown = [k for k in estimator_kwargs if k not in accepted]
    if unknown:
        raise ValueError(f"adv_estimator {adv_estimator!r} does not take {unknown}; its options are {list(accepted)}")
    hyper = {"gamma": gamma, "lam": lam, "high_level_gamma": high_level_gamma,
             "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo}
    kwargs = {ARGUMENT_NAMES.get(k, k): _need(batch, k, adv_estimator, BATCH_KEY_DOCS.get(k, f"read by {spec.name}"))
              for k in (*ALWAYS_KEYS, *spec.batch_keys)}
    kwargs.update({ARGUMENT_NAMES.get(k, k): batch.get(k) for k in spec.optional_keys})
    stitch = episode_stitch(batch, spec)
    if stitch is None:
        return spec.fn(**kwargs, **{h: hyper[h] for h in spec.hyperparameters}, **estimator_kwargs)
    kwargs = {name: stitch.to_episodes(value) for name, value in kwargs.items()}
    advantages, returns = spec.fn(**kwargs, **{h: hyper[h] for h in spec.hyperparameters}, **estimator_kwargs)
    return stitch.to_rows(advantages), stitch.to_rows(returns)


def episode_stitch(batch: Mapping[str, torch.Tensor], spec: EstimatorSpec) -> EpisodeStitch | None:
    """The one-sequence-per-episode view of a batch whose episodes come as several rows (``traj_uid`` repeats) for
    an estimator that reads a row as a whole episode (its layouts include full; ``anchor_obs_ids`` per token when
    present): a gateway agent's step-wise rows. None when every episode is one row, or when the estimator reads
    per-turn rows itself (grpo_multiturn; GiGPO with one anchor per row, the condensed context's layout)."""
    traj, anchors = batch.get("traj_uid"), batch.get("anchor_obs_ids")
    per_row_anchors = spec.compares_turns and anchors is not None and not (
        isinstance(anchors, torch.Tensor) and anchors.dim() == 2)
    if traj is None or "full" not in spec.layouts or per_row_anchors:
        return None
    rewards = batch["token_level_rewards"]
    traj = as_group_index("traj_uid", traj, rewards.shape[0])
    if torch.unique(traj).numel() == traj.numel():
        return None
    mask = batch.get("attention_mask")
    lengths = mask.sum(-1) if mask is not None else torch.full((rewards.shape[0],), rewards.shape[1])
    return EpisodeStitch(traj.cpu(), lengths.cpu(), rewards.shape[1])


def resolve_adv_estimator(adv_estimator: str, bi_level_gae: bool = False) -> str:
    """Map RAGEN-style ``algorithm.adv_estimator=gae`` + ``algorithm.bi_level_gae=True`` to "bi_level_gae"."""
    if not bi_level_gae:
        return adv_estimator
    if adv_estimator not in BI_LEVEL_GAE_FROM:
        raise ValueError(f"algorithm.bi_level_gae = True needs algorithm.adv_estimator = gae, got {adv_estimator!r}; "
                         "set algorithm.adv_estimator=gae or algorithm.bi_level_gae=False")
    return "bi_level_gae"


def estimator(algorithm: AlgorithmConfig) -> str:
    """The estimator ``algorithm`` (the config's section) actually uses (``bi_level_gae: true`` upgrades ``gae``)."""
    return resolve_adv_estimator(algorithm.adv_estimator, algorithm.bi_level_gae)


def estimator_options(algorithm: AlgorithmConfig) -> dict:
    """Extra keyword options of the estimator in use, each read from the config key its spec names."""
    options = estimator_spec(estimator(algorithm)).options
    return {name: reduce(getattr, key.split(".")[1:], algorithm) for name, key in options.items()}


def trainer_splits(cfg: AgentTrainerConfig) -> tuple[Split, ...]:
    """The splits a training run plays, each with env actors of its own: train; val only when the run validates
    (``trainer.test_freq`` > 0), so a run that never validates starts no val env actors; the greedy baseline split
    when the estimator reads ``reward_baselines`` (ReMax)."""
    return ((Split.TRAIN,) + ((Split.VAL,) if cfg.trainer.test_freq > 0 else ())
            + ((Split.REMAX_BASELINE,) if estimator_spec(estimator(cfg.algorithm)).greedy_baseline else ()))


def critic_enabled(cfg: AgentTrainerConfig) -> bool:
    """Whether a run of ``cfg`` starts a critic worker: ``critic.enable`` as set, else whether its estimator reads
    values."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    spec = ESTIMATOR_SPECS.get(estimator(cfg.algorithm))  # an unknown name is refused by the checks, not here
    return spec is not None and spec.needs_critic
