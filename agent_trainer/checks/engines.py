"""The rollout engines by name: ``actor_rollout_ref.rollout.name`` is a registered name or an engine class's import
path ``package.module:ClassName``, looked up once before ``ray.init``.

The engine classes live in ``agent_trainer/workers/engines/`` (above this layer: the builder runs these checks), so
the built-in engines are registered by import path and loaded with importlib on first use, the shape of
``envs/registry.py``; the engine modules import no vLLM or transformers at import time, so looking one up costs
torch only. A class registered with :func:`register_engine` (a class or an import path) is found by
its name; an import path in the config needs no registration. Every refusal is one line naming the key.

What the checks read from an engine class (:class:`agent_trainer.workers.engines.base.RolloutEngine`): ``name``,
``only_keys`` (rollout keys only it reads, and on which device), ``tensor_parallel``, ``request_seeds`` and its own
``check(cfg)``; ``agent_trainer.workers.build.build_engines`` asks it for ``init_kwargs``.
"""

from __future__ import annotations

import importlib
from typing import Any

from agent_trainer.common.plugins import load_import_path
from envs.import_paths import name_hint

KEY = "actor_rollout_ref.rollout.name"
BASE = "agent_trainer.workers.engines.base:RolloutEngine"
"""The class every engine subclasses (loaded by path: it sits in the workers layer)."""

_ENGINES: dict[str, Any] = {
    "vllm": "agent_trainer.workers.engines.vllm:VLLMEngine",
    "hf": "agent_trainer.workers.engines.hf:HFEngine",
}
"""Name -> engine class or ``"package.module:ClassName"``, in registration order (the built-ins first)."""

DEVICE_ONLY_KEYS: dict[str, str] = {"num_threads": "cpu"}
"""``actor_rollout_ref.rollout`` keys every engine reads on one device only: key -> device. ``num_threads`` sets a CPU
engine's intra-op threads."""


def register_engine(name: str, cls: type | str) -> None:
    """Register an engine class (or its import path) as ``name``; re-registering a name replaces it."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_engine: name must be a non-empty string without ':', got {name!r}")
    if not isinstance(cls, str):
        _check_engine_class(cls, name)
    _ENGINES[name] = cls


def engine_names() -> list[str]:
    """Registered engine names, in registration order."""
    return list(_ENGINES)


def _load_path(path: str, shown: str) -> Any:
    return load_import_path(path, shown, f"registered engines: {engine_names()}", _base())


def _base() -> type:
    module_name, _, attr = BASE.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _check_engine_class(cls: Any, shown: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, _base())):
        raise ValueError(f"{shown}: {cls!r} is not a subclass of agent_trainer.workers.engines.base.RolloutEngine "
                         "(docs/architecture.md, \"Rollout engines\")")


def engine_class(name: str) -> type:
    """The engine class of ``name`` (a registered name or ``package.module:ClassName``); ValueError naming the key,
    the value and the registered names otherwise."""
    shown = f"{KEY} = {name!r}"
    if name in _ENGINES:
        cls = _ENGINES[name]
        if isinstance(cls, str):
            cls = _load_path(cls, shown)
    elif isinstance(name, str) and ":" in name:
        cls = _load_path(name, shown)
    else:
        hint = name_hint(name, engine_names())
        raise ValueError(f"{shown} is not one of the registered rollout engines {engine_names()}; set it to one of "
                         "them or to an engine class's import path 'package.module:ClassName'"
                         + (f"; {hint}" if hint else ""))
    _check_engine_class(cls, shown)
    return cls


def _classes() -> dict[str, type]:
    """Every registered engine's class (the built-ins load their modules, which import no engine library)."""
    return {name: engine_class(name) for name in engine_names()}


def _names_with(flag: str) -> list[str]:
    return [name for name, cls in _classes().items() if getattr(cls, flag, False)]


def engine_only_keys() -> dict[str, tuple[tuple[str, ...], str]]:
    """Rollout keys only some engines or one device read: key -> (the engines that read it, "" = every engine;
    the device it is read on, "" = both), from the registered engines' ``only_keys`` and :data:`DEVICE_ONLY_KEYS`."""
    keys: dict[str, tuple[tuple[str, ...], str]] = {}
    for name, cls in _classes().items():
        for key, device in cls.only_keys.items():
            engines, _ = keys.get(key, ((), device))
            keys[key] = ((*engines, name), device)
    for key, device in DEVICE_ONLY_KEYS.items():
        keys[key] = ((), device)
    return keys


def check_engine(cfg) -> type:
    """``actor_rollout_ref.rollout.name`` resolved, and the rules of what the engine can do: tensor parallelism,
    per-request seeds (``rollout.mode=async``), then the engine's own ``check(cfg)``. Returns the class."""
    r = cfg.actor_rollout_ref.rollout
    cls = engine_class(r.name)
    if r.tensor_model_parallel_size > 1 and not cls.tensor_parallel:
        raise ValueError(f"{KEY.rpartition('.')[0]}.tensor_model_parallel_size = {r.tensor_model_parallel_size} "
                         f"needs rollout.name={'|'.join(_names_with('tensor_parallel'))} (got {r.name!r}); "
                         "set it to 1")
    return cls


def check_engine_mode(cfg, cls: type) -> None:
    """``rollout.mode = async`` seeds each request: the engine must take per-request seeds."""
    r = cfg.actor_rollout_ref.rollout
    if r.mode == "async" and not cls.request_seeds:
        seeded = _names_with("request_seeds")
        raise ValueError(f"actor_rollout_ref.rollout.mode = async needs rollout.name={'|'.join(seeded)} (got "
                         f"{r.name!r}): it seeds each request, which the {r.name} engine cannot; set "
                         f"rollout.name={seeded[0] if seeded else 'vllm'} or rollout.mode=sync")
