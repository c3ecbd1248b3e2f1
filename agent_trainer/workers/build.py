"""Where the worker groups are built: the one place ``ray.remote`` meets the worker classes.

The entry points (``agent_trainer.main``, ``.sft``, ``.eval``) call a builder once Ray is up and hand what it returns
to their trainer: :class:`Workers`, the started groups and the weight sync between the actor and the engines. The
trainers never build workers, apart from calling again, after a restart, the builder they were handed."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from agent_trainer import core_algos
from agent_trainer.checks.engines import engine_class
from agent_trainer.checks.rl import check_engine_keys, check_offload
from agent_trainer.config import (ActorConfig, AgentTrainerConfig, CriticConfig, ModelConfig, RefConfig,
                                  rollouts_in_flight, split_config)
from agent_trainer.config.splits import Split
from agent_trainer.episode.es_manager import EnvStateManager
from agent_trainer.workers.actor import ActorWorker, ReferenceWorker
from agent_trainer.workers.critic import CriticWorker
from agent_trainer.workers import weight_sync
from agent_trainer.workers.weight_sync import SyncPlan, sync_plan
from agent_trainer.workers.worker_group import PlacementError, WorkerGroup

logger = logging.getLogger(__name__)


@dataclass
class Workers:
    """Handles to everything a trainer drives, and the weight sync between the actor and the engines."""

    actor: WorkerGroup
    sync_plan: SyncPlan
    """How :meth:`sync_weights` ships the actor's weights (``actor_rollout_ref.rollout.weight_sync`` and its
    bucket size, colocation, the collective timeout)."""
    critic: WorkerGroup | None = None
    """The critic group: the actor's group itself when colocated (critic.colocate)."""
    ref: WorkerGroup | None = None
    """The reference group: the actor's group itself when colocated (actor_rollout_ref.ref.colocate)."""
    engines: list[Any] = field(default_factory=list)
    """Ray actor handles of the rollout engines (none for an SFT run that does not evaluate env success)."""
    engine_group: WorkerGroup | None = None
    """The engines' group (its placement group is freed on shutdown)."""
    env_worker_cls: Any = None
    """The ``ray.remote`` env-state manager class (the rollout starts and names its own env actors)."""
    reward_model: WorkerGroup | None = None
    """The reward-model group (``reward_model.enable``), else None."""
    teacher: WorkerGroup | None = None
    """The distillation teacher (``algorithm.distill.enable``): a frozen reference-style group of its own, else None."""
    device: str = "cpu"
    """``trainer.device`` resolved against the cluster: cpu | cuda."""
    sleep_mode: bool = False
    """The engines were created with vLLM's sleep mode (:func:`sleep_mode_on`): the fit loop puts them to sleep."""
    actor_offload: bool = False
    """The actor gives its GPU memory to the engines during rollouts (:func:`actor_offloads`, GPU runs only)."""

    def sync_weights(self, on_stats: Callable[[dict], None] | None = None) -> float:
        """Ship the actor's weights to every engine, bucket by bucket; returns engine 0's reload seconds
        (:func:`agent_trainer.workers.weight_sync.sync_weights`: an engine that dies while loading is waited for and
        sent the weights once more)."""
        return weight_sync.sync_weights(self.actor, self.engines, self.sync_plan, on_stats)

    def groups(self) -> list[WorkerGroup]:
        """Every started group, each once (a colocated critic, reference or teacher is the actor's group)."""
        groups = [self.actor, self.critic, self.ref, self.engine_group, self.reward_model, self.teacher]
        return [g for i, g in enumerate(groups) if g is not None and all(g is not seen for seen in groups[:i])]


def resolve_device(device: str, cluster: dict[str, float] | None = None) -> str:
    """``auto`` becomes ``cuda`` when the Ray cluster has GPUs, else ``cpu`` (``cluster``: its resources, default
    ``ray.cluster_resources()``). The decision is the cluster's, never the driver's own CUDA visibility."""
    if device == "auto":
        cluster = ray.cluster_resources() if cluster is None else cluster
        return "cuda" if cluster.get("GPU", 0) > 0 else "cpu"
    return device


