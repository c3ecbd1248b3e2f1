"""Weight sync: the actor's weights into the rollout engines, one bucket at a time.

Three parts, one module (docs/architecture.md, "Weight sync"):

- The actor side (:func:`iter_weight_buckets`, :func:`push_weights`): every FSDP rank walks the model's
  FSDP units in step, all-gathering one unit at a time (FSDP2's ``unshard``, one collective per unit, as in
  forward); rank 0 casts each unique parameter to the engine's dtype and packs it into a flat byte buffer of
  at most ``actor_rollout_ref.rollout.update_weights_bucket_megabytes``, and hands each full bucket to a
  transport before the next one is packed. Peak transient memory: one FSDP unit's full parameters plus one
  bucket, not the model.
- The transports (:class:`ObjectStoreSender`, :class:`CollectiveSender`, :class:`CudaIpcSender`), run on rank 0:
  ``object_store`` puts each bucket into Ray's object store once and every engine loads it;
  ``collective`` broadcasts it in a weight-transfer process group of rank 0 and every engine worker (gloo on
  CPU, NCCL on GPU; a group built from its own TCPStore, not the default process group); ``cuda_ipc`` (engines
  on the actor's GPUs) sends CUDA IPC handles of the bucket, which the engine maps without a copy.
- The engine side (:class:`agent_trainer.workers.engines.base.RolloutEngine`, the base of every rollout engine): a sync
  is a session (``begin_weight_sync``, buckets, ``finish_weight_sync``); the vLLM engine forwards every call by name
  to its workers (``agent_trainer.workers.vllm_ext.RolloutWorkerExtension``). The helpers it uses live here.

:func:`sync_weights` is the driver's call, shared by RL (``AgentTrainer``) and SFT (``SFTTrainer``): one sync,
and on an engine failure a wait for Ray's restart and one more sync.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "object_store", "collective", "cuda_ipc")
"""``actor_rollout_ref.rollout.weight_sync`` values."""

ALIGN = 16
"""Byte alignment of every tensor in a bucket's flat buffer (any dtype's view of it is then aligned)."""

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
               "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (bucket specs carry names: msgpack and Ray both encode strings)."""
    return str(dtype).removeprefix("torch.")


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


# --------------------------------------------------------------------------- buckets


@dataclass
class Bucket:
    """One transfer: tensors packed into ``flat`` (uint8) at 16-byte-aligned offsets.

    ``specs[i] = [name, dtype name, shape, byte offset, bytes]``; plain lists, so they pass through Ray and
    vLLM's msgpack encoder as they are.
    """

    specs: list[list]
    flat: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel())

    @property
    def names(self) -> list[str]:
        return [s[0] for s in self.specs]


