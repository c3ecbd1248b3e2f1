"""The estimator registry: ``@register_estimator`` records each advantage estimator's properties where it is defined.

Every table about estimators derives from the specs recorded here: the names (``algorithm.adv_estimator``'s
choices), which need a critic, the batch keys ``compute_advantage`` hands over, the context layouts
(``ctx_manager.mode``) an estimator reads, its options, and the start-up checks of ``agent_trainer.checks``.
Adding an estimator is one file in ``core_algos/`` that defines a decorated function; the package imports
every module of its own (docs/algorithms.md, "Adding an estimator").
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping

ALWAYS_KEYS = ("token_level_rewards", "response_mask")
"""Batch keys every estimator receives."""
ARGUMENT_NAMES = {"uid": "index", "traj_uid": "traj_index", "anchor_obs_ids": "anchor_obs"}
"""Batch key -> the estimator's argument name where verl's names differ; other keys are passed under their own name."""
HYPERPARAMETERS = ("gamma", "lam", "high_level_gamma", "norm_adv_by_std_in_grpo")
"""``compute_advantage``'s keyword arguments an estimator may read (``hyperparameters=``)."""
LAYOUTS = ("full", "condensed")
"""``ctx_manager.mode``: one training row per episode (full) or per turn (condensed)."""
BATCH_KEY_DOCS = {
    "token_level_rewards": "[B, T] float",
    "response_mask": "[B, T] 0/1",
    "values": "[B, T] critic values",
    "uid": "[B] group id",
    "traj_uid": "[B] trajectory id",
    "anchor_obs_ids": "int64 [B, T] or [B] hashed anchor observation",
    "reward_baselines": "[B] greedy-response reward",
    "turn_ids": "int64 [B, T] turn index",
    "step_rewards": "float [B] per-step reward",
}
"""What each batch key holds, for the error messages (agent_trainer/common/batch.py has the whole contract)."""


@dataclass(frozen=True)
class EstimatorSpec:
    """One registered estimator and what it needs.

    ``batch_keys``: keys it cannot run without (besides ``ALWAYS_KEYS``); ``optional_keys``: read when present.
    ``layouts``: the ``ctx_manager.mode`` values whose rows it reads as intended. ``options``: option name ->
    the config key it is read from (``estimator_options``). ``hyperparameters``: which of ``HYPERPARAMETERS`` it
    takes. Derived: ``needs_critic`` (reads ``values``), ``compares_group`` (reads ``uid``: its baseline is the
    other episodes of a group), ``compares_turns`` (reads ``anchor_obs_ids``: compares turns from the same state),
    ``greedy_baseline`` (reads ``reward_baselines``: the trainer plays one greedy episode per group).
    """

    name: str
    fn: Callable
    batch_keys: tuple[str, ...] = ()
    optional_keys: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ("full",)
    options: Mapping[str, str] = field(default_factory=dict)
    hyperparameters: tuple[str, ...] = ()

    @property
    def needs_critic(self) -> bool:
        return "values" in self.batch_keys

    @property
    def compares_group(self) -> bool:
        return "uid" in self.batch_keys

    @property
    def compares_turns(self) -> bool:
        return "anchor_obs_ids" in self.batch_keys

    @property
    def greedy_baseline(self) -> bool:
        return "reward_baselines" in self.batch_keys


ESTIMATOR_SPECS: dict[str, EstimatorSpec] = {}
"""name -> spec, in registration order (``core_algos/__init__`` imports the estimator modules)."""


def register_estimator(name: str, *, needs_critic: bool = False, batch_keys: tuple[str, ...] = (),
                       optional_keys: tuple[str, ...] = (), layouts: tuple[str, ...] = ("full",),
                       options: Mapping[str, str] | None = None,
                       hyperparameters: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register the decorated function as ``algorithm.adv_estimator = name``; returns the function unchanged.

    ``needs_critic=True`` must come with ``"values"`` in ``batch_keys`` (and only then). Refused at import
    (ValueError): a name registered twice, an unknown layout or hyperparameter, an option read from outside
    ``algorithm.``, or an argument the function does not take or does not get.
    """

    def register(fn: Callable) -> Callable:
        spec = EstimatorSpec(name, fn, tuple(batch_keys), tuple(optional_keys), tuple(layouts), dict(options or {}),
                             tuple(hyperparameters))
        _validate(spec, needs_critic)
        old = ESTIMATOR_SPECS.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"advantage estimator {name!r} is registered twice: {_where(old.fn)} and {_where(fn)}; "
                             "give one of them another name")
        ESTIMATOR_SPECS[name] = spec
        return fn

    return register


def _where(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _validate(spec: EstimatorSpec, needs_critic: bool) -> None:
    where = f"@register_estimator({spec.name!r}) on {_where(spec.fn)}"
    if needs_critic != spec.needs_critic:
        raise ValueError(f"{where}: needs_critic={needs_critic} but 'values' is "
                         f"{'' if spec.needs_critic else 'not '}in batch_keys; a critic estimator reads "
                         "batch['values'], and only a critic estimator does")
    bad = [x for x in spec.layouts if x not in LAYOUTS]
    bad += [h for h in spec.hyperparameters if h not in HYPERPARAMETERS]
    if bad or not spec.layouts:
        raise ValueError(f"{where}: layouts must be among {list(LAYOUTS)} and hyperparameters among "
                         f"{list(HYPERPARAMETERS)}; got {bad or 'no layout'}")
    outside = [k for k in spec.options.values() if not k.startswith("algorithm.")]
    if outside:
        raise ValueError(f"{where}: options are read from the algorithm section (algorithm.*), not {outside}")
    params = inspect.signature(spec.fn).parameters
    passed = [ARGUMENT_NAMES.get(k, k) for k in (*ALWAYS_KEYS, *spec.batch_keys, *spec.optional_keys)]
    passed += [*spec.hyperparameters, *spec.options]
    unknown = [p for p in passed if p not in params]
    missing = [p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in passed
               and v.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if unknown or missing:
        raise ValueError(f"{where}: the function does not take {unknown} or is never given {missing} "
                         f"(batch keys are passed as {ARGUMENT_NAMES} else under their own name)")


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec registered as ``name``; unknown names raise ValueError listing the known ones."""
    if name not in ESTIMATOR_SPECS:
        raise ValueError(f"unknown advantage estimator {name!r}; known estimators: {list(ESTIMATOR_SPECS)}")
    return ESTIMATOR_SPECS[name]


def estimator_names() -> tuple[str, ...]:
    """Every registered estimator, in registration order."""
    return tuple(ESTIMATOR_SPECS)
