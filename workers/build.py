"""Where the worker groups are built: the one place ``ray.remote`` meets the worker classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.es_manager import EnvStateManager
from workers.actor import ActorWorker, ReferenceWorker
from workers.critic import CriticWorker
from workers.worker_group import WorkerGroup


@dataclass
class Workers:
    """Handles to everything the trainer drives."""

    actor: WorkerGroup
    critic: WorkerGroup | None
    ref: WorkerGroup | None
    engines: list[Any]
    """Ray actor handles of the rollout engines."""
    env_worker_cls: Any
    """The ``ray.remote`` env-state manager class (the rollout starts and names its own env actors)."""


def resolve_device(device: str) -> str:
    """``auto`` becomes ``cuda`` when the Ray cluster has GPUs, else ``cpu``."""
    if device == "auto":
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return device


def build_workers(cfg: AgentTrainerConfig) -> Workers:
    """Start the actor, critic, reference and rollout groups and load their models.

    On GPU every FSDP rank takes one GPU and every engine
    ``tensor_model_parallel_size`` GPUs (no colocation yet).
    """
    device = resolve_device(cfg.trainer.device)
    gpus = 1.0 if device == "cuda" else 0.0
    arr = cfg.actor_rollout_ref
    actor = WorkerGroup(
        ActorWorker, name="actor", world_size=arr.actor.fsdp.world_size, num_cpus_per_rank=arr.actor.fsdp.num_cpus_per_rank,
        num_gpus_per_rank=gpus, distributed=True,
        init_kwargs={"model": arr.model, "actor": arr.actor, "device": device, "seed": cfg.trainer.seed},
    )
    critic = None
    if cfg.critic_enabled:
        critic = WorkerGroup(
            CriticWorker, name="critic", world_size=cfg.critic.fsdp.world_size,
            num_cpus_per_rank=cfg.critic.fsdp.num_cpus_per_rank, num_gpus_per_rank=gpus, distributed=True,
            init_kwargs={"critic": cfg.critic, "device": device, "seed": cfg.trainer.seed},
        )
    ref = None
    if cfg.ref_enabled:
        ref = WorkerGroup(
            ReferenceWorker, name="ref", world_size=arr.ref.fsdp.world_size, num_cpus_per_rank=arr.ref.fsdp.num_cpus_per_rank,
            num_gpus_per_rank=gpus, distributed=True, init_kwargs={"model": arr.model, "ref": arr.ref, "device": device,
                                                             "seed": cfg.trainer.seed},
        )
    engines = build_engines(cfg, device)
    # Load every model at once: the groups' collectives are independent of each other.
    ray.get([r for g in (actor, critic, ref) if g is not None for r in g.execute_all_async("init_model")])
    # A crashed env actor is restarted by Ray; the rollout reports the failure and resets it. The rollout
    # names each one (``env_train_0``, ``env_val_0``, ...) with ``.options(name=...)``.
    env_worker_cls = ray.remote(num_cpus=cfg.agent_proxy.num_cpus_per_env_actor, max_restarts=3)(EnvStateManager)
    return Workers(actor=actor, critic=critic, ref=ref, engines=engines.workers, env_worker_cls=env_worker_cls)


def build_engines(cfg: AgentTrainerConfig, device: str) -> WorkerGroup:
    """The rollout engines: vLLM (CPU build here, CUDA vLLM on GPUs) or HF generate."""
    from workers.rollout import HFRolloutWorker, VLLMRolloutWorker

    r = cfg.actor_rollout_ref.rollout
    worker_cls = VLLMRolloutWorker if r.name == "vllm" else HFRolloutWorker
    kwargs: dict[str, Any] = {
        "model_path": cfg.actor_rollout_ref.model.path,
        "dtype": cfg.actor_rollout_ref.model.dtype,
        "max_model_len": r.max_model_len,
        "seed": cfg.trainer.seed,
    }
    if r.name == "vllm":
        kwargs.update(kv_cache_space_gib=r.kv_cache_space_gib, tensor_parallel_size=r.tensor_model_parallel_size,
                      gpu_memory_utilization=r.gpu_memory_utilization)
    return WorkerGroup(
        worker_cls, name="rollout", world_size=r.num_workers, num_cpus_per_rank=r.num_cpus_per_worker,
        num_gpus_per_rank=float(r.tensor_model_parallel_size) if device == "cuda" else 0.0,
        # A crashed engine is restarted by Ray; the rollout re-syncs its weights and retries the turn.
        pass_rank=False, init_kwargs=kwargs, max_restarts=2,
    )