def sleep_mode_on(cfg: AgentTrainerConfig, device: str) -> bool:
    """``actor_rollout_ref.rollout.enable_sleep_mode`` resolved: as set, else on for a colocated GPU run."""
    arr = cfg.actor_rollout_ref
    if arr.rollout.enable_sleep_mode is not None:
        return bool(arr.rollout.enable_sleep_mode)
    return arr.hybrid_engine and device == "cuda"


HYBRID_ENGINE_GPU_SHARE = 0.5
"""Ray's accounting of a colocated bundle's GPU: half for the FSDP rank, half for the engine (the real memory split is
``rollout.gpu_memory_utilization`` and sleep mode; Ray only needs both processes to fit the one bundle)."""


def check_device(cfg: AgentTrainerConfig, device: str, cluster: dict[str, float]) -> None:
    """The rules that need the resolved device (``trainer.device`` against the cluster's resources), each one line.

    Runs once Ray is joined: a cuda run on a cluster without GPUs, tensor parallelism or sleep mode on CPU engines.
    """
    r = cfg.actor_rollout_ref.rollout
    if device == "cuda" and cluster.get("GPU", 0) <= 0:
        raise PlacementError(f"trainer.device = 'cuda' but the Ray cluster has no GPUs ({cluster.get('CPU', 0):g} "
                             "CPU, 0 GPU); join a cluster with GPU nodes (RAY_ADDRESS) or set trainer.device=auto")
    if device == "cpu" and r.tensor_model_parallel_size > 1:
        raise PlacementError(f"actor_rollout_ref.rollout.tensor_model_parallel_size = {r.tensor_model_parallel_size} "
                             "splits the engine over GPUs, and the Ray cluster has none (trainer.device resolved to "
                             "cpu); set it to 1")
    if device == "cpu" and r.enable_sleep_mode:
        raise PlacementError("actor_rollout_ref.rollout.enable_sleep_mode = true needs GPU engines, and the Ray "
                             "cluster has no GPUs (trainer.device resolved to cpu); set it to false (or null)")
    try:  # *.fsdp.param_offload / optimizer_offload on a run that resolved to CPU; keys the device's engines ignore
        check_offload(cfg, device)
        check_engine_keys(cfg, device)
    except ValueError as err:
        raise PlacementError(str(err)) from None
    if sleep_mode_on(cfg, device) and cfg.trainer.max_off_policy_steps:
        raise PlacementError("actor_rollout_ref.rollout.enable_sleep_mode (on with hybrid_engine on GPUs) puts the "
                             "engines to sleep while the step trains, but trainer.max_off_policy_steps = "
                             f"{cfg.trainer.max_off_policy_steps} generates the next rollout then; set "
                             "trainer.max_off_policy_steps=0 or actor_rollout_ref.rollout.enable_sleep_mode=false")


def build_workers(cfg: AgentTrainerConfig) -> Workers:
    """Start the actor, critic, reference and rollout groups and load their models.

    On GPU every FSDP rank takes one GPU and every engine ``tensor_model_parallel_size`` GPUs, or, with
    ``actor_rollout_ref.hybrid_engine``, engine i shares actor rank i's GPU (and bundle). The reference and the
    critic are colocated with the actor by default (``actor_rollout_ref.ref.colocate``, ``critic.colocate``).
    """
    cluster = ray.cluster_resources()
    device = resolve_device(cfg.trainer.device, cluster)
    check_device(cfg, device, cluster)
    check_placement(resource_demands(cfg, device), cluster)
    gpus = 1.0 if device == "cuda" else 0.0
    timeouts = {"placement_timeout_s": cfg.trainer.placement_timeout_s,
                "collective_timeout_s": cfg.trainer.collective_timeout_s}
    with ended_on_failure() as keep:
        return _start_workers(cfg, device, gpus, timeouts, keep)


