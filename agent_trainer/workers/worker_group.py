"""Ray worker groups: N rank processes of one worker class on a placement group.

A method is called on a group in one of two visible ways (verl's ONE_TO_ALL
and DP_COMPUTE_PROTO dispatch, written out instead of hidden in decorators):

* ``group.execute_all("init_model")``: every rank, same arguments, all called
  concurrently (FSDP collectives deadlock if ranks are called one by one);
  returns the list of per-rank results.
* ``group.dp_compute("compute_log_prob", batch)``: the batch is padded to a
  multiple of the world size, split into equal shards (one per rank, so every
  rank runs the same number of micro-batches and collectives line up), and the
  shards' results are concatenated in order, padding removed.

Methods whose names end in ``_async`` return Ray object refs instead of values.

A group may be called from two driver threads (the rollout prefetch thread re-syncs a restarted
engine while the main thread trains, ``agent_trainer.rollout.overlap``): each call is submitted to all ranks
under one lock, so every rank sees the threads' calls in the same order and collectives line up.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agent_trainer.common.batch import TensorBatch


DEATH_REPORT_GRACE_S = 15.0
"""How long a rank's failed call waits for Ray to report a dead peer (the likely cause) before it propagates."""


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls``, one per placement-group bundle.

    ``worker_cls`` is a plain class whose constructor takes ``rank`` and
    ``world_size`` keyword arguments (unless ``pass_rank=False``) plus
    ``init_kwargs``; ``ray.remote`` is applied here. ``max_restarts`` lets Ray
    restart a crashed rank (for stateless-between-calls workers such as engines).
    With ``distributed=True`` the group also starts a ``torch.distributed`` process
    group (gloo on CPU, NCCL on GPU) by calling each rank's
    ``init_distributed(master_addr, master_port, backend)``.

    Every rank is a named actor in the driver's Ray namespace (one per run, see
    ``agent_trainer.ray_cluster.init_ray``), so the dashboard's Actors page and
    ``ray list actors`` tell them apart: ``<name>_rank<i>`` for ranks, ``<name>_<i>``
    for independent replicas (``pass_rank=False``, e.g. ``rollout_0``). A rank Ray
    restarts keeps its name.

    Colocation (``actor_rollout_ref.hybrid_engine``): a host group reserves ``bundle_extra`` in each of its
    bundles beyond what its own rank takes, and a guest group built with ``host=<that group>`` places rank i
    in the host's bundle i instead of a placement group of its own (Ray then accounts the bundle's CPUs and
    GPU between the two processes, e.g. half a GPU each). The host owns the placement group: removing it
    (its :meth:`shutdown`) ends the guests too.

    Every wait on the ranks goes through :meth:`get`: a rank that dies mid-call raises
    :class:`WorkerDied` naming the group, the rank and Ray's death cause as soon as Ray
    notices, instead of leaving the driver in ``ray.get`` while its peers wait in a collective.
    """

    def __init__(
        self,
        worker_cls: type,
        *,
        name: str,
        world_size: int,
        num_cpus_per_rank: float,
        num_gpus_per_rank: float = 0.0,
        init_kwargs: dict[str, Any] | None = None,
        distributed: bool = False,
        pass_rank: bool = True,
        max_restarts: int = 0,
        env_vars: dict[str, str] | None = None,
        placement_timeout_s: float = 120.0,
        collective_timeout_s: float = 600.0,
        bundle_extra: dict[str, float] | None = None,
        host: WorkerGroup | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"{name}: world_size must be >= 1, got {world_size}")
        self.name = name
        self.world_size = world_size
        self._submit_lock = threading.Lock()
        self.owns_placement_group = host is None
        """False for a guest group (``host``): the host's shutdown removes the placement group."""
        if host is not None:
            if world_size > host.world_size:
                raise ValueError(f"{name}: {world_size} ranks cannot be placed in the {host.world_size} bundles "
                                 f"of {host.name}")
            if bundle_extra:
                raise ValueError(f"{name}: bundle_extra is for a group that owns its placement group, not a guest")
            self._pg: PlacementGroup = host.placement_group
        else:
            bundle = bundle_resources(num_cpus_per_rank, num_gpus_per_rank, bundle_extra)
            self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            try:
                ray.get(self._pg.ready(), timeout=placement_timeout_s)
            except GetTimeoutError:
                remove_placement_group(self._pg)
                raise PlacementError(
                    f"the placement group of {name} ({world_size} x {bundle}) was not placed within "
                    f"trainer.placement_timeout_s = {placement_timeout_s:g} s; the cluster has "
                    f"{_resources(ray.cluster_resources())}, free now {_resources(ray.available_resources())}; lower "
                    "the group's world_size or num_cpus_per_*, or give Ray more (trainer.ray_num_cpus, more nodes)"
                ) from None
        remote_cls = ray.remote(worker_cls)
        runtime_env = {"env_vars": {**_default_env_vars(), **(env_vars or {})}}
        self.workers = [
            remote_cls.options(
                name=actor_name(name, rank, pass_rank),
                num_cpus=num_cpus_per_rank,
                num_gpus=num_gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                runtime_env=runtime_env,
                max_restarts=max_restarts,
            ).remote(**({"rank": rank, "world_size": world_size} if pass_rank else {}), **(init_kwargs or {}))
            for rank in range(world_size)
        ]
        if distributed:
            addr, port = ray.get(self.workers[0].rendezvous_address.remote())
            backend = "nccl" if num_gpus_per_rank else "gloo"
            self.execute_all("init_distributed", addr, port, backend, timeout_s=collective_timeout_s)

    @property
    def placement_group(self) -> PlacementGroup:
        """The placement group the ranks run in (rank i in bundle i); a guest's is its host's."""
        return self._pg

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method`` on every rank with the same arguments; return the refs."""
        return self._submit(method, [(args, kwargs)] * len(self.workers))

    def _submit(self, method: str, calls: list[tuple[tuple, dict]]) -> list[ray.ObjectRef]:
        """One call per rank, ``calls[i]`` = rank i's (args, kwargs), submitted together (module docstring)."""
        with self._submit_lock:
            return [getattr(w, method).remote(*a, **kw) for w, (a, kw) in zip(self.workers, calls)]

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank with the same arguments; wait for all results."""
        return self.get(self.execute_all_async(method, *args, **kwargs))

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on rank 0 only (must not involve collectives)."""
        with self._submit_lock:
            ref = getattr(self.workers[0], method).remote(*args, **kwargs)
        return self.get([ref])[0]

    def dp_compute(self, method: str, batch: TensorBatch, **kwargs: Any) -> TensorBatch:
        """Split ``batch`` across ranks, run ``method`` on each shard, concatenate in order."""
        shards, pad = split_for_ranks(batch, self.world_size)
        results = self.get(self._submit(method, [((s,), kwargs) for s in shards]))
        merged = TensorBatch.concat(results)
        return merged.index(torch.arange(len(merged) - pad)) if pad else merged

    def dp_execute(self, method: str, batch: TensorBatch, **kwargs: Any) -> list[Any]:
        """Split ``batch`` across ranks and return each rank's (non-batch) result, e.g. metrics."""
        shards, _ = split_for_ranks(batch, self.world_size)
        return self.get(self._submit(method, [((s,), kwargs) for s in shards]))

    def get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """``ray.get`` of one ref per rank (in rank order), failing fast when a rank dies.

        Waits with ``ray.wait``, so the first rank whose call errors is seen at once even while
        the others block in a collective with it; a dead rank raises :class:`WorkerDied`.
        """
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except RayActorError as err:
                raise WorkerDied(self.name, refs.index(ready[0]), err) from None
            except RayTaskError:
                # A surviving rank's collective fails as soon as a peer dies (gloo: "connection closed
                # by peer"), often before Ray reports the death: name the dead rank if there is one.
                dead = self._dead_rank(refs, pending)
                if dead is not None:
                    raise dead from None
                raise
        return ray.get(list(refs))

    def _dead_rank(self, refs: list[ray.ObjectRef], pending: list[ray.ObjectRef],
                   grace_s: float = DEATH_REPORT_GRACE_S) -> WorkerDied | None:
        """The :class:`WorkerDied` of a rank among ``pending`` that Ray reports dead within ``grace_s``."""
        deadline = time.monotonic() + grace_s
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as err:
                    return WorkerDied(self.name, refs.index(ref), err)
                except RayTaskError:
                    pass
        return None

    def shutdown(self) -> None:
        """Kill the actors (at once, even mid-collective) and free the placement group (when it is this group's)."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self.owns_placement_group:
            remove_placement_group(self._pg)


class PlacementError(RuntimeError):
    """Ray cannot place what the run asks for (checked up front, and by ``trainer.placement_timeout_s``)."""


class WorkerDied(RuntimeError):
    """A rank of a worker group died; names the group, the rank and Ray's death cause."""

    def __init__(self, group: str, rank: int, err: BaseException):
        self.group, self.rank = group, rank
        super().__init__(f"{group} rank {rank} (Ray actor {actor_name(group, rank)}) died: {death_cause(err)}")


