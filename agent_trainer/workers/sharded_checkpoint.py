"""Sharded checkpoints of FSDP2 models: every rank writes its own shards, nothing is gathered or pickled.

Layout of one model part (``global_step_N/actor``, ``.../critic``)::

    shards/index.json                                  JSON, written by rank 0 (the format below)
    shards/model-rank00000-of-00002.safetensors        rank 0's rows of every parameter
    shards/optim-rank00000-of-00002.safetensors        rank 0's rows of every optimizer state (exp_avg, exp_avg_sq),
                                                       and the replicated ones (step)
    shards/model-rank00001-of-00002.safetensors ...    the same for every other rank

FSDP2 shards each parameter on dim 0 with ``torch.chunk`` semantics: with ``W`` ranks and ``n``
rows, rank ``r`` holds rows ``[min(r*c, n), min((r+1)*c, n))`` with ``c = ceil(n / W)``, so the
last ranks may hold fewer rows, or none (:func:`chunk_rows`). A rank writes its local shard
(``DTensor.to_local()``) of each parameter and of each optimizer state tensor; tensors that are
not sharded (Adam's ``step``, buffers, a model outside a process group) are written whole by
every rank, so a run resumed at the same world size reads only its own two files.

``index.json``::

    {"format": "agent_trainer.sharded", "version": 1, "world_size": 2,
     "architecture": "Qwen2ForCausalLM",
     "tensors": {"model/<name>": {"key": "<name>", "shape": [1789, 128], "dtype": "float32",
                                  "sharding": "dim0",
                                  "pieces": [{"file": "model-rank00000-of-00002.safetensors", "rows": [0, 895]},
                                             {"file": "model-rank00001-of-00002.safetensors", "rows": [895, 1789]}]},
                 "optim/step/<name>": {"key": "step/<name>", "shape": [], "dtype": "float32",
                                       "sharding": "replicated", "on_param_device": false,
                                       "pieces": [{"file": "optim-rank00000-of-00002.safetensors", "rows": null}, ...]},
                 ...},
     "aliases": {"lm_head.weight": "model.embed_tokens.weight"},        tied weights, stored once
     "optimizer": {"param_groups": [{"lr": ..., "betas": [...], "params": ["<name>", ...]}],
                   "state_keys": {"<name>": ["step", "exp_avg", "exp_avg_sq"]},
                   "scalars": {"<name>": {"<key>": <number>}}}}

A ``dim0`` tensor's pieces list which file holds which rows (empty shards are not written); a
``replicated`` tensor's pieces are whole copies. Loading at any world size computes this
rank's rows and reads just them (``safe_open(...).get_slice``), from whichever files hold them:
no rank ever holds more than its own shard, and the HF export (:func:`write_hf_weights`) holds
one full tensor at a time. Files are written with :func:`write_safetensors`, which streams one
tensor at a time to disk (the standard safetensors format; ``safetensors.safe_open`` reads it).

This module needs torch and safetensors only (no Ray, no process group for reading), so
``python -m agent_trainer.export`` runs anywhere.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

FORMAT = "agent_trainer.sharded"
VERSION = 1
SHARDS_DIR = "shards"
INDEX_FILE = "index.json"
ADAPTER_KEY = "adapter_only"
"""``index.json``'s flag (true) of a checkpoint holding a LoRA adapter's parameters only, not the model."""
HF_MAX_FILE_BYTES = 5 * 1024**3
"""The HF folder's weights are split into files of at most this size (Hugging Face's default, 5 GB)."""

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in _ST_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r} (one of {sorted(_DTYPE_NAMES)})")
    return _DTYPE_NAMES[name]


def shard_file(kind: str, rank: int, world_size: int) -> str:
    """``model-rank00000-of-00002.safetensors`` (``kind``: model or optim)."""
    return f"{kind}-rank{rank:05d}-of-{world_size:05d}.safetensors"


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of dim 0 that ``rank`` holds under ``torch.chunk`` (FSDP2's sharding); may be empty."""
    size = math.ceil(rows / world_size) if rows else 0
    lo = min(rank * size, rows)
    return lo, min(lo + size, rows)