def _start_workers(cfg: AgentTrainerConfig, device: str, gpus: float, timeouts: dict,
                   keep: Callable[[WorkerGroup], WorkerGroup]) -> Workers:
    """:func:`build_workers` once the cluster is checked: every group it starts passes through ``keep``."""
    arr = cfg.actor_rollout_ref
    colocate_ref = cfg.ref_enabled and arr.ref.colocate
    colocate_critic = core_algos.critic_enabled(cfg) and cfg.critic.colocate
    hybrid = arr.hybrid_engine
    # Colocated: each actor bundle also holds one engine's CPUs and its share of the GPU.
    actor_gpus = gpus * (1 - HYBRID_ENGINE_GPU_SHARE) if hybrid else gpus
    guest = ({"CPU": arr.rollout.num_cpus_per_worker, "GPU": gpus - actor_gpus} if hybrid else None)
    distill = cfg.algorithm.distill
    teacher = (distill.teacher_model(arr.model), distill.teacher_forward()) if distill.enable else None
    actor = keep(build_actor_group(cfg, device, arr.actor, cfg.trainer.seed, num_gpus_per_rank=actor_gpus,
                                   bundle_extra=guest, ref=arr.ref if colocate_ref else None,
                                   critic=cfg.critic if colocate_critic else None,
                                   teacher=teacher if distill.colocate else None))
    critic = actor if colocate_critic else None  # the actor's ranks answer compute_values and update_critic
    if core_algos.critic_enabled(cfg) and not colocate_critic:
        critic = keep(WorkerGroup(
            CriticWorker, name="critic", world_size=cfg.critic.fsdp.world_size,
            num_cpus_per_rank=cfg.critic.fsdp.num_cpus_per_rank, num_gpus_per_rank=gpus, distributed=True, **timeouts,
            init_kwargs={"critic": cfg.critic, "device": device, "seed": cfg.trainer.seed},
        ))
    ref = actor if colocate_ref else None  # the actor's ranks answer compute_ref_log_prob
    if cfg.ref_enabled and not colocate_ref:
        ref = keep(reference_group("ref", arr.model, arr.ref, device, gpus, cfg.trainer.seed, timeouts))
    if teacher is not None:  # the actor's ranks answer compute_teacher_log_prob when colocated
        teacher = actor if distill.colocate else keep(reference_group("teacher", *teacher, device, gpus,
                                                                      cfg.trainer.seed, timeouts))
    reward_model = None
    if cfg.reward_model.enable:
        from agent_trainer.workers.reward_model import RewardModelWorker

        rm = cfg.reward_model
        reward_model = keep(WorkerGroup(
            RewardModelWorker, name="reward_model", world_size=rm.world_size, num_cpus_per_rank=rm.num_cpus_per_rank,
            num_gpus_per_rank=gpus, distributed=True, **timeouts,
            init_kwargs={"reward_model": rm, "device": device, "seed": cfg.trainer.seed},
        ))
    engines = keep(build_engines(cfg, device, host=actor if hybrid else None))
    # Load every model at once: the groups' collectives are independent of each other.
    groups = [g for g in (actor, critic if critic is not actor else None, ref if ref is not actor else None,
                          reward_model, teacher if teacher is not actor else None) if g is not None]
    for group, refs in [(g, g.execute_all_async("init_model")) for g in groups]:
        group.get(refs)
    return Workers(actor=actor, sync_plan=sync_plan(cfg), critic=critic, ref=ref, engines=engines.workers,
                   engine_group=engines, env_worker_cls=env_actor_class(cfg), reward_model=reward_model,
                   teacher=teacher, device=device,
                   sleep_mode=device == "cuda" and sleep_mode_on(cfg, device),
                   actor_offload=device == "cuda" and actor_offloads(cfg))


def build_sft_workers(rl: AgentTrainerConfig, actor: ActorConfig, seed: int, *, engines: bool) -> Workers:
    """SFT's workers: the actor group of ``actor`` (the RL actor with SFT's optimizer), models loaded; with
    ``engines`` also the rollout engines and the env actor class of the validation rollout (``eval.env_success``)."""
    device = resolve_device(rl.trainer.device)
    with ended_on_failure() as keep:
        group = keep(build_actor_group(rl, device, actor, seed))
        group.execute_all("init_model")
        engine_group = keep(build_engines(rl, device)) if engines else None
    return Workers(actor=group, sync_plan=sync_plan(rl), engines=engine_group.workers if engine_group else [],
                   engine_group=engine_group, env_worker_cls=env_actor_class(rl) if engines else None, device=device)