def wait_until_ready(actors: list, timeout_s: float = 600.0) -> None:
    """Block until every actor answers (a restarting actor raises ActorUnavailableError until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get([a.__ray_ready__.remote() for a in actors])
            return
        except (ActorUnavailableError, RayActorError):  # restarting (a killed actor may still be dying)
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def death_cause(err: BaseException, limit: int = 600) -> str:
    """Ray's death cause of an actor error on one line, cut after its last whole sentence within ``limit``."""
    text = " ".join(str(err).split())
    if len(text) <= limit:
        return text
    cut = text.rfind(". ", 0, limit)
    return text[:cut + 1] if cut > 0 else text[:limit]


def bundle_resources(num_cpus: float, num_gpus: float = 0.0, extra: dict[str, float] | None = None) -> dict[str, float]:
    """One rank's placement-group bundle: its own CPUs and GPUs plus ``extra`` reserved for a guest rank."""
    bundle: dict[str, float] = {}
    for key, value in [("CPU", num_cpus), ("GPU", num_gpus), *(extra or {}).items()]:
        bundle[key] = bundle.get(key, 0.0) + value
    return {k: v for k, v in bundle.items() if v or k == "CPU"}


def _resources(res: dict[str, float]) -> str:
    """``{"CPU": 2.0}`` as ``2 CPU, 0 GPU``."""
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in ("CPU", "GPU"))


