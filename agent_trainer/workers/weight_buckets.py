"""The weight sync's unit of transfer, shared by the actor side (``agent_trainer.workers.weight_sync``, which packs) and the engine
side (``agent_trainer.workers.engines.base``, which unpacks): a bucket is named tensors packed into one flat uint8 buffer at
16-byte-aligned offsets, described by plain-list specs that pass through Ray and vLLM's msgpack encoder as data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

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