@contextmanager
def ended_on_failure() -> Iterator[Callable[[WorkerGroup], WorkerGroup]]:
    """Yields ``keep``: every group passed to it is shut down (its actors killed, its placement group freed) when
    the block raises, so a build that fails halfway (a rank's ``init_model`` raising, a placement timing out)
    leaves nothing running in a cluster that lives on: a notebook's, or the test suite's shared one, where the
    next run would otherwise wait for the placement the dead build still holds."""
    built: list[WorkerGroup] = []

    def keep(group: WorkerGroup) -> WorkerGroup:
        built.append(group)
        return group

    try:
        yield keep
    except BaseException:
        for group in reversed(built):
            try:
                group.shutdown()
            except Exception as err:  # noqa: BLE001 - the build's own error is the one to raise
                logger.warning("could not shut down the %s group after a failed start: %s", group.name, err)
        raise


def reference_group(name: str, model: ModelConfig, ref: RefConfig, device: str, gpus: float, seed: int,
                    timeouts: dict) -> WorkerGroup:
    """A frozen causal LM in a group of its own (``ReferenceWorker``: ``compute_ref_log_prob``, no optimizer):
    the reference (``actor_rollout_ref.ref.colocate=false``) or the distillation teacher (``algorithm.distill``),
    ``ref.fsdp.world_size`` ranks of ``gpus`` GPUs each, ``model.path``'s weights in ``ref.dtype``."""
    return WorkerGroup(ReferenceWorker, name=name, world_size=ref.fsdp.world_size,
                       num_cpus_per_rank=ref.fsdp.num_cpus_per_rank, num_gpus_per_rank=gpus, distributed=True,
                       **timeouts, init_kwargs={"model": model, "ref": ref, "device": device, "seed": seed})


ENV_ACTOR_MAX_RESTARTS = 3
"""Ray restarts a crashed env actor this many times; the rollout reports the failure and resets the actor."""


def env_actor_class(cfg: AgentTrainerConfig):
    """The Ray actor class hosting an ``EnvStateManager``, the one RL, SFT and evaluation use: its CPU share
    (``agent_proxy.num_cpus_per_env_actor``) and its restarts. The rollout names each actor (``env_train_0``,
    ``env_val_0``, ...) with ``.options(name=...)``."""
    return ray.remote(num_cpus=cfg.agent_proxy.num_cpus_per_env_actor,
                      max_restarts=ENV_ACTOR_MAX_RESTARTS)(EnvStateManager)


def build_actor_group(cfg: AgentTrainerConfig, device: str, actor: ActorConfig, seed: int, *,
                      num_gpus_per_rank: float | None = None, bundle_extra: dict | None = None,
                      ref: RefConfig | None = None, critic: CriticConfig | None = None,
                      teacher: tuple[ModelConfig, RefConfig] | None = None) -> WorkerGroup:
    """The FSDP actor group of RL and SFT: ``actor.fsdp.world_size`` ranks on ``device`` (one GPU each unless
    ``num_gpus_per_rank``), the model of ``cfg``, the trainer's placement and collective timeouts. ``bundle_extra``:
    what each rank's bundle also holds for a colocated engine; ``ref`` / ``critic`` / ``teacher`` (the distillation
    teacher's model section and forward settings): hosted by the same ranks."""
    return WorkerGroup(
        ActorWorker, name="actor", world_size=actor.fsdp.world_size, num_cpus_per_rank=actor.fsdp.num_cpus_per_rank,
        num_gpus_per_rank=(1.0 if device == "cuda" else 0.0) if num_gpus_per_rank is None else num_gpus_per_rank,
        bundle_extra=bundle_extra, distributed=True, placement_timeout_s=cfg.trainer.placement_timeout_s,
        collective_timeout_s=cfg.trainer.collective_timeout_s,
        init_kwargs={"model": cfg.actor_rollout_ref.model, "actor": actor, "device": device, "seed": seed,
                     "ref": ref, "critic": critic, "teacher": teacher},
    )


