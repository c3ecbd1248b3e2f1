"""Weight sync: the actor's weights into the rollout engines, one bucket at a time.

The actor side and the driver's call; the other parts live beside it (docs/architecture.md, "Weight sync"):

- here, the actor side (:func:`iter_weight_buckets`, :func:`push_weights`): every FSDP rank walks the model's
  FSDP units in step, all-gathering one unit at a time (FSDP2's ``unshard``, one collective per unit, as in
  forward); rank 0 casts each unique parameter to the engine's dtype and packs it into a flat byte buffer of
  at most ``actor_rollout_ref.rollout.update_weights_bucket_megabytes`` (``agent_trainer.workers.weight_buckets``), and hands
  each full bucket to a transport before the next one is packed. Peak transient memory: one FSDP unit's full
  parameters plus one bucket, not the model.
- the transports (``agent_trainer.workers.sync_transports``: ``object_store``, ``collective``, ``cuda_ipc``), sent from rank 0
  and received by the engines.
- the engine side (:class:`agent_trainer.workers.engines.base.RolloutEngine`, the base of every rollout engine): a sync is a
  session (``begin_weight_sync``, buckets, ``finish_weight_sync``); the vLLM engine forwards every call by name
  to its workers (``agent_trainer.workers.vllm_ext.RolloutWorkerExtension``).

:func:`sync_weights` is the driver's call, shared by RL (``AgentTrainer``) and SFT (``SFTTrainer``): one sync,
and on an engine failure a wait for Ray's restart and one more sync.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from agent_trainer.workers.sync_transports import EngineFailed, _get, _Sender, make_sender, resolve_transport
from agent_trainer.workers.weight_buckets import DTYPE_NAMES, Bucket, _aligned, _Packer

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the actor side


def sync_tensor_names(model: torch.nn.Module) -> list[str]:
    """What a sync sends, in state-dict order: each parameter once (a tied alias such as ``lm_head.weight``
    is left to the engine, as it ties it itself) and every persistent buffer. With a LoRA adapter
    (``agent_trainer/workers/lora.py``) the names are the plain model's: the adapter's own parameters are left out (they are
    merged into their base weight) and ``.base_layer`` is dropped (:func:`sync_sources`)."""
    return list(sync_sources(model))


def sync_sources(model: torch.nn.Module) -> dict[str, str]:
    """{name the engine gets: the model's own name} in state-dict order (:func:`sync_tensor_names`); the two differ
    only for a LoRA model's adapted weights (``q_proj.weight`` <- ``q_proj.base_layer.weight``)."""
    from agent_trainer.workers.lora import is_adapter_tensor, sync_name

    params = {name for name, _ in model.named_parameters()}  # remove_duplicate: a tied alias is named once
    buffers = {name for name, _ in model.named_buffers()}
    return {sync_name(name): name for name in model.state_dict()
            if (name in params or name in buffers) and not is_adapter_tensor(name)}


def iter_weight_buckets(model: torch.nn.Module, keep: bool, bucket_bytes: int, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> Iterator[Bucket]:
    """Buckets of the model's weights, cast to ``dtype`` (None: as they are), on ``device`` (None: the
    parameters' own device); yields only where ``keep`` (rank 0), but every rank of an FSDP2 model must
    iterate it to the end, in step: each FSDP unit is all-gathered (``unshard``, a collective) while its
    parameters are packed, then resharded.

    Each bucket holds at most ``bucket_bytes`` (16-byte-aligned tensors), or one tensor larger than that
    alone. The flat buffer is reused: use (send) each bucket before asking for the next.
    Peak: one unit's full parameters plus one bucket.

    A LoRA model (``agent_trainer/workers/lora.py``) sends the plain model's names and shapes: each adapted weight merged,
    ``W + (alpha / r) B A`` (:func:`agent_trainer.workers.lora.merged_weight`; its adapter is in its FSDP unit, gathered with it).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from agent_trainer.workers.lora import adapted_module_name, merged_weight

    sources = sync_sources(model)
    wanted = list(sources)
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    metas = {name: own[source] for name, source in sources.items()}
    adapted = {name: model.get_submodule(module) for name, source in sources.items()
               if (module := adapted_module_name(source)) is not None}
    send_name = {source: name for name, source in sources.items()}
    out_dtype = {n: dtype if dtype is not None and metas[n].is_floating_point() else metas[n].dtype for n in wanted}
    total = sum(_aligned(math.prod(metas[n].shape) * out_dtype[n].itemsize) for n in wanted)
    first = next(iter(metas.values()), None)
    target = torch.device(device) if device is not None else (
        first.device if first is not None and not isinstance(first, DTensor) else
        (first.to_local().device if first is not None else torch.device("cpu")))
    packer = _Packer(bucket_bytes, total, target)
    order = {name: i for i, name in enumerate(wanted)}
    done: set[str] = set()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] or [None]
    for unit in units:
        if unit is not None:
            unit.unshard()
        try:
            if keep:
                ready = [(send_name[n], p) for n, p in model.named_parameters()
                         if n in send_name and send_name[n] not in done and not isinstance(p, DTensor)]
                for name, param in sorted(ready, key=lambda item: order[item[0]]):
                    if name in adapted:
                        param = merged_weight(adapted[name], param)
                    nbytes = _aligned(param.numel() * out_dtype[name].itemsize)
                    if packer.full_for(nbytes):
                        yield packer.take()
                    packer.add(name, param, out_dtype[name])
                    done.add(name)
        finally:
            if unit is not None:
                unit.reshard()
    if not keep:
        return
    buffers = dict(model.named_buffers())
    for name in wanted:
        if name not in done and sources[name] in buffers:
            value = buffers[sources[name]]
            if packer.full_for(_aligned(value.numel() * out_dtype[name].itemsize)):
                yield packer.take()
            packer.add(name, value, out_dtype[name])
            done.add(name)
    missing = [n for n in wanted if n not in done]
    assert not missing, f"weights never gathered: {missing[:4]}"  # internal: every unit was walked
    if packer.specs:
        yield packer.take()


@dataclass
class SyncStats:
    """What one sync moved (rank 0's view)."""

    transport: str
    buckets: int = 0
    bytes: int = 0
    max_transfer_bytes: int = 0
    """The largest single transfer (one bucket): the sync's transient memory beyond one FSDP unit."""
    reload_s: float = 0.0
    """Engine 0's seconds inside its loads (what ``sync_weights`` returns)."""
    group_setup_s: float = 0.0
    """Seconds spent building the weight-transfer group this sync (collective only; 0 when reused)."""
    error: str | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SyncPlan:
    """What the driver tells every actor rank about one sync."""

    weight_sync: str = "auto"
    bucket_megabytes: float = 256.0
    colocated: bool = False
    timeout_s: float = 600.0
    tag: str = ""
    """Names the weights one sync brings (:meth:`RolloutEngine.weights_tag`); :func:`sync_weights` sets a fresh one."""


def push_weights(model: torch.nn.Module, rank: int, plan: SyncPlan, engines: list | None, state: dict) -> dict:
    """One rank's part of a sync (every rank calls it concurrently; rank 0 sends).

    Rank 0 asks the engines their dtype and device, picks the transport, and sends bucket by bucket. An engine
    failure does not stop the walk over the FSDP units (the other ranks are in its collectives): rank 0 stops
    sending, finishes the walk and returns the error in the stats (``error``); the driver then waits for Ray's
    restart and syncs again. Non-zero ranks return ``{}``.
    """
    sender: _Sender | None = None
    stats = SyncStats(transport="")
    fatal: BaseException | None = None  # not an engine failure: raised once every rank has finished its walk
    dtype = None
    if rank == 0:
        try:
            info = _get([e.weight_sync_info.remote() for e in engines], "weight_sync_info")
            dtypes = {i["dtype"] for i in info}
            if len(dtypes) != 1:
                raise ValueError(f"the rollout engines run different dtypes {sorted(dtypes)}")
            dtype = DTYPE_NAMES[dtypes.pop()]
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            transport = resolve_transport(plan.weight_sync, info[0]["device"], plan.colocated, len(engines))
            stats.transport = transport
            sender = make_sender(transport, engines, state, device, info[0]["device"], plan.timeout_s)
            sender.begin(info, plan.tag)
            stats.group_setup_s = getattr(sender, "setup_s", 0.0)
        except Exception as err:  # noqa: BLE001 - recorded, then raised after the walk (the ranks are in step)
            stats.error, fatal = str(err), (None if isinstance(err, EngineFailed) else err)
            if sender is not None:
                sender.abort()
            sender = None
    keep = rank == 0 and sender is not None
    limit = max(1, int(plan.bucket_megabytes * 2**20))
    for bucket in iter_weight_buckets(model, keep, limit, dtype,
                                      device=sender.device if sender is not None else None):
        if stats.error is not None:
            continue  # drain: the other ranks still all-gather unit by unit
        try:
            sender.send(bucket)
        except Exception as err:  # noqa: BLE001 - as above
            stats.error, fatal = str(err), (None if isinstance(err, EngineFailed) else err)
            sender.abort()
            continue
        stats.buckets += 1
        stats.bytes += bucket.nbytes
        stats.max_transfer_bytes = max(stats.max_transfer_bytes, bucket.nbytes)
    if rank != 0:
        return {}
    if sender is not None and stats.error is None:
        try:
            stats.reload_s = sender.finish()
        except Exception as err:  # noqa: BLE001
            stats.error, fatal = str(err), (None if isinstance(err, EngineFailed) else err)
            sender.abort()
    if fatal is not None:
        raise fatal
    return stats.as_dict()


# --------------------------------------------------------------------------- the driver's call


def sync_plan(cfg) -> SyncPlan:
    """The plan from a trainer config (keys read defensively: older configs lack them)."""
    arr = cfg.actor_rollout_ref
    r = arr.rollout
    return SyncPlan(weight_sync=getattr(r, "weight_sync", "auto"),
                    bucket_megabytes=float(getattr(r, "update_weights_bucket_megabytes", 256)),
                    colocated=bool(getattr(arr, "hybrid_engine", False)),
                    timeout_s=float(cfg.trainer.collective_timeout_s))


def sync_weights(actor_wg, engines: list, plan: SyncPlan, on_stats: Callable[[dict], None] | None = None) -> float:
    """Ship the actor's weights to every engine, bucket by bucket; returns engine 0's reload seconds.

    Every actor rank takes part (FSDP's per-unit all-gathers); rank 0 sends. An engine that dies while
    loading (or is found dead) is restarted by Ray from the checkpoint on disk: the sync waits for it and
    sends the weights once more (a restarted engine joins a fresh weight-transfer group); a second failure
    raises with Ray's error. ``on_stats`` gets rank 0's :class:`SyncStats` of the sync that succeeded.
    """
    from agent_trainer.workers.worker_group import wait_until_ready

    plan = dataclasses.replace(plan, tag=uuid.uuid4().hex)
    stats = _sync_once(actor_wg, engines, plan)
    if stats.get("error") is not None:
        logger.error("rollout engine failed during weight sync (%s); waiting for its restart to resend",
                     stats["error"])
        wait_until_ready(engines)
        stats = _sync_once(actor_wg, engines, plan)
        if stats.get("error") is not None:
            raise RuntimeError(f"a rollout engine failed twice while loading the actor's weights ({stats['error']}); "
                               "see its log above (Ray restarts an engine at most twice)")
    note_synced(engines, plan.tag)
    if on_stats is not None:
        on_stats(stats)
    return float(stats["reload_s"])


_SYNCED_TAGS: dict[str, str] = {}
"""Engine actor id -> the tag of the last sync this process finished on it."""


def note_synced(engines: list, tag: str) -> None:
    """Record that every engine finished the sync named ``tag`` (:func:`sync_weights` calls it)."""
    for engine in engines:
        _SYNCED_TAGS[engine._actor_id.hex()] = tag


def synced_tag(engine) -> str | None:
    """The tag of the last sync :func:`sync_weights` finished on ``engine`` in this process (None: none yet, the
    engine holds the weights it started from, which is the policy)."""
    return _SYNCED_TAGS.get(engine._actor_id.hex())


def _sync_once(actor_wg, engines: list, plan: SyncPlan) -> dict:
    refs = actor_wg.execute_all_async("push_weights", plan, engines)
    return actor_wg.get(refs)[0]
