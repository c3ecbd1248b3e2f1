"""Shared machinery of the FSDP2 workers: process group, sharding, micro-batching.

Each worker is a plain class (testable without Ray) holding one rank of a
``torch.distributed`` process group. The model is wrapped with FSDP2's
``fully_shard``: every decoder layer, then the root, so parameters are
sharded across ranks and all-gathered layer by layer in forward/backward.
gloo on CPU, NCCL on GPU; the code path is the same.

Precision and loading (docs/architecture.md, "Precision and loading"): with a process group the model is
built on the meta device, sharded, materialised empty on the rank's device, and filled from the checkpoint
that rank 0 alone reads (:meth:`FSDPWorker.load_pretrained`); ``fsdp.mixed_precision: bf16`` is FSDP2's
``MixedPrecisionPolicy`` (bfloat16 compute and all-gathers, float32 gradient reduction, float32 master
weights and optimizer). Without a process group (unit tests, one rank) the model is ``from_pretrained``
as before and bf16 falls back to ``torch.autocast``.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import DynamicCache

from agent_trainer.common import checkpoint
from agent_trainer.checks.memory_plan import decoder_layers
from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import FSDPConfig, OptimConfig
from agent_trainer.workers import sharded_checkpoint
from agent_trainer.workers.fused_head import fusable, head_scores


MICRO_BATCH_LOOP = "agent_trainer.micro_batch_loop"
"""The name of each mini-batch's micro-batch loop in a ``torch.profiler`` trace (forwards and backwards only)."""
FUSED_ADAMW_DEVICES = {"cpu", "cuda"}
"""Devices where torch's fused AdamW runs (:meth:`FSDPWorker.build_optimizer`)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``*.model.dtype`` -> the torch dtype weights are loaded in."""