def build_engines(cfg: AgentTrainerConfig, device: str, host: WorkerGroup | None = None) -> WorkerGroup:
    """The rollout engines of ``actor_rollout_ref.rollout.name`` (the engine registry, ``checks.engines``: vLLM,
    HF generate, or a user's engine class) on ``device`` (resolved); the class gives its constructor's arguments.

    ``host``: the actor group whose bundles the engines share (``actor_rollout_ref.hybrid_engine``; engine i in
    rank i's bundle, with half its GPU), else the engines get a placement group of their own, one bundle of
    ``tensor_model_parallel_size`` GPUs per engine (vLLM's ``mp`` executor runs the TP workers inside it).
    """
    r = cfg.actor_rollout_ref.rollout
    worker_cls = engine_class(r.name)  # the registry (checks.engines): a registered name or an import path
    kwargs = worker_cls.init_kwargs(cfg, device=device,
                                    enable_sleep_mode=device == "cuda" and sleep_mode_on(cfg, device))
    return WorkerGroup(
        worker_cls, name="rollout", world_size=r.num_workers, num_cpus_per_rank=r.num_cpus_per_worker,
        num_gpus_per_rank=engine_gpus(cfg, device, colocated=host is not None), host=host,
        # A crashed engine is restarted by Ray; the rollout re-syncs its weights and retries the turn.
        pass_rank=False, init_kwargs=kwargs, max_restarts=2, placement_timeout_s=cfg.trainer.placement_timeout_s,
        env_vars=engine_env_vars(cfg, device),
    )


def actor_offloads(cfg: AgentTrainerConfig) -> bool:
    """The actor gives its GPU memory to the engines during rollouts (``actor.fsdp.param_offload`` /
    ``optimizer_offload``)."""
    fsdp = cfg.actor_rollout_ref.actor.fsdp
    return bool(getattr(fsdp, "param_offload", False) or getattr(fsdp, "optimizer_offload", False))


def engine_gpus(cfg: AgentTrainerConfig, device: str, colocated: bool) -> float:
    """Ray's GPUs for one engine actor: its share of the actor rank's GPU when colocated, else its TP GPUs."""
    if device != "cuda":
        return 0.0
    return HYBRID_ENGINE_GPU_SHARE if colocated else float(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)


def engine_env_vars(cfg: AgentTrainerConfig, device: str) -> dict[str, str]:
    """The engine processes' environment: their threads, and on CPU
    ``agent_trainer.workers.engines.vllm.CPU_ENGINE_ENV`` (in-process vLLM, no thread pinning), where a value set in the
    driver's environment wins. GPU engines keep vLLM's defaults."""
    from agent_trainer.workers.engines.vllm import CPU_ENGINE_ENV

    env = {"OMP_NUM_THREADS": str(engine_threads(cfg))}
    if device == "cpu":
        env.update({key: os.environ.get(key, value) for key, value in CPU_ENGINE_ENV.items()})
    return env


AUTO_ENGINE_THREADS_MIN_PARAMETERS = 4_000_000
"""``rollout.num_threads: 0`` gives an engine 2 threads from this many parameters on (docs/benchmarks.md)."""


def engine_threads(cfg: AgentTrainerConfig) -> int:
    """Intra-op threads of each engine process (``actor_rollout_ref.rollout.num_threads``; 0 = auto).

    Auto: 2 when one engine generates while the trainer's ranks wait (``num_workers`` 1, no overlap of
    rollout and training) and the model holds at least :data:`AUTO_ENGINE_THREADS_MIN_PARAMETERS`
    parameters (a local safetensors checkpoint); else 1. On 2 cores a 19M model's generation ran 1.5x faster
    on 2 threads and the 0.6M tiny model's 0.9x.
    """
    from agent_trainer.workers.engines.base import checkpoint_parameters

    r = cfg.actor_rollout_ref.rollout
    if r.num_threads:
        return r.num_threads
    alone = r.num_workers == 1 and cfg.trainer.max_off_policy_steps == 0
    params = checkpoint_parameters(cfg.actor_rollout_ref.model.path) if alone else None
    return 2 if params is not None and params >= AUTO_ENGINE_THREADS_MIN_PARAMETERS else 1