# --------------------------------------------------------------------------- safetensors, streamed


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensor_of: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file one tensor at a time; return the bytes written.

    ``specs`` (name, shape, dtype) fixes the header before any data is produced, so only the tensor
    being written is held in memory (``tensor_of(name)``, called once per name, in order; it may live
    on any device). The file is written under a temporary name and renamed.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in specs:
            tensor = tensor_of(name).detach()
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, declared {tuple(shape)} {dtype}")
            if tensor.numel():
                f.write(tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    os.replace(tmp, path)
    return 8 + len(raw) + offset


class ShardReader:
    """Reads rows of the tensors an index describes; files are opened lazily (memory-mapped) and kept open."""

    def __init__(self, folder: Path, index: dict | None = None):
        self.folder = Path(folder)
        self.index = index if index is not None else read_index(self.folder)
        self._open: dict[str, Any] = {}

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            self._open[name] = safe_open(str(self.folder / name), framework="pt", device="cpu")
        return self._open[name]

    def rows(self, entry: dict, lo: int | None = None, hi: int | None = None, prefer_file: str | None = None
             ) -> torch.Tensor:
        """Rows ``[lo, hi)`` of dim 0 of the tensor ``entry`` describes (the whole tensor when ``lo`` is None)."""
        shape = entry["shape"]
        if not shape:  # a 0-dim tensor (Adam's step): replicated, read whole
            piece = _preferred(entry["pieces"], prefer_file)
            return self._file(piece["file"]).get_tensor(entry["key"])
        if lo is None:
            lo, hi = 0, shape[0]
        if entry["sharding"] == "replicated":
            piece = _preferred(entry["pieces"], prefer_file)
            return self._file(piece["file"]).get_slice(entry["key"])[lo:hi]
        parts = []
        for piece in entry["pieces"]:
            a, b = piece["rows"]
            x, y = max(a, lo), min(b, hi)
            if x < y:
                parts.append(self._file(piece["file"]).get_slice(entry["key"])[x - a:y - a])
        got = sum(p.shape[0] for p in parts)
        if got != hi - lo:
            raise ValueError(f"{self.folder}: rows {lo}:{hi} of {entry['key']} are not all in the shard files "
                             f"(found {got}); the checkpoint is incomplete")
        if not parts:
            return torch.empty((0, *shape[1:]), dtype=dtype_of(entry["dtype"]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _preferred(pieces: list[dict], prefer_file: str | None) -> dict:
    return next((p for p in pieces if p["file"] == prefer_file), pieces[0])


def read_index(folder: Path) -> dict:
    """The JSON index of a ``shards/`` folder, checked for its format."""
    index = json.loads((Path(folder) / INDEX_FILE).read_text())
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{folder}/{INDEX_FILE} is not a {FORMAT} v{VERSION} index "
                         f"(format {index.get('format')!r}, version {index.get('version')!r})")
    return index


def has_shards(folder: Path) -> bool:
    """Whether a model part folder holds a sharded checkpoint."""
    return (Path(folder) / SHARDS_DIR / INDEX_FILE).is_file()


# --------------------------------------------------------------------------- live tensors


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, str, int, int]:
    """(the local tensor, sharding, mesh size, mesh rank) of a parameter or state tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor, "replicated", 1, 0
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim == 1 and placements == (Shard(0),):
        return tensor.to_local(), "dim0", mesh.size(), mesh.get_local_rank()
    if all(isinstance(p, Replicate) for p in placements):
        return tensor.to_local(), "replicated", 1, 0
    raise NotImplementedError(f"sharded checkpoints support FSDP2's dim-0 sharding on a 1-D mesh; got "
                              f"{placements} on a {mesh.ndim}-D mesh")


def _target_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None, int | None]:
    """(the local tensor to fill, and the global rows ``[lo, hi)`` it holds; None for a whole tensor)."""
    local, sharding, world, rank = _local(tensor)
    if sharding == "replicated" or tensor.dim() == 0:
        return local, None, None
    lo, hi = chunk_rows(tensor.shape[0], world, rank)
    if local.shape[0] != hi - lo:
        raise NotImplementedError(f"a shard of {hi - lo} rows was expected (torch.chunk over {world} ranks), "
                                  f"this rank holds {local.shape[0]}")
    return local, lo, hi


def model_entries(model: torch.nn.Module, keep: Callable[[str], bool] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors a checkpoint holds (parameters once, persistent buffers) and the tied names' aliases; with
    ``keep``, only the names it accepts (a LoRA adapter's: :data:`ADAPTER_KEY`)."""
    if keep is not None:
        return {name: param for name, param in model.named_parameters() if keep(name)}, {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
            tensors[name] = param
    for name in model.state_dict():
        if name not in tensors and name not in aliases:
            tensors[name] = model.get_buffer(name)
    return tensors, aliases


def architecture(model: torch.nn.Module) -> str:
    """The transformers class name of a (possibly FSDP2-wrapped) model: ``Qwen2ForCausalLM``."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


# --------------------------------------------------------------------------- save


def _describe(tensor: torch.Tensor, key: str, kind: str, rank: int, world_size: int) -> tuple[dict, torch.Tensor]:
    """This tensor's index entry (every rank computes the same) and this rank's local part to write."""
    local, sharding, mesh_size, mesh_rank = _local(tensor)
    entry: dict[str, Any] = {"key": key, "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype),
                             "sharding": sharding}
    if sharding == "dim0":
        if (mesh_size, mesh_rank) != (world_size, rank):
            raise NotImplementedError(f"{key} is sharded over {mesh_size} ranks (this one {mesh_rank}); the worker "
                                      f"is rank {rank} of {world_size}")
        lo, hi = chunk_rows(tensor.shape[0], world_size, rank)
        if local.shape[0] != hi - lo:
            raise NotImplementedError(f"{key}: a shard of {hi - lo} rows was expected (torch.chunk over {world_size} "
                                      f"ranks), rank {rank} holds {local.shape[0]}")
        entry["pieces"] = [{"file": shard_file(kind, r, world_size), "rows": list(rows)}
                           for r in range(world_size) if (rows := chunk_rows(tensor.shape[0], world_size, r))[1] > rows[0]]
    else:
        entry["pieces"] = [{"file": shard_file(kind, r, world_size), "rows": None} for r in range(world_size)]
    return entry, local


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, folder: Path, rank: int,
         world_size: int, keep: Callable[[str], bool] | None = None) -> dict[str, int]:
    """Write this rank's shards into ``folder/shards`` (every rank calls; no collective). Returns bytes per file.

    ``keep`` (a LoRA model: ``agent_trainer.workers.lora.is_adapter_tensor``): only the parameters it accepts are saved
    (the frozen base comes from ``model_path`` again), and ``index.json`` says so (:data:`ADAPTER_KEY`).

    Rank 0 also writes ``index.json``. Each rank holds one tensor at a time beyond the model and optimizer.
    Every FSDP unit is resharded first: FSDP2 leaves the root unit gathered after a forward without backward (a
    log-prob pass), and its parameters must be saved, and stay, as the rank's shards.
    """
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()  # a no-op for a unit that is sharded
    out = Path(folder) / SHARDS_DIR
    out.mkdir(parents=True, exist_ok=True)
    entries, aliases = model_entries(model, keep)
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "world_size": world_size,
                             "architecture": architecture(model), "tensors": {}, "aliases": aliases}
    if keep is not None:
        index[ADAPTER_KEY] = True
    written: dict[str, int] = {}

    def write(kind: str, named: Iterable[tuple[str, torch.Tensor, dict]]) -> None:
        specs, locals_ = [], {}
        for name, tensor, extra in named:
            entry, local = _describe(tensor, name, kind, rank, world_size)
            index["tensors"][f"{kind}/{name}"] = {**entry, **extra}
            if entry["sharding"] == "replicated" or local.shape[0]:  # empty shards are not written
                specs.append((name, tuple(local.shape), local.dtype))
                locals_[name] = local
        file = shard_file(kind, rank, world_size)
        written[file] = write_safetensors(out / file, specs, locals_.__getitem__, {"format": "pt"})

    write("model", ((name, tensor, {}) for name, tensor in entries.items()))
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        groups, state_keys, scalars, states = [], {}, {}, []
        for group in optimizer.param_groups:
            groups.append({**{k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"},
                           "params": [names[id(p)] for p in group["params"]]})
            for param in group["params"]:
                state = optimizer.state.get(param)
                if not state:
                    continue
                name = names[id(param)]
                state_keys[name] = list(state)
                for key, value in state.items():
                    if torch.is_tensor(value):
                        on_param_device = value.device == param.device
                        states.append((f"{key}/{name}", value, {"on_param_device": on_param_device}))
                    else:
                        scalars.setdefault(name, {})[key] = value
        write("optim", states)
        index["optimizer"] = {"param_groups": groups, "state_keys": state_keys, "scalars": scalars}
    if rank == 0:
        tmp = out / f".{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, out / INDEX_FILE)
    return written


# --------------------------------------------------------------------------- load


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, folder: Path, rank: int,
         world_size: int, keep: Callable[[str], bool] | None = None) -> None:
    """Fill this rank's shards of the model (and optimizer) from ``folder/shards`` (every rank; no collective).

    At the saving world size each rank reads its own files; at another, each rank reads its rows
    from the files that hold them. Raises ValueError when the checkpoint does not fit the model. ``keep``: as in
    :func:`save` (a LoRA adapter's checkpoint fills the adapter only, and only a LoRA model reads one).
    """
    src = Path(folder) / SHARDS_DIR
    index = read_index(src)
    if bool(index.get(ADAPTER_KEY)) != (keep is not None):
        saved, this = ("a LoRA adapter", "a full model") if index.get(ADAPTER_KEY) else ("a full model", "LoRA")
        raise ValueError(f"checkpoint {folder} holds {saved} but this run trains {this}: resume with the "
                         "actor_rollout_ref.model.lora_rank it was saved with, or start over "
                         "(trainer.resume_mode=disable)")
    reader = ShardReader(src, index)
    same_world = index["world_size"] == world_size
    own = {kind: shard_file(kind, rank, world_size) if same_world else None for kind in ("model", "optim")}
    tensors = index["tensors"]
    entries, _ = model_entries(model, keep)
    saved_alias = index.get("aliases", {})

    def model_entry(name: str) -> dict | None:
        return tensors.get(f"model/{name}") or tensors.get(f"model/{saved_alias.get(name, '')}")

    missing = sorted(name for name in entries if model_entry(name) is None)
    if missing:
        raise ValueError(f"checkpoint {folder} lacks weights {missing[:8]} for this model")
    with torch.no_grad():
        for name, tensor in entries.items():
            _fill(reader, model_entry(name), tensor, own["model"], name)
        if optimizer is None:
            return
        if "optimizer" not in index:
            raise ValueError(f"checkpoint {folder} holds no optimizer state")
        saved = index["optimizer"]
        names = {id(p): n for n, p in model.named_parameters()}
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint {folder} has {len(saved['param_groups'])} optimizer param groups, "
                             f"this optimizer {len(optimizer.param_groups)}")
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            if [names[id(p)] for p in group["params"]] != saved_group["params"]:
                raise ValueError(f"checkpoint {folder}: the optimizer's parameters differ from this model's")
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
            for param in group["params"]:
                name = names[id(param)]
                optimizer.state.pop(param, None)
                if name not in saved["state_keys"]:
                    continue
                state: dict[str, Any] = dict(saved["scalars"].get(name, {}))
                for key in saved["state_keys"][name]:
                    if key in state:
                        continue
                    entry = tensors[f"optim/{key}/{name}"]
                    if entry["sharding"] == "dim0" or (entry["shape"] and entry["shape"] == list(param.shape)):
                        value = torch.zeros_like(param, dtype=dtype_of(entry["dtype"]))  # the parameter's sharding
                        _fill(reader, entry, value, own["optim"], f"{key}/{name}")
                    else:
                        value = reader.rows(entry, prefer_file=own["optim"]).clone()
                        if entry.get("on_param_device"):
                            value = value.to(_local(param)[0].device)
                    state[key] = value
                optimizer.state[param] = state


def _fill(reader: ShardReader, entry: dict, target: torch.Tensor, own_file: str | None, name: str) -> None:
    if list(target.shape) != entry["shape"]:
        raise ValueError(f"checkpoint {reader.folder.parent}: {name} has shape {entry['shape']}, this model "
                         f"{list(target.shape)}")
    local, lo, hi = _target_rows(target)
    local.copy_(reader.rows(entry, lo, hi, prefer_file=own_file))


# --------------------------------------------------------------------------- Hugging Face weights


def write_hf_weights(shards: Path, out: Path, dtype: torch.dtype | None = None,
                     max_file_bytes: int = HF_MAX_FILE_BYTES) -> list[Path]:
    """Assemble a Hugging Face folder's weights from ``shards`` into ``out``, one full tensor in memory at a time.

    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most ``max_file_bytes``
    plus ``model.safetensors.index.json``. Tied weights are written once (under the name the model
    owns them by), as ``save_pretrained`` does. ``dtype`` casts floating tensors (default: as saved).
    """
    index = read_index(shards)
    if index.get(ADAPTER_KEY):
        raise ValueError(f"{shards.parent} holds a LoRA adapter only, not the model's weights: its "
                         "adapter_config.json and adapter_model.safetensors (written with trainer.save_hf_model) load "
                         "onto the base model with peft.PeftModel.from_pretrained")
    reader = ShardReader(shards, index)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for name, entry in index["tensors"].items():
        if not name.startswith("model/"):
            continue
        saved = dtype_of(entry["dtype"])
        target = dtype if dtype is not None and saved.is_floating_point else saved
        specs.append((entry["key"], tuple(entry["shape"]), target))
    files: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * torch.empty((), dtype=spec[2]).element_size()
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += nbytes
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    by_key = {entry["key"]: entry for name, entry in index["tensors"].items() if name.startswith("model/")}
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    total = 0
    for file, group in zip(names, files):
        dtypes = {key: target for key, _, target in group}
        total += write_safetensors(out / file, group, lambda key: reader.rows(by_key[key]).to(dtypes[key]),
                                   {"format": "pt"})
    if len(files) > 1:
        weight_map = {spec[0]: file for file, group in zip(names, files) for spec in group}
        total_size = sum(math.prod(s[1]) * torch.empty((), dtype=s[2]).element_size() for s in specs)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
    return [out / name for name in names]


def write_hf_config(model: torch.nn.Module, out: Path) -> None:
    """``config.json`` (and ``generation_config.json``) of a live model, as ``save_pretrained`` writes them.

    ``architectures`` names the model's class (``...ForTokenClassification`` for the critic) and
    ``dtype`` the dtype of its floating parameters, the dtype the weights are saved in.
    """
    import copy

    config = copy.deepcopy(model.config)
    config.architectures = [architecture(model)]
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if floating:
        config.dtype = floating[0]
    config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(str(out))
