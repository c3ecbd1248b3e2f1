"""The worker layer as the trainer and the entry points reach it: a name -> import path table, resolved on use.

``agent_trainer/workers/`` sits above most of ``agent_trainer``: its classes import the config, the batch, ``core_algos``,
the env-state manager and the rollout. The modules above it (the trainers, ``evaluate``, the entry points,
the memory plan and ``export``) build or call workers, so they cannot import ``workers`` without closing an
import cycle between the two packages. They name what they use here instead, the way ``envs/registry.py``
names environments: ``worker_api("build_workers")`` imports ``agent_trainer.workers.build`` on first use (FSDP, vLLM and
Ray load then, never when ``agent_trainer`` is imported). A test resolves every entry, and the layer test
allows ``worker_api`` only in the trainer and entry-point layers (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import importlib
from typing import Any

WORKER_API: dict[str, str] = {
    "build_workers": "agent_trainer.workers.build:build_workers",
    "build_engines": "agent_trainer.workers.build:build_engines",
    "build_actor_group": "agent_trainer.workers.build:build_actor_group",
    "env_actor_class": "agent_trainer.workers.build:env_actor_class",
    "resolve_device": "agent_trainer.workers.build:resolve_device",
    "check_placement": "agent_trainer.workers.build:check_placement",
    "resource_demands": "agent_trainer.workers.build:resource_demands",
    "ActorWorker": "agent_trainer.workers.actor:ActorWorker",
    "WorkerGroup": "agent_trainer.workers.worker_group:WorkerGroup",
    "WorkerDied": "agent_trainer.workers.worker_group:WorkerDied",
    "PlacementError": "agent_trainer.workers.worker_group:PlacementError",
    "sync_plan": "agent_trainer.workers.weight_sync:sync_plan",
    "sync_weights": "agent_trainer.workers.weight_sync:sync_weights",
    "decoder_layers": "agent_trainer.workers.fsdp_base:_decoder_layers",
    "sharded_checkpoint": "agent_trainer.workers.sharded_checkpoint",
    "lora": "agent_trainer.workers.lora",
}
"""Name -> ``"package.module:attribute"`` (or ``"package.module"`` for a whole module)."""


def worker_api(name: str) -> Any:
    """The object ``WORKER_API[name]`` names, imported now (an ImportError propagates: a missing dependency)."""
    if name not in WORKER_API:
        raise KeyError(f"{name!r} is not in agent_trainer.worker_registry.WORKER_API; known: {sorted(WORKER_API)}")
    module_name, _, attr = WORKER_API[name].partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module