@dataclass
class Demand:
    """What one kind of worker asks Ray for: ``count`` actors of ``cpus`` CPUs and ``gpus`` GPUs each."""

    what: str
    count: int
    cpus: float
    gpus: float = 0.0


def resource_demands(cfg: AgentTrainerConfig, device: str) -> list[Demand]:
    """Every worker the run starts: FSDP groups and engines (placement groups) and the env actors (plain actors).

    Env actors: one per ``agent_proxy.num_env_actors`` for each split, at most one per env group
    (``SyncMultiTurnRollout`` shards whole groups), for each split the run plays (``trainer_splits``: train, val
    when it validates, ReMax's baseline split).
    """
    gpus = 1.0 if device == "cuda" else 0.0
    arr, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    if arr.hybrid_engine:  # every actor bundle also reserves one engine's CPUs (and shares its GPU with it)
        demands = [Demand("actor+rollout", arr.actor.fsdp.world_size,
                          arr.actor.fsdp.num_cpus_per_rank + r.num_cpus_per_worker, gpus)]
    else:
        demands = [Demand("actor", arr.actor.fsdp.world_size, arr.actor.fsdp.num_cpus_per_rank, gpus)]
    if core_algos.critic_enabled(cfg) and not cfg.critic.colocate:
        demands.append(Demand("critic", cfg.critic.fsdp.world_size, cfg.critic.fsdp.num_cpus_per_rank, gpus))
    if cfg.ref_enabled and not arr.ref.colocate:
        demands.append(Demand("ref", arr.ref.fsdp.world_size, arr.ref.fsdp.num_cpus_per_rank, gpus))
    if cfg.algorithm.distill.enable and not cfg.algorithm.distill.colocate:
        fsdp = cfg.algorithm.distill.fsdp
        demands.append(Demand("teacher", fsdp.world_size, fsdp.num_cpus_per_rank, gpus))
    if cfg.reward_model.enable:
        demands.append(Demand("reward_model", cfg.reward_model.world_size, cfg.reward_model.num_cpus_per_rank, gpus))
    if not arr.hybrid_engine:
        demands.append(Demand("rollout", r.num_workers, r.num_cpus_per_worker, engine_gpus(cfg, device, False)))
    for split in core_algos.trainer_splits(cfg):
        actors = min(max(1, cfg.agent_proxy.num_env_actors), split_config(cfg, split).env_groups)
        actors *= rollouts_in_flight(cfg) if split == Split.TRAIN else 1  # each rollout in flight has its own
        demands.append(Demand(f"env_{split}", actors, cfg.agent_proxy.num_cpus_per_env_actor))
    return demands


def check_placement(demands: list[Demand], cluster: dict[str, float]) -> None:
    """Refuse, in one line, a run whose workers need more CPUs or GPUs than the Ray cluster has.

    Without it Ray waits forever: the placement groups take their CPUs first and env actors
    (plain actors) are never placed, so the first rollout never returns.
    """
    for resource, per in (("CPU", lambda d: d.cpus), ("GPU", lambda d: d.gpus)):
        need = sum(d.count * per(d) for d in demands)
        have = cluster.get(resource, 0.0)
        if need > have + 1e-9:
            parts = ", ".join(f"{d.what} {d.count} x {per(d):g}" for d in demands if per(d))
            raise PlacementError(
                f"the workers need {need:g} {resource} but the Ray cluster has {have:g} ({parts}); lower world sizes, "
                "actor_rollout_ref.rollout.num_workers, agent_proxy.num_env_actors or the num_cpus_per_* keys, "
                f"or give Ray more {resource}s (trainer.ray_num_cpus for a local run)")