def unpack_bucket(specs: Sequence[Sequence], flat: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
    """The named tensors of a bucket: views into ``flat`` (no copy)."""
    names, tensors = [], []
    for name, dtype, shape, offset, nbytes in specs:
        names.append(name)
        tensors.append(flat[offset:offset + nbytes].view(DTYPE_NAMES[dtype]).view(tuple(shape)))
    return names, tensors


def bucket_nbytes(specs: Sequence[Sequence]) -> int:
    """Bytes of the flat buffer that holds ``specs`` (the last tensor's end)."""
    return max((int(s[3]) + int(s[4]) for s in specs), default=0)


class _Packer:
    """Fills one reusable flat buffer; a tensor that does not fit closes the bucket first."""

    def __init__(self, limit: int, total: int, device: torch.device):
        self.limit, self.remaining, self.device = limit, total, device
        self.buffer: torch.Tensor | None = None
        self.specs: list[list] = []
        self.used = 0

    def full_for(self, nbytes: int) -> bool:
        return bool(self.specs) and self.used + nbytes > self.limit

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        nbytes = tensor.numel() * dtype.itemsize
        size = _aligned(nbytes)
        if self.buffer is None or self.used + size > self.buffer.numel():
            assert not self.specs  # internal: full_for closed the bucket before a tensor that does not fit
            # At most the limit (or one tensor larger than it), never more than is left; reused while it fits.
            self.buffer = torch.empty(max(size, min(self.limit, self.remaining)), dtype=torch.uint8,
                                      device=self.device)
        view = self.buffer[self.used:self.used + nbytes].view(dtype).view(tensor.shape)
        view.copy_(tensor.detach())  # the cast to the engine's dtype and the copy in one
        self.specs.append([name, dtype_name(dtype), list(tensor.shape), self.used, nbytes])
        self.used += size
        self.remaining -= size

    def take(self) -> Bucket:
        bucket = Bucket(self.specs, self.buffer[:bucket_nbytes(self.specs)])
        self.specs, self.used = [], 0
        return bucket


def sync_tensor_names(model: torch.nn.Module) -> list[str]:
    """What a sync sends, in state-dict order: each parameter once (a tied alias such as ``lm_head.weight``
    is left to the engine, as it ties it itself) and every persistent buffer. With a LoRA adapter
    (``agent_trainer/workers/lora.py``) the names are the plain model's: the adapter's own parameters are left out (they
    are merged into their base weight) and ``.base_layer`` is dropped (:func:`sync_sources`)."""
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

    A LoRA model (``agent_trainer/workers/lora.py``) sends the plain model's names and shapes: each adapted weight
    merged, ``W + (alpha / r) B A`` (:func:`agent_trainer.workers.lora.merged_weight`; its adapter is in its FSDP unit,
    gathered with it).
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


# --------------------------------------------------------------------------- the weight-transfer group


def _listening_socket(host: str) -> socket.socket:
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    return listener


def new_process_group(store, rank: int, world_size: int, backend: str, timeout_s: float, host: str | None = None):
    """A process group of its own over ``store`` (never the default group): gloo or NCCL."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def join_weight_group(host: str, port: int, rank: int, world_size: int, backend: str, name: str,
                      timeout_s: float, own_host: str | None = None):
    """An engine worker's side of the weight-transfer group: a TCPStore client of rank 0's store."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    return new_process_group(dist.PrefixStore(name, store), rank, world_size, backend, timeout_s, own_host)


def broadcast_bucket(group, flat: torch.Tensor) -> None:
    """Rank 0's bucket into every member's ``flat`` (same size) over ``group``."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flat], options).wait()


def receive_bucket(group, specs: Sequence[Sequence], device: torch.device) -> torch.Tensor:
    """A member's receive of one bucket: a fresh flat buffer filled by rank 0's broadcast."""
    flat = torch.empty(bucket_nbytes(specs), dtype=torch.uint8, device=device)
    broadcast_bucket(group, flat)
    return flat


def node_ip() -> str:
    """This node's address as Ray sees it (127.0.0.1 in a local run), else the loopback address."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # outside Ray (unit tests)
        return "127.0.0.1"


# --------------------------------------------------------------------------- senders (actor rank 0)


class EngineFailed(RuntimeError):
    """An engine failed during a sync (dead, restarting, or its load raised)."""


def _get(refs: list, what: str) -> list:
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError

    try:
        return ray.get(refs)
    except (RayActorError, ActorUnavailableError) as err:
        raise EngineFailed(f"{what}: {err}") from err


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


class _Sender:
    transport = ""
    device: torch.device = torch.device("cpu")

    def __init__(self, engines: list):
        self.engines = engines

    def begin(self, info: list[dict]) -> None:
        _get([e.begin_weight_sync.remote() for e in self.engines], "begin_weight_sync")

    def send(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def finish(self) -> float:
        return float(_get([e.finish_weight_sync.remote() for e in self.engines], "finish_weight_sync")[0])

    def abort(self) -> None:
        """After a failure: drop whatever state a later sync must not reuse."""


class ObjectStoreSender(_Sender):
    """Each bucket is put into Ray's object store once; every engine loads it before the next is packed."""

    transport = "object_store"

    def send(self, bucket: Bucket) -> None:
        import ray

        ref = ray.put((bucket.specs, bucket.flat.numpy()))  # numpy: the engines read it from shared memory
        _get([e.load_weight_bucket.remote(ref) for e in self.engines], "load_weight_bucket")
        del ref


class CollectiveSender(_Sender):
    """Rank 0 broadcasts each bucket to every engine worker in a weight-transfer group.

    The group (gloo on CPU, NCCL on GPU) is built from a TCPStore rank 0 hosts on Ray's node address; every
    engine worker joins as rank ``1 + k``. It is kept between syncs while every engine reports the group's
    name, and built afresh (a new name on the same store) otherwise: after a failure, or when an engine was
    restarted by Ray (a restarted engine holds no group).
    """

    transport = "collective"

    def __init__(self, engines: list, state: dict, backend: str, device: torch.device, timeout_s: float):
        super().__init__(engines)
        self.state, self.backend, self.device, self.timeout_s = state, backend, device, timeout_s
        self.setup_s = 0.0

    def begin(self, info: list[dict]) -> None:
        name = self.state.get("name")
        if self.state.get("group") is None or any(i.get("weight_group") != name for i in info):
            self._build(info)
        super().begin(info)

    def _build(self, info: list[dict]) -> None:
        import torch.distributed as dist

        start = time.perf_counter()
        self.abort()
        host = node_ip()
        if self.state.get("store") is None:
            listener = _listening_socket(host)
            port = listener.getsockname()[1]
            self.state["store"] = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                                timeout=timedelta(seconds=self.timeout_s),
                                                master_listen_fd=listener.detach())
            self.state["address"] = (host, port)
        self.state["generation"] = self.state.get("generation", 0) + 1
        name = f"weights/{self.state['generation']}"
        world = 1 + sum(int(i["workers"]) for i in info)
        offsets = [1 + sum(int(i["workers"]) for i in info[:k]) for k in range(len(info))]
        host, port = self.state["address"]
        refs = [e.init_weight_group.remote(host, port, offset, world, self.backend, name, self.timeout_s)
                for e, offset in zip(self.engines, offsets)]
        group = new_process_group(dist.PrefixStore(name, self.state["store"]), 0, world, self.backend,
                                  self.timeout_s, host)
        _get(refs, "init_weight_group")
        self.state.update(group=group, name=name)
        self.setup_s = time.perf_counter() - start

    def send(self, bucket: Bucket) -> None:
        refs = [e.receive_weight_bucket.remote(bucket.specs) for e in self.engines]
        try:
            broadcast_bucket(self.state["group"], bucket.flat)
        except Exception as err:  # a member died mid-broadcast: gloo raises, NCCL times out
            raise EngineFailed(f"weight broadcast: {err}") from err
        _get(refs, "receive_weight_bucket")

    def abort(self) -> None:
        self.state.update(group=None, name=None)


class CudaIpcSender(_Sender):
    """Engines on the actor's own GPU (``hybrid_engine``): each bucket's CUDA IPC handle, no copy.

    GPU only; never run on CPU (docs/architecture.md says so). The handle (:func:`ipc_handle`) is a list of
    numbers, strings and bytes, so it travels through Ray and vLLM's msgpack encoder as data (nothing is
    pickled); the engine rebuilds the tensor on its own device (the same physical GPU) and loads from it while
    rank 0 keeps the bucket alive.
    """

    transport = "cuda_ipc"

    def __init__(self, engines: list, device: torch.device):
        super().__init__(engines)
        if device.type != "cuda":
            raise ValueError("weight_sync=cuda_ipc needs the actor on a GPU (it shares GPU memory with the engine)")
        if len(engines) != 1:
            # Rank 0's handle opens only on rank 0's GPU; each rank sending to its own colocated engine is not built.
            raise ValueError(f"weight_sync=cuda_ipc reaches the one engine on the actor's rank-0 GPU, not "
                             f"{len(engines)} engines; set actor_rollout_ref.rollout.weight_sync=collective")
        self.device = device

    def send(self, bucket: Bucket) -> None:
        torch.cuda.current_stream(self.device).synchronize()  # the packed bytes are written before the engine reads
        handle = ipc_handle(bucket.flat)
        _get([e.load_weight_ipc.remote(bucket.specs, handle) for e in self.engines], "load_weight_ipc")


def resolve_transport(requested: str, engine_device: str, colocated: bool, engines: int = 1) -> str:
    """``auto``: ``collective`` to separate GPU engines, ``cuda_ipc`` to colocated GPU engines, ``object_store``
    on CPU. An explicit choice is kept, except ``cuda_ipc`` without a GPU (refused).

    Colocated GPU engines: ``cuda_ipc`` reaches the one engine on the actor's rank-0 GPU (the one-GPU layout).
    Several colocated engines are refused: rank 0's handle opens only on its own GPU, and NCCL refuses two
    ranks on one GPU; each rank sending to its own engine is not built.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"actor_rollout_ref.rollout.weight_sync must be one of {TRANSPORTS} (got {requested!r})")
    if requested == "auto":
        if engine_device != "cuda":
            return "object_store"
        if not colocated:
            return "collective"
        if engines != 1:
            raise ValueError(f"weight sync to {engines} engines colocated with the actor (hybrid_engine) is not "
                             "built: cuda_ipc reaches the one engine on the actor's rank-0 GPU; use one engine "
                             "(rollout.num_workers=1) or set actor_rollout_ref.rollout.weight_sync=object_store")
        return "cuda_ipc"
    if requested == "cuda_ipc" and engine_device != "cuda":
        raise ValueError("actor_rollout_ref.rollout.weight_sync=cuda_ipc needs GPU engines colocated with the actor "
                         "(actor_rollout_ref.hybrid_engine=true); use object_store or collective on CPU")
    return requested


@dataclass
class SyncPlan:
    """What the driver tells every actor rank about one sync."""

    weight_sync: str = "auto"
    bucket_megabytes: float = 256.0
    colocated: bool = False
    timeout_s: float = 600.0


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
            if transport == "object_store":
                sender = ObjectStoreSender(engines)
            elif transport == "collective":
                on_gpu = device.type == "cuda" and info[0]["device"] == "cuda"
                sender = CollectiveSender(engines, state, "nccl" if on_gpu else "gloo",
                                          device if on_gpu else torch.device("cpu"), plan.timeout_s)
            else:
                sender = CudaIpcSender(engines, device)
            sender.begin(info)
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
    stats = _sync_once(actor_wg, engines, plan)
    if stats.get("error") is not None:
        logger.error("rollout engine failed during weight sync (%s); waiting for its restart to resend",
                     stats["error"])
        from agent_trainer.workers.worker_group import wait_until_ready  # ray, only when an engine failed

        wait_until_ready(engines)
        stats = _sync_once(actor_wg, engines, plan)
        if stats.get("error") is not None:
            raise RuntimeError(f"a rollout engine failed twice while loading the actor's weights ({stats['error']}); "
                               "see its log above (Ray restarts an engine at most twice)")
    if on_stats is not None:
        on_stats(stats)
    return float(stats["reload_s"])


def _sync_once(actor_wg, engines: list, plan: SyncPlan) -> dict:
    refs = actor_wg.execute_all_async("push_weights", plan, engines)
    return actor_wg.get(refs)[0]


def bytes_as_tensor(data) -> torch.Tensor:
    """A uint8 tensor over a bytes-like buffer (bytes, memoryview, numpy array), without a copy."""
    import warnings

    if isinstance(data, torch.Tensor):
        return data
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffers (Ray's shared memory, msgpack's bytes): only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def ipc_handle(tensor: torch.Tensor) -> list:
    """A CUDA tensor's IPC handle as plain data: ``reduce_tensor``'s arguments without their classes and dtype
    objects (size, stride, offset, dtype name, device index, storage handle bytes, storage bytes and offset,
    requires_grad, ref-counter handle and offset, event handle, event sync flag). Read back by
    :func:`rebuild_ipc_tensor`, which chooses the rebuild function itself: nothing is pickled or sent as code."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, nbytes, offset_bytes, requires_grad,
     counter_handle, counter_offset, event_handle, event_sync) = args
    return [list(size), list(stride), int(offset), str(dtype).removeprefix("torch."), int(device), bytes(handle),
            int(nbytes), int(offset_bytes), bool(requires_grad), bytes(counter_handle), int(counter_offset),
            bytes(event_handle) if event_handle is not None else None, bool(event_sync)]


def rebuild_ipc_tensor(handle: list, device: torch.device | int) -> torch.Tensor:
    """The tensor an :func:`ipc_handle` points at, on this process's ``device`` (the sender's GPU seen from here:
    colocated engines share the physical GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (size, stride, offset, dtype, _device, storage, nbytes, offset_bytes, requires_grad, counter_handle,
     counter_offset, event_handle, event_sync) = handle
    index = torch.device(device).index if isinstance(device, torch.device) else int(device)
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), int(offset), torch.storage.TypedStorage,
                               getattr(torch, dtype), index, bytes(storage), int(nbytes), int(offset_bytes),
                               bool(requires_grad), bytes(counter_handle), int(counter_offset),
                               None if event_handle is None else bytes(event_handle), bool(event_sync))