def actor_name(group: str, index: int, ranked: bool = True) -> str:
    """The Ray actor name of a group member: ``actor_rank0`` for ranks, ``rollout_0`` for replicas."""
    return f"{group}_rank{index}" if ranked else f"{group}_{index}"


def split_for_ranks(batch: TensorBatch, world_size: int) -> tuple[list[TensorBatch], int]:
    """Pad ``batch`` (repeating its first rows) to a multiple of ``world_size`` and split it evenly.

    Returns the shards and the number of padding rows appended. Padding rows
    are real data, so forward passes stay well-defined; callers drop their
    outputs (``dp_compute``). Updates arrive already padded to whole
    mini-batches (``trainer.pad_for_update``), so they never see this padding.
    """
    if len(batch) == 0:
        raise ValueError("cannot split an empty batch across ranks")
    batch, pad = batch.pad_to_multiple(world_size)
    return batch.chunk(world_size), pad


def _default_env_vars() -> dict[str, str]:
    """Environment for every worker process: one torch thread unless told otherwise."""
    return {
        "OMP_NUM_THREADS": os.environ.get("AGENT_TRAINER_WORKER_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        # Keep worker logs readable: no per-rank weight-loading bars or load reports.
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONWARNINGS": "ignore::UserWarning",
    }