def pick_device(device: str, gpu_ids: Sequence | None = None, visible_devices: str | None = "") -> torch.device:
    """The torch device of this rank for ``device`` (auto | cpu | cuda), always with an index for CUDA.

    ``auto`` is CUDA when a GPU is visible to this process, else CPU (unit tests; the driver resolves
    ``trainer.device`` from the cluster's resources and hands workers an explicit ``cpu`` or ``cuda``,
    which is followed as given). For CUDA the index is :func:`cuda_index` of the GPUs Ray assigned this
    actor (``gpu_ids``; read from ``ray.get_gpu_ids()`` when None) within ``CUDA_VISIBLE_DEVICES``
    (``visible_devices``; read from the environment when left at ""): ``torch.cuda.set_device`` refuses
    a CUDA device without an index.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = torch.device(device)
    if chosen.type != "cuda" or chosen.index is not None:
        return chosen
    if gpu_ids is None:
        gpu_ids = ray_gpu_ids()
    if visible_devices == "":
        visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", cuda_index(gpu_ids, visible_devices))


def ray_gpu_ids() -> list:
    """The GPU ids Ray assigned this process (``ray.get_gpu_ids()``); [] outside a Ray worker."""
    ray = sys.modules.get("ray")  # a process that never imported Ray is not a Ray worker
    if ray is None or not ray.is_initialized():
        return []
    return list(ray.get_gpu_ids())


def cuda_index(gpu_ids: Sequence, visible_devices: str | None) -> int:
    """The CUDA device index, inside this process, of the first GPU in ``gpu_ids`` (Ray's ids: physical
    GPU ids, or the entries of the node's ``CUDA_VISIBLE_DEVICES``).

    Ray sets ``CUDA_VISIBLE_DEVICES`` to exactly the GPUs it gave the actor, so that GPU is the id's
    position in it: 0 for a one-GPU rank. With ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` every
    GPU stays visible and the position (or the id itself, when nothing restricts visibility) is read
    the same way. No ids (outside Ray: a test, torchrun with its own visibility): device 0.
    """
    if not gpu_ids:
        return 0
    first = str(gpu_ids[0]).strip()
    visible = [d.strip() for d in (visible_devices or "").split(",") if d.strip()]
    if not visible:
        return int(first)
    if first not in visible:
        raise RuntimeError(f"Ray assigned GPU {first!r} to this rank but CUDA_VISIBLE_DEVICES={visible_devices!r} "
                           "does not list it; leave CUDA_VISIBLE_DEVICES to Ray")
    return visible.index(first)


def mixed_precision_policy(mode: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``fsdp.mixed_precision``: ``bf16`` all-gathers and computes in bfloat16 and
    reduce-scatters gradients in float32 (the sharded master weights, their gradients and the optimizer
    stay in the parameters' own dtype, float32 by default); ``none``: no policy."""
    if mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


WEIGHT_FILES_READ = 0
"""How many weight files this process has opened in :func:`read_weight_file` (tests check that only rank 0 reads)."""


def weight_files(path: str) -> list[Path]:
    """The ``*.safetensors`` files of a Hugging Face folder (or hub id, downloaded here: call on rank 0 only)."""
    folder = Path(path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=["*.safetensors", "*.json"]))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (model path {path!r}); the sharded loader "
                                "reads safetensors only: re-save the model with save_pretrained()")
    return files


def read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, on CPU in its stored dtype (counted in :data:`WEIGHT_FILES_READ`)."""
    global WEIGHT_FILES_READ
    WEIGHT_FILES_READ += 1
    return load_file(str(file))


@dataclass
class ModelInputs:
    """The three tensors a causal LM forward needs.

    ``attention_mask`` is None for right-padded rows (:func:`causal_mask_suffices`): the model's causal
    mask alone then gives every real token the same context, and the attention kernel runs its causal
    path instead of reading a [B, 1, T, T] mask (about 1.1x per pass on the tiny model, docs/benchmarks.md).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    shared_prefix: int = 0
    """Leading columns every row holds identically: :func:`run_model` runs them once, for one row, and the
    model's outputs start after them (:func:`shared_prefix_length`)."""
    suffix_lengths: tuple[int, ...] | None = None
    """With a shared prefix: each row's columns after it that a pass reads (through its last scored token),
    run packed with the prefix in one row (:func:`choose_layout`)."""
    counting_positions: bool = False
    """``attention_mask`` is None and ``position_ids`` are 0, 1, 2, ... in every row: a whole-row forward may leave
    both to the model (:func:`causal_only`)."""


SHARED_PREFIX_MIN_TOKENS = 16
"""The shortest common prefix worth its own forward call (:func:`shared_prefix_length`)."""


class FSDPWorker:
    """One rank of an FSDP2 worker group (base of the actor and critic workers)."""

    hf_auto_class: type | None = None
    """The transformers ``AutoModelFor...`` class a checkpoint of this role is written as."""

    def __init__(self, *, rank: int, world_size: int, fsdp: FSDPConfig, device: str = "auto", seed: int = 0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.fsdp_config = fsdp
        self.device = pick_device(device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, fsdp.num_threads))
            for key in ("param_offload", "optimizer_offload"):
                if getattr(fsdp, key, False):
                    raise ValueError(f"fsdp.{key} = True moves state from the GPU to host memory, but this worker "
                                     f"runs on {self.device}; set fsdp.{key}=false or run on GPUs")
        else:  # float32 matmuls (master weights without a policy, the float32 heads) in TF32 on Ampere and later
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        checkpoint.seed_everything(seed + rank)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    # -- process group -------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port listening on it for the process-group rendezvous (rank 0 only).

        The address is Ray's node address: 127.0.0.1 in a local run (``init_ray``), the node's IP on a
        cluster, where other ranks may run on other nodes. The socket stays open and becomes the
        TCPStore's listener in :meth:`init_distributed`: the store listens on that address only (torch's
        own listener takes every interface) and no other process can take the port in between.
        """
        import ray  # only meaningful inside a Ray worker

        addr = ray.util.get_node_ip_address()
        listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((addr, 0))
        listener.listen()
        self._rendezvous_listener = listener
        return addr, listener.getsockname()[1]

    def init_distributed(self, master_addr: str, master_port: int, backend: str, timeout_s: float = 600.0) -> None:
        """Join the group's process group (every rank must call this concurrently).

        ``timeout_s`` (``trainer.collective_timeout_s``) bounds the rendezvous and every collective:
        a rank whose peer died fails its call after that long instead of blocking forever.
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # pick_device always gives CUDA an index
        timeout = timedelta(seconds=timeout_s)
        listener = getattr(self, "_rendezvous_listener", None)  # set on rank 0 by rendezvous_address
        store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=listener is not None,
                              timeout=timeout, master_listen_fd=listener.detach() if listener else None)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)

    # -- model ---------------------------------------------------------------------------
    def shard_model(self, model: torch.nn.Module, cpu_offload: bool = False) -> torch.nn.Module:
        """Apply FSDP2: each decoder layer is its own unit, then the root module, each under this role's
        :func:`mixed_precision_policy` and, with ``cpu_offload``, FSDP2's ``CPUOffloadPolicy`` (sharded
        parameters live in pinned host memory and are copied to the GPU unit by unit; GPU only).

        A model on the meta device (:meth:`load_pretrained`) stays there: the caller materialises it.
        Without a process group the model just moves to the device (bf16 then runs under autocast:
        :meth:`precision`)."""
        on_meta = any(p.is_meta for p in model.parameters())
        if not on_meta:
            model.to(self.device)
        if dist.is_initialized():
            kwargs = {}
            policy = mixed_precision_policy(self.fsdp_config.mixed_precision)
            if policy is not None:
                kwargs["mp_policy"] = policy
            if cpu_offload:
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            for layer in decoder_layers(model):
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
        return model

    def load_pretrained(self, auto_class, path: str, config, *, dtype: str,
                        prepare: Callable[[torch.nn.Module], None] | None = None, fresh_prefixes: tuple[str, ...] = (),
                        cpu_offload: bool = False, lora=None) -> torch.nn.Module:
        """The sharded model of ``auto_class`` (an ``AutoModelFor...``) with ``config``, weights from ``path``.

        With a process group (every rank calls, concurrently): the model is built from its config on the
        meta device (no memory), ``prepare(model)`` runs (gradient checkpointing, ``use_cache``), it is
        sharded (:meth:`shard_model`), materialised empty on this rank's device (host memory with
        ``cpu_offload``) holding only its shards, its non-persistent buffers (rotary ``inv_freq``) are
        recomputed (:func:`restore_non_persistent_buffers`), and rank 0 alone reads the safetensors, one
        file at a time, and broadcasts each tensor into every rank's shards
        (``set_model_state_dict(..., broadcast_from_rank0=True)``; :meth:`_load_from_rank0`). So no rank
        holds the full model in float32, and the host holds one file at a time on rank 0 only. Weights whose
        names start with ``fresh_prefixes`` (the critic's new value head) may be missing from the files;
        the caller initialises them.

        The files' tensor names must be the model's state-dict names (as saved by ``save_pretrained``: true of the
        Qwen2 / Llama families; transformers' renames of legacy checkpoint keys are not applied here): a weight the
        files lack fails on every rank, naming it.

        Without a process group: ``from_pretrained`` then ``prepare`` and a move to the device, as before.

        ``lora`` (a ``ModelConfig`` with ``lora_rank`` > 0): a LoRA adapter is injected after ``prepare``, before
        sharding (``agent_trainer/workers/lora.py``): each adapted layer's FSDP unit holds its frozen base weight and
        its adapter together. The files' weights then load under their ``base_layer`` names and rank 0 broadcasts fresh
        adapter weights (:func:`agent_trainer.workers.lora.initial_adapter_weights`, seeded with ``lora_seed``), so
        every rank starts from the same adapter.
        """
        torch_dtype = DTYPES[dtype]
        if not dist.is_initialized():
            model = auto_class.from_pretrained(path, config=config, dtype=torch_dtype)
            if prepare is not None:
                prepare(model)
            if lora is not None:
                _add_adapter(model, lora)
                from agent_trainer.workers.lora import starting_adapter_weights

                model.load_state_dict(starting_adapter_weights(model, lora, self.lora_seed), strict=False)
            return self.shard_model(model)
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=torch_dtype)
        if prepare is not None:
            prepare(model)
        if lora is not None:
            _add_adapter(model, lora)
        self.shard_model(model, cpu_offload=cpu_offload)
        model.to_empty(device="cpu" if cpu_offload else self.device)
        restore_non_persistent_buffers(model, self.device)
        self._load_from_rank0(model, path, fresh_prefixes, lora=lora)
        return model

    lora_seed: int = 0
    """The seed of a LoRA adapter's first weights (the same on every rank; the trainer's seed)."""

    def _load_from_rank0(self, model: torch.nn.Module, path: str, fresh_prefixes: tuple[str, ...],
                         lora=None) -> None:
        """Fill every rank's shards of ``model`` from ``path``'s safetensors, which rank 0 alone reads (one file at
        a time, each broadcast tensor by tensor into the shards); a weight missing from the files fails on every
        rank with one message. Collective. With a LoRA adapter (``lora``, its ``ModelConfig``) the files' names of the
        adapted weights are renamed to the model's ``base_layer`` names and rank 0 adds the adapter's first weights:
        fresh ones seeded with ``lora_seed``, or ``lora.lora_adapter_path``'s
        (:func:`agent_trainer.workers.lora.starting_adapter_weights`)."""
        from agent_trainer.workers import lora as lora_mod

        expected = set(get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)))
        renames = lora_mod.base_weight_names(model) if lora is not None else {}
        files = weight_files(path) if self.rank == 0 else None
        box = [None if files is None else [str(f) for f in files]]
        dist.broadcast_object_list(box, src=0)
        loaded: set[str] = set()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        for file in box[0]:
            weights = read_weight_file(Path(file)) if self.rank == 0 else {}
            weights = {renames.get(name, name): value for name, value in weights.items()}
            loaded.update(weights)
            set_model_state_dict(model, weights, options=options)
            del weights
        if lora is not None:
            problem = [None]
            try:
                weights = lora_mod.starting_adapter_weights(model, lora, self.lora_seed) if self.rank == 0 else {}
            except ValueError as err:  # the adapter folder does not fit the model: every rank raises
                weights, problem = {}, [str(err)]
            dist.broadcast_object_list(problem, src=0)
            if problem[0]:
                raise ValueError(problem[0])
            loaded.update(weights)
            set_model_state_dict(model, weights, options=options)
            loaded.update(name for name in expected if lora_mod.is_adapter_tensor(name))  # every rank checks the same
        missing = sorted(name for name in expected - loaded - tied_weight_names(model)
                         if not name.startswith(fresh_prefixes))
        problem = [f"model path {path!r} lacks weights {missing[:8]} for {type(model).__name__}" if missing else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise ValueError(problem[0])

    def build_optimizer(self, optim: OptimConfig) -> None:
        """AdamW with a linear warm-up per optimizer step, times the schedule's decay (:meth:`follow_progress`).

        torch's fused AdamW (one kernel over every parameter) where the parameters live on a device that has it
        (CPU, CUDA: also the host shards of ``fsdp.param_offload``), its ``foreach`` form elsewhere; the plain
        per-parameter loop (torch's default on CPU) differs from it by rounding only."""
        assert self.model is not None  # internal: called after the model is built
        trained = [p for p in self.model.parameters() if p.requires_grad]  # all of them, or a LoRA adapter's
        fused = {p.device.type for p in trained} <= FUSED_ADAMW_DEVICES
        self.optimizer = torch.optim.AdamW(
            trained, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
            **({"fused": True} if fused else {"foreach": True})
        )
        warmup = max(0, optim.warmup_steps)
        self.optim_config, self.lr_decay = optim, 1.0
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: (min(1.0, (step + 1) / warmup) if warmup else 1.0) * self.lr_decay
        )

    def follow_progress(self, progress: float | None) -> None:
        """Set the schedule's decay for the run's ``progress`` (``BatchMeta.progress``; None leaves it) and apply it
        to the learning rate at once: cosine from 1 at progress 0 to ``min_lr_ratio`` at 1, 1 when constant."""
        optim = self.optim_config
        if progress is None or optim.lr_scheduler_type != "cosine":
            return
        floor = optim.min_lr_ratio
        self.lr_decay = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
        sched = self.lr_scheduler
        sched._last_lr = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, sched._last_lr):
            group["lr"] = lr

    def optimizer_step(self, grad_clip: float) -> float:
        """Clip the global gradient norm, step, zero grads; return the pre-clip norm."""
        assert self.model is not None and self.optimizer is not None and self.lr_scheduler is not None
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict on CPU (rank 0 gets it; other ranks get ``{}``).

        Every rank must call this concurrently: it all-gathers the shards.
        """
        assert self.model is not None
        if not dist.is_initialized():
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return gather_full_weights(self.model, keep=self.rank == 0)

    def push_weights(self, plan, engines: list) -> dict:
        """This rank's part of a weight sync (every rank calls it concurrently; rank 0 sends the buckets).

        ``agent_trainer.workers.weight_sync.push_weights``: FSDP units are all-gathered one at a time, rank 0 packs
        buckets in the engines' dtype and sends each before the next; returns rank 0's stats (``{}`` elsewhere).
        """
        from agent_trainer.workers.weight_sync import push_weights

        assert self.model is not None
        state = self.__dict__.setdefault("_weight_sync_state", {})  # rank 0's weight-transfer group, kept
        return push_weights(self.model, self.rank, plan, engines, state)

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path: str, role: str | None = None, hf_model: bool = True) -> None:
        """Write this role's state under ``path`` (every rank calls, concurrently).

        ``role`` names the model for a process that hosts several (``ActorWorker`` with a colocated
        critic); a worker of one role has nothing to choose.

        Every rank writes its own shards of the parameters and of the optimizer state
        (``shards/model-rank<r>-of-<w>.safetensors``, ``shards/optim-rank...``; rank 0 the JSON
        ``shards/index.json``, ``agent_trainer/workers/sharded_checkpoint.py``) and its RNG state
        (``rng/rank_<r>.json``); rank 0 the model's ``config.json`` and the LR scheduler
        (``optim/lr_scheduler.json``). Nothing is gathered and nothing is pickled. With
        ``hf_model`` (``trainer.save_hf_model``) rank 0 then also assembles the Hugging Face
        weights (``model.safetensors``; loadable by ``from_pretrained`` and vLLM) from the shard
        files, one tensor at a time, after a barrier.

        With a LoRA adapter (``agent_trainer/workers/lora.py``) the shards hold the adapter and its optimizer state only
        (the base weights are ``model_path``'s, which a resume loads again), and ``hf_model`` writes peft's adapter
        folder instead of the model's weights (``adapter_config.json``, ``adapter_model.safetensors``:
        ``peft.PeftModel.from_pretrained(base, path)`` loads it).
        """
        assert self.model is not None  # internal: after init_model
        out = Path(path)
        keep = self._checkpoint_filter()
        sharded_checkpoint.save(self.model, self.optimizer, out, rank=self.rank, world_size=self.world_size,
                                keep=keep)
        checkpoint.write_json(out / "rng" / f"rank_{self.rank}.json", checkpoint.rng_state())
        if self.rank == 0:
            sharded_checkpoint.write_hf_config(self.model, out)
            if self.lr_scheduler is not None:
                checkpoint.write_json(out / "optim" / "lr_scheduler.json", self.lr_scheduler.state_dict())
        if hf_model:
            if dist.is_initialized():
                dist.barrier()  # every rank's shard files are on disk
            if self.rank == 0 and keep is not None:
                from agent_trainer.workers.lora import write_adapter

                write_adapter(out / sharded_checkpoint.SHARDS_DIR, out, self.model_config)
            elif self.rank == 0:
                sharded_checkpoint.write_hf_weights(out / sharded_checkpoint.SHARDS_DIR, out)

    def _checkpoint_filter(self) -> Callable[[str], bool] | None:
        """What a checkpoint of this model keeps: a LoRA adapter's parameters only (their names), else all (None)."""
        from agent_trainer.workers import lora

        return lora.is_adapter_tensor if lora.has_adapter(self.model) else None

    def load_checkpoint(self, path: str, role: str | None = None) -> None:
        """Restore what :meth:`save_checkpoint` wrote (every rank calls, concurrently; ``role`` as there).

        Each rank reads its rows of every tensor from the shard files (its own files at the saving
        world size; at another, the files that hold its rows), so the world size may differ from
        the saving run's and no rank reads the whole model. A checkpoint without shards (written
        before they existed: an HF folder and ``optim/optimizer.safetensors``) is read whole by
        every rank. On more than one node ``path`` must be on storage every node sees.
        """
        assert self.model is not None
        src = Path(path)
        if sharded_checkpoint.has_shards(src):
            sharded_checkpoint.load(self.model, self.optimizer, src, rank=self.rank, world_size=self.world_size,
                                    keep=self._checkpoint_filter())
        elif self._checkpoint_filter() is not None:
            raise ValueError(f"checkpoint {src} has no shards/; a LoRA run resumes from the sharded adapter only")
        else:
            self._load_full_checkpoint(src)
        if self.optimizer is not None:
            self.lr_scheduler.load_state_dict(checkpoint.read_json(src / "optim" / "lr_scheduler.json"))
        rng_file = src / "rng" / f"rank_{self.rank}.json"
        if rng_file.exists():  # a run resumed on more ranks than it saved keeps its fresh seeds there
            checkpoint.set_rng_state(checkpoint.read_json(rng_file))

    def _load_full_checkpoint(self, src: Path) -> None:
        """The unsharded layout: every rank reads the full HF weights and optimizer state and keeps its shards."""
        weights = checkpoint.read_hf_weights(src)
        expected = set(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False)))
        missing = expected - set(weights) - self._tied_weight_names()
        if missing:
            raise ValueError(f"checkpoint {src} lacks weights {sorted(missing)[:8]} for this model")
        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        if self.optimizer is not None:
            meta = checkpoint.read_json(src / "optim" / "optimizer.json")
            tensors = load_file(str(src / "optim" / "optimizer.safetensors"))
            set_optimizer_state_dict(self.model, self.optimizer, checkpoint.unflatten_optimizer_state(tensors, meta),
                                     options=StateDictOptions(full_state_dict=True))

    def _tied_weight_names(self) -> set[str]:
        """``lm_head.weight`` when it is tied to the embeddings (HF folders store it once)."""
        return {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()

    # -- batches -------------------------------------------------------------------------
    def plan_micro_batches(self, batch: TensorBatch, batching: MicroBatching) -> list[tuple[torch.Tensor, TensorBatch]]:
        """This rank's micro-batches of ``batch``: (row indices into ``batch``, the rows cut to their longest).

        With a token budget the number of micro-batches depends on the rows' lengths, which
        differ between ranks; FSDP needs every rank to run the same number of forwards
        (each all-gathers the shards), so the count is agreed on with an all-reduce (max)
        and ranks below it split their costliest micro-batches. Each micro-batch carries
        ``meta.seq_len``, the uncut width, the sequence length the loss normalises by.
        A row counts up to its last generated token (:func:`scored_lengths`).
        Fixed-size micro-batches take the rows longest first, or one prompt's rows together when
        that runs fewer token positions (:func:`forward_positions`: their shared prompt runs once).
        """
        lengths = scored_lengths(batch).tolist()
        if batching.max_token_len is None:  # rows of similar length together: each micro-batch is cut to its longest
            size = max(1, batching.rows)
            order = longest_first(lengths)
            groups = [order[i:i + size] for i in range(0, len(batch), size)]
            if prefix_sharing_supported(self.model) and causal_mask_suffices(batch["attention_mask"],
                                                                             batch["position_ids"]):
                order = prompts_together(batch["input_ids"], scored_mask(batch), lengths)
                by_prompt = [order[i:i + size] for i in range(0, len(batch), size)]
                if forward_positions(batch, by_prompt, lengths) < forward_positions(batch, groups, lengths):
                    groups = by_prompt
        else:
            groups = token_budget_groups(lengths, batching.max_token_len)
            groups = split_to_count(groups, lengths, self._max_over_ranks(len(groups)))
        full = batch["input_ids"].shape[1]
        plan = []
        for group in groups:
            rows = torch.tensor(sorted(group))
            micro = trim_padding(batch.index(rows), max(max(lengths[i] for i in group), 1))
            micro.meta.seq_len = full
            plan.append((rows, micro))
        if self.world_size > 1 and prefix_sharing_supported(self.model):
            # FSDP gathers each unit once per model call: micro-batch k runs two calls on every rank or on none
            wanted = [float(self.layout(micro, two_calls=True).model_calls == 2) for _, micro in plan]
            for (_, micro), agreed in zip(plan, self._over_ranks(wanted, dist.ReduceOp.MIN)):
                micro.meta.two_calls = bool(agreed)
        return plan

    def _max_over_ranks(self, value: int) -> int:
        """The largest ``value`` over the group's ranks (a collective: every rank calls it)."""
        return int(self._over_ranks([value], dist.ReduceOp.MAX)[0])

    def _over_ranks(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        """``values`` reduced element-wise with ``op`` over the group's ranks (a collective: every rank calls it;
        float64, exact for counts)."""
        if not dist.is_initialized():
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def prepare(self, micro: TensorBatch, mini_mask: torch.Tensor | None = None,
                loss_agg_mode: str = "token-mean") -> "Prepared":
        """``micro`` made ready for its forward before the loop that runs it (:class:`Prepared`): its tensors on
        this rank's device, its model inputs, the flat positions of its scored tokens and, with ``mini_mask``
        (its mini-batch's ``response_mask``), its loss weight (:func:`micro_weight`). Everything that reads a
        tensor's value on the host happens here, so the forward and backward after it never wait for the device."""
        inputs = self.model_inputs(micro)
        weight = 0.0 if mini_mask is None else micro_weight(micro["response_mask"], mini_mask, loss_agg_mode)
        index = scored_index(scored_mask(micro), inputs.shared_prefix).to(self.device)
        on_device = {k: v.to(self.device, non_blocking=True) for k, v in micro.tensors.items() if k != "input_ids"}
        on_device = TensorBatch({**on_device, "input_ids": inputs.input_ids}, micro.meta.copy())  # moved once
        return Prepared(on_device, inputs, index, weight)

    @torch.no_grad()
    def forward_rows(self, batch: TensorBatch, batching: MicroBatching,
                     per_token: Callable[["Prepared"], torch.Tensor],
                     model: torch.nn.Module | None = None) -> torch.Tensor:
        """``per_token(micro)`` ([b, w] each) over the micro-batches, as one [B, T] tensor in row order on CPU
        (gathered on the device, copied to the host once). ``model`` (default this role's) is the one
        ``per_token`` runs: on one rank its units are gathered once for all the micro-batches
        (:func:`gathered_once`)."""
        plan = [(rows, self.prepare(micro)) for rows, micro in self.plan_micro_batches(batch, batching)]
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32, device=self.device)
        for rows, micro in gathered_once(self.model if model is None else model, plan, backward=False):
            out[rows.to(self.device)] = pad_columns(per_token(micro).float(), out.shape[1])
        return out.cpu()

    def run_update(self, batch: TensorBatch, *, epochs: int, mini_batch_size: int, batching: MicroBatching,
                   loss_agg_mode: str, grad_clip: float, micro_loss: Callable[["Prepared"], tuple],
                   prefix: str, stop: tuple[str, float] | None = None) -> dict[str, float]:
        """The PPO update loop shared by the actor and the critic: epochs x mini-batches x micro-batches.

        Each mini-batch is one optimizer step; each micro-batch's loss (``micro_loss`` returns it with its
        metrics, 0-d tensors or numbers) is weighted by its share of the mini-batch (:func:`micro_weight`)
        before backward, so the accumulated gradient is the mini-batch loss's whatever the micro-batching.
        A mini-batch's micro-batches are planned and moved to the device (:meth:`prepare`) before the first
        of them runs, and the metrics stay on the device until the update ends: nothing in the micro-batch
        loop waits for the device. On one rank the model's units are gathered (and cast) once per mini-batch
        and its gradients reduced once, after the last micro-batch (:func:`gathered_once`). Returns the metrics
        averaged over micro-batches, and ``<prefix>/grad_norm`` averaged over optimizer steps (one read of the
        norm per step, in :meth:`optimizer_step`).

        ``stop`` = (metric, limit) ends the update early (``actor.target_kl``): when a mini-batch's mean of
        ``metric`` over its micro-batches and the ranks exceeds ``limit``, it and every later mini-batch take no
        optimizer step (one read of the metric per mini-batch, the same decision on every rank); the
        learning-rate schedule still steps for them, so it does not depend on where updates stopped.
        ``<prefix>/kl_stopped`` (0 or 1) and ``<prefix>/optimizer_steps`` report it.
        """
        metrics: dict[str, list] = defaultdict(list)
        norms = []
        minis = [mini for _ in range(epochs) for mini in batch.split(mini_batch_size)]
        for done, mini in enumerate(minis):
            plan = [self.prepare(micro, mini["response_mask"], loss_agg_mode)
                    for _, micro in self.plan_micro_batches(mini, batching)]
            watched = []  # this mini-batch's values of the stop metric
            with torch.profiler.record_function(MICRO_BATCH_LOOP):
                for micro in gathered_once(self.model, plan, backward=True):
                    loss, micro_metrics = micro_loss(micro)
                    (loss * micro.weight).backward()
                    for key, value in micro_metrics.items():
                        metrics[key].append(value.detach() if torch.is_tensor(value) else value)
                    if stop is not None:
                        watched.append(metrics[stop[0]][-1])
            if stop is not None and self._ranks_mean(watched) > stop[1]:
                self.optimizer.zero_grad(set_to_none=True)
                for _ in minis[done:]:
                    self.lr_scheduler.step()
                break
            norms.append(self.optimizer_step(grad_clip))
        out = device_means(metrics, self.device)
        if norms:
            out[f"{prefix}/grad_norm"] = sum(norms) / len(norms)
        if stop is not None:
            out[f"{prefix}/kl_stopped"] = float(len(norms) < len(minis))
            out[f"{prefix}/optimizer_steps"] = float(len(norms))
        return out

    def _ranks_mean(self, values: list) -> float:
        """The mean of ``values`` (0-d tensors or numbers) over this rank's entries, then over the ranks (a
        collective: every rank calls it with its own values)."""
        local = device_means({"value": values}, self.device)["value"]
        return self._over_ranks([local], dist.ReduceOp.SUM)[0] / (self.world_size if dist.is_initialized() else 1)

    def precision(self) -> contextlib.AbstractContextManager:
        """The context every forward of this role runs in.

        With a process group, ``fsdp.mixed_precision: bf16`` is FSDP2's ``MixedPrecisionPolicy``, set on every
        unit by :meth:`shard_model`, so nothing is needed here. Without one (a worker built without
        ``torch.distributed``: unit tests, the plain one-rank path) bf16 falls back to ``torch.autocast`` to
        bfloat16 (backward follows the forward's dtypes; weights, gradients and the optimizer stay float32):
        the same products in bfloat16, not the same kernels (autocast keeps norms and softmax in float32)."""
        if self.fsdp_config.mixed_precision == "bf16" and not dist.is_initialized():
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- offload around the rollout (actor.fsdp.param_offload / optimizer_offload) ------------------
    def offload_to_cpu(self) -> None:
        """Move this rank's parameter shards (``fsdp.param_offload``) and optimizer states (``fsdp.optimizer_offload``)
        to host memory, for the engines' generation on the same GPU (verl's offload around the rollout), and
        release the GPU's cached blocks. Local, no collective; a no-op for what is not configured. Each worker
        hosted in this process (a colocated critic) follows its own flags. The trainer calls it after an update
        and :meth:`reload_to_device` before the next forward; on CPU there is nothing to move (the config
        checks refuse the keys there), so only a GPU exercises the copies."""
        self._move_state(torch.device("cpu"))

    def reload_to_device(self) -> None:
        """Bring back what :meth:`offload_to_cpu` moved (every rank before its next forward or optimizer step)."""
        self._move_state(self.device)

    def _move_state(self, device: torch.device) -> None:
        cfg = self.fsdp_config
        if self.model is not None and cfg.param_offload:
            self.model.to(device)  # FSDP2 re-registers its sharded parameters (FSDPModule._apply); same objects
        if self.optimizer is not None and cfg.optimizer_offload:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":
                        state[key] = value.to(device, non_blocking=True)
        hosted = getattr(self, "critic", None)
        if isinstance(hosted, FSDPWorker):
            hosted._move_state(device if device.type == "cpu" else hosted.device)
        if device.type == "cpu" and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def model_inputs(self, batch: TensorBatch) -> ModelInputs:
        """Move the forward inputs of ``batch`` to this rank's device (no mask for right-padded rows,
        whose common prefix then runs once: :func:`shared_prefix_length`)."""
        mask, positions = batch["attention_mask"], batch["position_ids"]
        layout = Layout()
        if causal_mask_suffices(mask, positions):
            # Positions go on counting over the pads: repeated ones would read as packed sequences
            # (transformers then builds a mask after all); the pads' outputs are unused either way.
            mask, positions = None, torch.arange(positions.shape[1]).expand_as(positions)
            layout = self.layout(batch)
        return ModelInputs(
            input_ids=batch["input_ids"].to(self.device),
            attention_mask=None if mask is None else mask.to(self.device),
            position_ids=positions.to(self.device),
            shared_prefix=layout.shared,
            suffix_lengths=layout.spans,
            counting_positions=mask is None,
        )

    def layout(self, batch: TensorBatch, two_calls: bool | None = None) -> Layout:
        """:func:`choose_layout` for right-padded rows; two model calls (``two_calls`` None) only where every
        rank's micro-batch allows them (``meta.two_calls``, from :meth:`plan_micro_batches`), or on one rank."""
        if not prefix_sharing_supported(self.model):
            return Layout()
        if two_calls is None:
            two_calls = self.world_size == 1 if batch.meta.two_calls is None else batch.meta.two_calls
        return choose_layout(self.model.config, batch["input_ids"], scored_mask(batch), two_calls)


def causal_mask_suffices(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> bool:
    """True when every row's attended tokens are a prefix at positions 0, 1, ... (right padding, the batch
    contract's layout).

    A causal model's token then attends to the same tokens at the same positions with or without the
    padding mask (the pads come after it), so every attended position's output is unchanged; the pads'
    outputs change, and no pass scores them. Left padding, holes or other positions keep the mask.
    """
    counting = position_ids == torch.arange(position_ids.shape[1], device=position_ids.device)
    right_padded = (attention_mask[:, 1:] <= attention_mask[:, :-1]).all()
    return bool(right_padded and (counting | (attention_mask == 0)).all())


def gather_full_weights(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The full state dict of an FSDP2 model, copied to CPU where ``keep`` (every rank calls, in step).

    One FSDP unit at a time is all-gathered with FSDP2's own ``unshard`` (one collective per
    unit, as in forward), its parameters copied, then resharded: the peak is one unit's full
    parameters, as in forward. ``get_model_state_dict(full_state_dict=True)`` gives the same
    tensors with one collective per parameter: 37 ms against 6 ms on the tiny model over gloo
    (27 tensors, 2 ranks), 129 ms against 63 ms on 19M, which was most of the weight sync.
    Buffers are not sharded and come from ``state_dict``; tied weights appear under each name.
    """
    full: dict[str, torch.Tensor] = {}
    for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        unit.unshard()
        try:
            if keep:
                full.update((name, param.detach().to("cpu", copy=True))
                            for name, param in model.named_parameters(remove_duplicate=False)
                            if name not in full and not isinstance(param, DTensor))
        finally:
            unit.reshard()
    if not keep:
        return {}
    state = model.state_dict()  # names in checkpoint order; parameters as sharded DTensors, buffers whole
    return {name: full[name] if name in full else value.detach().to("cpu", copy=True) for name, value in state.items()}


def tied_weight_names(model: torch.nn.Module) -> set[str]:
    """``lm_head.weight`` when it is tied to the embeddings (HF folders store it once)."""
    config = getattr(model, "config", None)
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


@torch.no_grad()
def restore_non_persistent_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Recompute the buffers no checkpoint holds (``persistent=False``: Qwen2's rotary ``inv_freq``), which
    ``to_empty`` left uninitialised, on ``device``.

    They are set to NaN, then the model's own ``_init_weights`` (what ``from_pretrained`` runs for them:
    the rotary module's ``rope_init_fn``) recomputes each owning module; a buffer still not finite after
    that names its module, so an architecture whose buffers transformers cannot recompute fails here
    rather than computing with garbage.
    """
    init = getattr(model, "_init_weights", None)
    for module_name, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        for n in names:
            module._buffers[n] = module._buffers[n].to(device)
            if module._buffers[n].is_floating_point():
                module._buffers[n].fill_(math.nan)
        if init is not None:
            init(module)
        bad = [n for n in names if module._buffers[n].is_floating_point() and not module._buffers[n].isfinite().all()]
        if bad:
            raise RuntimeError(f"{type(module).__name__} ({module_name or 'root'}) buffers {bad} are not saved in "
                               "checkpoints and transformers' _init_weights does not recompute them, so the model "
                               "cannot be built on the meta device")


def shared_prefix_length(input_ids: torch.Tensor, scored: torch.Tensor) -> int:
    """How many leading columns of right-padded rows one forward of the first row can stand in for.

    Rows sharing a prompt (a GRPO group; every episode's system prompt and instructions) compute the
    same hidden states, keys and values on it: the model is causal, so a token's outputs depend on
    the tokens before it only. The prefix is the run of columns where every row holds the same id,
    cut before the first position whose output a pass reads (the one predicting the first
    ``scored`` token), so every output the pass uses comes from the rows' own forward.
    0 for one row or a prefix under ``SHARED_PREFIX_MIN_TOKENS``.
    """
    rows, width = input_ids.shape
    if rows < 2:
        return 0
    common = int((input_ids == input_ids[:1]).all(0).long().cumprod(0).sum())
    scored_columns = scored.bool().any(0).nonzero()
    first_read = int(scored_columns[0]) - 1 if len(scored_columns) else width - 1
    length = min(common, first_read)
    return length if length >= SHARED_PREFIX_MIN_TOKENS else 0


def prefix_sharing_supported(model: torch.nn.Module | None) -> bool:
    """Whether :func:`run_model` may split ``model``'s forward at a shared prefix: a key/value cache of
    full-attention layers only (a sliding-window layer keeps part of it), and no activation
    checkpointing (its recompute would append the suffix's keys to the cache a second time)."""
    config = getattr(model, "config", None)
    if config is None or getattr(model, "is_gradient_checkpointing", False):
        return False
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])


@dataclass(frozen=True)
class Layout:
    """How :func:`run_model` runs a micro-batch: ``shared`` prefix columns (0: every row in full, one call),
    with ``spans`` packed into one row (one call) or, when None, the prefix's keys and values cached for the
    padded rows (two calls)."""

    shared: int = 0
    spans: tuple[int, ...] | None = None

    @property
    def model_calls(self) -> int:
        return 2 if self.shared and self.spans is None else 1


def choose_layout(config, input_ids: torch.Tensor, scored: torch.Tensor, two_calls: bool) -> Layout:
    """The cheapest way to run right-padded rows (:class:`Layout`), by FLOPs; ``two_calls`` False rules out
    the cached prefix (FSDP ranks must run the same number of model calls: :meth:`FSDPWorker.plan_micro_batches`).

    Rows in full run every column (the causal kernel computes about half the pairs); cached, the shared
    prefix (:func:`shared_prefix_length`) runs for one row and each row's remaining columns attend to it,
    padding included; packed, the prefix and each row's span through its last scored token run as one
    row under a block mask (:func:`_run_packed`), with no padding but every pair of the packed row
    computed. Cost per layer: the linear FLOPs per token (:func:`linear_per_attention_pair` attention
    pairs) plus one per computed (query, key) pair. Packing needs an attention that takes a 4D boolean
    mask (``sdpa``). A GRPO group's prompt and replies of 64, 12, 8 and 6 tokens: packed; four long
    episodes of near-equal length sharing their system prompt: in full or cached.
    """
    rows, width = input_ids.shape
    shared = shared_prefix_length(input_ids, scored)
    if not shared:
        return Layout()
    per_token = linear_per_attention_pair(config)
    spans = suffix_spans(scored, shared)
    packed = shared + sum(spans)
    costs = {Layout(): rows * width * (per_token + width / 2)}
    if getattr(config, "_attn_implementation", None) == "sdpa" and sum(spans):
        costs[Layout(shared, spans)] = packed * (per_token + packed)
    if two_calls:
        costs[Layout(shared)] = shared * (per_token + shared / 2) + rows * (width - shared) * (per_token + width)
    return min(costs, key=costs.get)


def suffix_spans(scored: torch.Tensor, shared: int) -> tuple[int, ...]:
    """Each row's columns after the first ``shared`` through its last ``scored`` token (0 for a row without one)."""
    return tuple(max(0, int(n) - shared) for n in row_lengths(scored))


def linear_per_attention_pair(config) -> float:
    """A decoder layer's linear FLOPs per token over its attention FLOPs per (query, key) pair.

    Linear: 2 x (q, k, v, o projections + the gated MLP's three matrices). Attention: 2 x (QK^T + AV)
    over the query heads' width. 768 for the tiny model, 2,880 for the 19M one.
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    linear = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * config.intermediate_size
    return 2 * linear / (4 * heads * head_dim)


def run_model(model: torch.nn.Module, inputs: ModelInputs,
              head_input: Callable[[torch.Tensor], torch.Tensor] | None = None,
              head_forward: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """``model``'s output on ``inputs`` from column ``inputs.shared_prefix`` on.

    With a shared prefix of L columns (Prefix Grouper's shared-prefix forward, arXiv 2506.05433), one
    row of it runs first and its keys and values, expanded to every row, are the cache the rows'
    remaining columns attend to: ``b - 1`` copies of the prefix are neither run nor backpropagated.
    Under autograd the prefix call is checkpointed (``torch.utils.checkpoint``): it keeps no
    activations and runs again, for one row, when the rows' gradient reaches its keys and values,
    so each FSDP unit's parameters are gathered for one forward and backward at a time and the
    rows' gradients through the prefix sum into it. Outputs equal the whole forward's to float
    rounding (tests/workers/test_fsdp_workers.py). ``head_input`` selects what the output head
    (``get_output_embeddings()``) sees of the suffix's hidden states; the prefix call feeds it nothing.
    ``head_forward``, when given, runs in place of the head's own forward on that input (the fused scores of
    :func:`target_scores`); the model's ``logits`` are then whatever it returns.

    With ``inputs.suffix_lengths`` the prefix and the rows' spans after it run packed in one row
    (:func:`_run_packed`); callers see the same ``[rows, width - L, ...]`` outputs either way.
    """
    length = inputs.shared_prefix
    if not length:
        causal = inputs.counting_positions and causal_only(model)
        with _output_head_input(model, head_input, head_forward):
            return model(input_ids=inputs.input_ids, position_ids=None if causal else inputs.position_ids,
                         attention_mask={"full_attention": None} if causal else inputs.attention_mask)
    if inputs.suffix_lengths is not None:
        return _run_packed(model, inputs, head_input, head_forward)
    prefix = (inputs.input_ids[:1, :length], inputs.position_ids[:1, :length])
    if torch.is_grad_enabled():
        keys_values = torch.utils.checkpoint.checkpoint(_prefix_keys_values, model, *prefix, use_reentrant=False)
    else:
        keys_values = _prefix_keys_values(model, *prefix)
    rows = inputs.input_ids.shape[0]
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in enumerate(zip(keys_values[0::2], keys_values[1::2])):
        cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer)
    with _output_head_input(model, head_input, head_forward):
        return model(input_ids=inputs.input_ids[:, length:], position_ids=inputs.position_ids[:, length:],
                     past_key_values=cache)


PREPARED_MASK_MODELS = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral"})
"""Model types whose transformers decoder takes a prepared mask mapping (``{"full_attention": None}``: causal
attention, no mask tensor) in place of ``attention_mask``, as ``generate`` passes it."""


def causal_only(model: torch.nn.Module) -> bool:
    """True when ``model``'s decoder can run right-padded rows with its causal kernel and no mask built at all.

    Given neither a mask nor positions, transformers' mask builder looks for packed rows in the positions it
    derives, reading them back from the device once per forward; a prepared mapping of every layer's attention
    type to no mask skips the builder. Only for :data:`PREPARED_MASK_MODELS` whose layers all attend fully
    (a sliding-window layer needs its mask); other models build their mask as usual."""
    config = getattr(model, "config", None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return getattr(config, "model_type", None) in PREPARED_MASK_MODELS and layer_types == {"full_attention"}


def _run_packed(model: torch.nn.Module, inputs: ModelInputs, head_input: Callable | None,
                head_forward: Callable | None = None):
    """:func:`run_model` as one row: the shared prefix once, then each row's span (``inputs.suffix_lengths``)
    back to back. The prefix attends causally to itself, each span to the prefix and, causally, to its own
    tokens (a [1, 1, N, N] boolean mask), at the positions the rows give them. One forward, no cache and no
    recomputation; the decoder's hidden states of the spans go back to ``[rows, width - L, H]`` (zeros behind
    each span) before the output head."""
    length, spans = inputs.shared_prefix, inputs.suffix_lengths
    rows, width = inputs.input_ids.shape
    device = inputs.input_ids.device
    row = torch.repeat_interleave(torch.arange(rows), torch.tensor(spans)).to(device)
    column = torch.cat([torch.arange(n) for n in spans]).to(device) + length
    segment = torch.cat([row.new_full((length,), -1), row])  # -1: the prefix
    order = torch.arange(len(segment), device=device)
    mask = (order[:, None] >= order[None, :]) & ((segment[:, None] == segment[None, :]) | (segment[None, :] == -1))

    def unpack(_module, _args, out):
        hidden = out.last_hidden_state
        rows_hidden = hidden.new_zeros(rows, width - length, hidden.shape[-1])
        rows_hidden[row, column - length] = hidden[0, length:]
        out.last_hidden_state = rows_hidden
        return out

    hook = model.base_model.register_forward_hook(unpack)
    try:
        with _output_head_input(model, head_input, head_forward):
            ids = torch.cat([inputs.input_ids[0, :length], inputs.input_ids[row, column]])
            positions = torch.cat([inputs.position_ids[0, :length], inputs.position_ids[row, column]])
            return model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask[None, None])
    finally:
        hook.remove()


def _prefix_keys_values(model: torch.nn.Module, input_ids: torch.Tensor,
                        position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every layer's keys and values of one prefix row, flat: (k0, v0, k1, v1, ...)."""
    cache = DynamicCache(config=model.config)
    with _output_head_input(model, lambda hidden: hidden[:, :0]):
        model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache)
    return tuple(t for layer in cache.layers for t in (layer.keys, layer.values))


@contextlib.contextmanager
def _output_head_input(model: torch.nn.Module, select: Callable[[torch.Tensor], torch.Tensor] | None,
                       forward: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """Inside the block, ``model``'s output head (``get_output_embeddings()``, when it has one) gets
    ``select(hidden_states)`` in place of its input, and with ``forward`` runs it instead of its own forward.
    The hook lives inside the model's own forward, so FSDP has unsharded the head's (tied) weights as usual."""
    head = model.get_output_embeddings() if select is not None else None
    if head is None:
        yield
        return
    hook = head.register_forward_pre_hook(lambda _module, args: (select(args[0]), *args[1:]))
    if forward is not None:
        head.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) runs it
    try:
        yield
    finally:
        hook.remove()
        if forward is not None:
            del head.forward


def _add_adapter(model: torch.nn.Module, lora_cfg) -> None:
    """A LoRA adapter in ``model`` (``agent_trainer/workers/lora.py``); with gradient checkpointing the input
    embeddings' output requires grad, so the checkpointed layers' adapters get gradients though the embeddings are
    frozen."""
    from agent_trainer.workers import lora

    lora.add_adapter(model, lora_cfg)
    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()


def micro_batches(batch: TensorBatch, size: int) -> list[TensorBatch]:
    """Consecutive micro-batches of ``size`` rows."""
    return batch.split(max(1, size))


@dataclass(frozen=True)
class MicroBatching:
    """How a rank cuts its rows into micro-batches (one forward/backward each).

    Fixed (``max_token_len`` None): chunks of ``rows`` rows, verl's
    ``*_micro_batch_size_per_gpu``, taken longest first (rows of similar length share a
    micro-batch, so less padding is computed; the accumulated gradient is the same).
    Dynamic (verl's ``use_dynamic_bsz`` with
    ``*_max_token_len_per_gpu``): rows sorted by length are packed while
    ``rows x longest row`` stays within ``max_token_len``, so a micro-batch of short
    episodes holds many rows and one of long episodes few; the forward's cost follows
    the real tokens. Either way every micro-batch is cut to its own longest row, counted
    through its last generated token (the padding columns behind it, and any observation
    after the last reply, are dropped), which leaves every generated token's log-prob and
    value unchanged: the model is causal and padding is on the right.
    """

    rows: int
    max_token_len: int | None = None


def row_lengths(mask: torch.Tensor) -> torch.Tensor:
    """[B] int: one past each row's last nonzero position of ``mask`` (of an attention mask: the row's length)."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * positions).amax(-1)


def scored_lengths(batch: TensorBatch) -> torch.Tensor:
    """[B] int: the positions a training pass must run per row: through the row's last generated token.

    Log-probs and values are read at ``response_mask`` tokens only, each from the positions before it
    (the model is causal), so the tokens after a row's last reply (the observation a turn-limited
    episode gets after its final step: a quarter of a single-turn FrozenLake row) change no output;
    they are cut like right padding. Without a ``response_mask``: the attended length.
    """
    return row_lengths(scored_mask(batch))


def scored_mask(batch: TensorBatch) -> torch.Tensor:
    """[B, T]: the tokens a training pass scores: ``response_mask``, or every attended token of a batch
    without one (plain sequences to score)."""
    return batch["response_mask"] if "response_mask" in batch else batch["attention_mask"]


def longest_first(lengths: list[int]) -> list[int]:
    """Row indices by decreasing length; equal lengths keep their row order (deterministic)."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def prompts_together(input_ids: torch.Tensor, scored: torch.Tensor, lengths: list[int]) -> list[int]:
    """Row indices sorted by prompt (a row's tokens before its first scored one), longest first within one:
    a GRPO group's rows, then groups whose prompts begin alike, sit next to each other."""
    first = scored.bool().int().argmax(-1).tolist()
    prompts = [input_ids[i, :first[i]].tolist() for i in range(len(lengths))]
    return sorted(range(len(lengths)), key=lambda i: (prompts[i], -lengths[i], i))


def forward_positions(batch: TensorBatch, groups: list[list[int]], lengths: list[int]) -> int:
    """Token positions the forwards of these micro-batches run: each is cut to its longest row, and its
    shared prefix (:func:`shared_prefix_length`) runs for one row."""
    total = 0
    for group in groups:
        width = max(max(lengths[i] for i in group), 1)
        rows = torch.tensor(group)
        shared = shared_prefix_length(batch["input_ids"][rows, :width], scored_mask(batch)[rows, :width])
        total += shared + len(group) * (width - shared)
    return total


def token_budget_groups(lengths: list[int], max_token_len: int) -> list[list[int]]:
    """Row indices packed into groups whose padded size ``len(group) x longest`` stays within the budget.

    Longest rows first; a row longer than the budget gets a group of its own (config
    validation keeps the budget >= max_model_len, so that only happens when it is
    set on purpose). Deterministic: equal lengths keep their row order.
    """
    order = longest_first(lengths)
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * max(lengths[groups[-1][0]], 1) <= max_token_len:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_to_count(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Split the costliest groups in two until there are ``count`` (every FSDP rank must run as many)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            raise ValueError(f"cannot cut {sum(map(len, groups))} rows into {count} non-empty micro-batches")
        widest = max(splittable, key=lambda g: len(g) * max(lengths[i] for i in g))
        at = groups.index(widest)
        groups[at:at + 1] = [widest[: len(widest) // 2], widest[len(widest) // 2:]]
    return groups


def trim_padding(batch: TensorBatch, width: int) -> TensorBatch:
    """The batch with every per-token tensor ([B, T, ...]) cut to its first ``width`` columns."""
    full = batch["input_ids"].shape[1]
    tensors = {k: v[:, :width] if v.dim() >= 2 and v.shape[1] == full else v for k, v in batch.tensors.items()}
    return TensorBatch(tensors, batch.meta.copy())


def pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """[b, w] -> [b, width]: zeros appended on the right (undoes :func:`trim_padding` for outputs)."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def micro_weight(micro_mask: torch.Tensor, mini_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """The share of a micro-batch's loss in its mini-batch's loss (gradient accumulation).

    Weighting each micro-batch's ``agg_loss`` by this makes the accumulated
    gradient that of ``agg_loss`` over the whole mini-batch: token counts for
    "token-mean", counts of non-empty rows for the sequence means. Padding
    rows (all-zero mask) therefore dilute nothing; a mini-batch with no
    masked token gets weight 0 (its backward still runs, so FSDP collectives
    stay in step across ranks).
    """
    if loss_agg_mode == "token-mean":
        part, whole = micro_mask.sum(), mini_mask.sum()
    else:
        part, whole = (micro_mask.sum(-1) > 0).sum(), (mini_mask.sum(-1) > 0).sum()
    return float(part) / float(whole) if whole > 0 else 0.0


def gathered_once(model: torch.nn.Module, plan: list, backward: bool) -> Iterator:
    """``plan``'s items, each yielded while the micro-batch it holds runs through ``model`` (forward, and backward
    with ``backward``), with a one-rank FSDP2 model's parameters gathered once for all of them.

    By default FSDP2 gathers each decoder layer (on one rank: copies it, cast to the compute dtype) for every
    micro-batch's forward, frees it, gathers it again for the backward and reduces its gradient after each
    backward. On one rank the gathered copies cost no more than the model in the compute dtype, so here the
    layers stay gathered after their forward and, with ``backward``, after every backward but the last, whose
    gradients alone are reduced (FSDP2's ``set_reshard_after_forward``, ``set_reshard_after_backward``,
    ``set_requires_gradient_sync``; the unreduced gradients accumulate in float32, the reduce dtype). The same
    gradients; ``agent_trainer/checks/memory_plan.py`` counts the gathered model for one rank. Afterwards
    every unit is resharded and the defaults are back. Several ranks keep FSDP2's defaults: there the gathered
    model and its unreduced gradients would cost the memory sharding saves."""
    one_rank = isinstance(model, FSDPModule) and dist.is_initialized() and dist.get_world_size() == 1
    layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model] if one_rank else []
    if not layers:
        yield from plan
        return
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        for i, item in enumerate(plan):
            if backward:
                last = i == len(plan) - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            yield item
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
            layer.reshard()


def device_means(values: dict[str, list], device: torch.device, total: bool = False) -> dict[str, float]:
    """The mean (with ``total``: the sum) of each key's values (0-d tensors on ``device`` or numbers), read from
    the device in one copy."""
    if not values:
        return {}
    stacked = [torch.stack([torch.as_tensor(v, device=device).reshape(()).double() for v in vs])
               for vs in values.values()]
    return dict(zip(values, torch.stack([s.sum() if total else s.mean() for s in stacked]).tolist()))


@dataclass
class ScoredIndex:
    """Where a micro-batch's scored tokens are, as flat positions (no boolean mask is read on the device).

    ``targets`` [N]: the scored tokens' positions in the row-major [b, w] batch; ``hidden`` [N]: the positions
    that predict them (one column before) among :func:`run_model`'s outputs, [b, w - shared_prefix] row-major.
    Column 0 has no predicting position and is never scored."""

    targets: torch.Tensor
    hidden: torch.Tensor
    shape: tuple[int, int]

    def to(self, device: torch.device) -> ScoredIndex:
        return ScoredIndex(self.targets.to(device, non_blocking=True), self.hidden.to(device, non_blocking=True),
                           self.shape)


def scored_index(where: torch.Tensor, shared_prefix: int = 0) -> ScoredIndex:
    """:class:`ScoredIndex` of the true entries of ``where`` [b, w] (on the host: computed before the forward)."""
    where = where.bool().clone()
    where[:, 0] = False
    rows, columns = where.nonzero(as_tuple=True)
    b, w = where.shape
    return ScoredIndex(rows * w + columns, rows * (w - shared_prefix) + columns - 1 - shared_prefix, (b, w))


@dataclass
class Prepared:
    """A micro-batch made ready before the loop that runs it (:meth:`FSDPWorker.prepare`)."""

    batch: TensorBatch
    """Its tensors, on the rank's device."""
    inputs: ModelInputs
    index: ScoredIndex
    """Its scored tokens (on the device)."""
    weight: float
    """Its loss's share of its mini-batch's (:func:`micro_weight`); 0 outside an update."""

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.batch[key]

    def __contains__(self, key: str) -> bool:
        return key in self.batch

    @property
    def meta(self):
        return self.batch.meta


def _scatter(index: ScoredIndex, values: torch.Tensor) -> torch.Tensor:
    """[N] -> [b, w]: ``values`` at the scored tokens, 0 elsewhere (differentiable; no boolean mask)."""
    b, w = index.shape
    return values.new_zeros(b * w).index_copy(0, index.targets, values).view(b, w)


@dataclass
class TargetLogits:
    """The next-token logits of the positions that predict the scored tokens, and only those.

    ``logits`` [N, V] belong to the N scored tokens in row-major order (``index``): ``logits[n]`` is the
    model's output at the position before the n-th scored token, which is ``targets[n]``. Results are
    scattered back to [b, w] aligned with ``input_ids`` (the batch contract: the logit at t-1 scores token t),
    0 elsewhere.
    """

    logits: torch.Tensor
    targets: torch.Tensor
    index: ScoredIndex

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] -> [b, w]: ``values`` at the target tokens, 0 elsewhere (differentiable)."""
        return _scatter(self.index, values)

    def log_probs(self, temperature: float = 1.0) -> torch.Tensor:
        """``out[b, t] = log softmax(logits at t-1 / temperature)[input_ids[b, t]]`` on the targets."""
        logits = self.logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        return self.scatter(torch.log_softmax(logits, dim=-1).gather(-1, self.targets.unsqueeze(-1)).squeeze(-1))

    def entropy(self) -> torch.Tensor:
        """Entropy of each target's next-token distribution (at temperature 1)."""
        logp = torch.log_softmax(self.logits.float(), dim=-1)
        return self.scatter(-(logp.exp() * logp).sum(-1))

    def greedy_hits(self) -> torch.Tensor:
        """1.0 on the targets the logits' argmax predicts, else 0."""
        return self.scatter((self.logits.argmax(-1) == self.targets).float())


def _check_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    head = model.get_output_embeddings()
    if head is None:
        raise RuntimeError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None); "
                           "target_logits needs a causal LM")
    return head


def _as_index(inputs: ModelInputs, where: torch.Tensor | ScoredIndex) -> ScoredIndex:
    if isinstance(where, ScoredIndex):
        return where
    return scored_index(where.cpu(), inputs.shared_prefix).to(inputs.input_ids.device)


def _select(index: ScoredIndex) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output head's input: the hidden states [rows, w', H] at the predicting positions, [N, H]."""
    return lambda hidden: hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.hidden)


def target_logits(model: torch.nn.Module, inputs: ModelInputs, where: torch.Tensor | ScoredIndex) -> TargetLogits:
    """Run ``model`` on ``inputs``, projecting to the vocabulary only the positions that predict the scored tokens
    (``where`` [b, w], or its :class:`ScoredIndex`).

    The output projection (``lm_head``) and the log-softmax after it are a quarter of the tiny model's
    forward and backward, and their [b, w, V] float output the largest activation of a large vocabulary's;
    the trainer needs them on the generated tokens only (``response_mask``, about 12% of the main job's
    tokens). A pre-forward hook on the model's output embeddings hands them the
    selected hidden states [N, H] in place of [b, w, H] (TRL's ``logits_to_keep``, per token instead of
    a suffix). The hook lives only for this call, inside the model's own forward, so FSDP has unsharded the
    head's (tied) weights as usual. The training passes use :func:`target_scores`, which never holds [N, V].
    """
    _check_causal_lm(model)
    index = _as_index(inputs, where)
    logits = run_model(model, inputs, head_input=_select(index)).logits
    if logits.shape[:-1] != index.targets.shape:
        raise RuntimeError(f"{type(model).__name__}'s output head did not take the selected positions "
                           f"(logits {tuple(logits.shape)}); target_logits needs a model that applies "
                           f"get_output_embeddings() to its last hidden states")
    return TargetLogits(logits, inputs.input_ids.reshape(-1).index_select(0, index.targets), index)


@dataclass
class TargetScores:
    """Per scored token, [b, w] aligned with ``input_ids`` and 0 elsewhere: the taken token's log-prob at the
    temperature asked, and when asked the next-token entropy (temperature 1) and the argmax hits."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    greedy_hits: torch.Tensor | None = None


def target_scores(model: torch.nn.Module, inputs: ModelInputs, where: torch.Tensor | ScoredIndex,
                  temperature: float = 1.0, entropy: bool = False, hits: bool = False) -> TargetScores:
    """:func:`target_logits`' scores without the logits: the output head runs in chunks
    (``agent_trainer/workers/fused_head.py``), inside the model's own forward (so FSDP has unsharded its
    weights), and keeps no [N, V] tensor for the backward. Models whose logits are not the head's plain
    ``nn.Linear`` output (:func:`fusable`) take the plain path, with the same results."""
    head = _check_causal_lm(model)
    index = _as_index(inputs, where)
    if not fusable(model):
        picked = target_logits(model, inputs, index)
        return TargetScores(picked.log_probs(temperature), picked.entropy() if entropy else None,
                            picked.greedy_hits() if hits else None)
    targets = inputs.input_ids.reshape(-1).index_select(0, index.targets)
    out = {}

    def fused(hidden: torch.Tensor) -> torch.Tensor:
        out["scores"] = head_scores(hidden, head, targets, temperature, entropy, hits)
        return out["scores"][0][:, None]  # what the model returns as logits: unused

    run_model(model, inputs, head_input=_select(index), head_forward=fused)
    if "scores" not in out:
        raise RuntimeError(f"{type(model).__name__}'s forward did not call its output head "
                           "(get_output_embeddings()); target_scores needs a causal LM that applies it")
    log_prob, ent, hit = out["scores"]
    return TargetScores(_scatter(index, log_prob), _scatter(index, ent) if entropy else None,
                        _scatter(index, hit) if hits else None)
