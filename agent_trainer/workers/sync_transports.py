"""The weight sync's transports: how a bucket travels from actor rank 0 to the rollout engines, both ends of each.

- ``object_store`` (:class:`ObjectStoreSender`): each bucket is put into Ray's object store once and every engine
  loads it;
- ``collective`` (:class:`CollectiveSender`): rank 0 broadcasts it in a weight-transfer process group of rank 0 and
  every engine worker (gloo on CPU, NCCL on GPU; a group built from its own TCPStore, not the default process
  group); an engine worker joins with :func:`join_weight_group` and receives with :func:`receive_bucket`;
- ``cuda_ipc`` (:class:`CudaIpcSender`, engines on the actor's GPU): CUDA IPC handles of the bucket
  (:func:`ipc_handle`), which the engine maps without a copy (:func:`rebuild_ipc_tensor`).

:func:`resolve_transport` turns ``actor_rollout_ref.rollout.weight_sync`` into one of them, :func:`make_sender`
builds rank 0's sender. The actor side that packs the buckets is ``agent_trainer.workers.weight_sync``; the engine side that
loads them is ``agent_trainer.workers.engines.base.RolloutEngine``.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Sequence

import torch

from agent_trainer.workers.weight_buckets import Bucket, bucket_nbytes

TRANSPORTS = ("auto", "object_store", "collective", "cuda_ipc")
"""``actor_rollout_ref.rollout.weight_sync`` values."""


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


class _Sender:
    transport = ""
    device: torch.device = torch.device("cpu")

    def __init__(self, engines: list):
        self.engines = engines

    def begin(self, info: list[dict], tag: str = "") -> None:
        _get([e.begin_weight_sync.remote(tag) for e in self.engines], "begin_weight_sync")

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

    def begin(self, info: list[dict], tag: str = "") -> None:
        name = self.state.get("name")
        if self.state.get("group") is None or any(i.get("weight_group") != name for i in info):
            self._build(info)
        super().begin(info, tag)

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


def make_sender(transport: str, engines: list, state: dict, device: torch.device, engine_device: str,
                timeout_s: float) -> _Sender:
    """Rank 0's sender for ``transport`` (:func:`resolve_transport`'s choice). ``device``: the actor's;
    ``engine_device``: the engines' (``weight_sync_info``); ``state``: what a collective group keeps between syncs."""
    if transport == "object_store":
        return ObjectStoreSender(engines)
    if transport == "collective":
        on_gpu = device.type == "cuda" and engine_device == "cuda"
        return CollectiveSender(engines, state, "nccl" if on_gpu else "gloo",
                                device if on_gpu else torch.device("cpu"), timeout_s)
    return CudaIpcSender(engines, device)


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
