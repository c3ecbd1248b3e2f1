"""The training batch: named tensors that share their first (row) dimension.

A small, typed stand-in for verl's ``DataProto``. Every value is a
``torch.Tensor`` whose first dimension is the number of rows ``B``; per-token
values are ``[B, T]`` over the whole sequence (prompt and every turn). The
keys follow the batch contract in ``docs/architecture.md``:

| key | shape | meaning |
| --- | --- | --- |
| input_ids, attention_mask, position_ids | [B, T] | the whole sequence |
| response_mask | [B, T] | 1 exactly on tokens the policy generated |
| token_level_rewards | [B, T] | each turn's reward on its last generated token |
| uid, traj_uid | [B] int64 | group id / trajectory id |
| tag_ids | [B] int64 | env tag index within the batch |
| turn_ids | [B, T] int64 | 0 on the prompt, k on turn k's reply and the observation after it |
| anchor_obs_ids | [B, T] int64 (one row per turn: [B]) | hashed observation each turn answered (GiGPO) |
| reward_baselines | [B] | ReMax only: reward of the group's greedy episode |
| rollout_log_probs | [B, T] | logprobs the rollout engine reported (0 elsewhere) |
| old_log_probs, ref_log_prob, values, advantages, returns | [B, T] | filled later |

Log-prob tensors are aligned with ``input_ids``: ``old_log_probs[b, t]`` is
``log p(input_ids[b, t] | input_ids[b, :t])`` on the generated tokens (``response_mask``)
and 0 elsewhere, like ``rollout_log_probs``: the actor projects only those positions to the
vocabulary (``agent_trainer.workers.fsdp_base.target_logits``). Column 0 is 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class BatchMeta:
    """A batch's values that are not per-row data; they travel with it to the workers (pickled by Ray), and are
    never written to disk. A batch's slices and copies carry a copy (:meth:`copy`)."""

    temperature: float = 1.0
    """The rollout's sampling temperature (1.0 for a greedy rollout): the actor's log-probs divide the logits by
    it, as the engine did."""
    group_seeds: list[int] = field(default_factory=list)
    """The seed each group (``uid``) of the rollout was reset with, for error messages naming an episode;
    empty for a batch no rollout built."""
    seq_len: int | None = None
    """A micro-batch's uncut width (``agent_trainer.workers.fsdp_base.plan_micro_batches``): the sequence length the
    loss normalises by (``seq-mean-token-sum-norm``); None on a whole batch."""
    progress: float | None = None
    """The run's progress at the update this batch feeds, in [0, 1): (step - 1) / total steps (the trainer's, or
    the SFT's optimizer steps); a ``cosine`` learning-rate schedule follows it (``OptimConfig``). None: the
    learning rate stays where it is (a batch no fit loop built)."""
    two_calls: bool | None = None
    """Whether every rank runs this micro-batch in two model calls (a shared prompt prefix), agreed over the
    ranks; None: decided on the rank alone."""

    def copy(self) -> BatchMeta:
        return dataclasses.replace(self, group_seeds=list(self.group_seeds))


@dataclass
class TensorBatch:
    """Named tensors with a common first dimension, plus the batch's :class:`BatchMeta` (``meta``)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: BatchMeta = field(default_factory=BatchMeta)

    def __post_init__(self) -> None:
        if isinstance(self.meta, Mapping):  # a plain mapping names BatchMeta's fields
            self.meta = BatchMeta(**self.meta)
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"TensorBatch tensors must share their first dimension, got {sizes}")

    def __len__(self) -> int:
        for value in self.tensors.values():
            return value.shape[0]
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.tensors and value.shape[0] != len(self):
            raise ValueError(f"cannot set {key!r} with {value.shape[0]} rows on a batch of {len(self)} rows")
        self.tensors[key] = value

    def keys(self) -> Iterator[str]:
        """The tensor names."""
        return iter(self.tensors)

    def select(self, keys: Iterable[str]) -> TensorBatch:
        """A batch with only ``keys`` (the tensors are shared, not copied)."""
        return TensorBatch({k: self.tensors[k] for k in keys}, self.meta.copy())

    def update(self, other: TensorBatch | Mapping[str, torch.Tensor]) -> TensorBatch:
        """Add (or overwrite) the tensors of ``other``; returns ``self``."""
        items = other.tensors if isinstance(other, TensorBatch) else other
        for key, value in items.items():
            self[key] = value
        return self

    def index(self, rows: torch.Tensor | list[int]) -> TensorBatch:
        """The rows ``rows`` (an index list or a boolean mask), in that order."""
        rows = torch.as_tensor(rows)
        return TensorBatch({k: v[rows] for k, v in self.tensors.items()}, self.meta.copy())

    def split(self, size: int) -> list[TensorBatch]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        n = len(self)
        return [self.index(torch.arange(i, min(i + size, n))) for i in range(0, n, size)]

    def chunk(self, parts: int) -> list[TensorBatch]:
        """``parts`` chunks of near-equal size (sizes differ by at most one)."""
        n = len(self)
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        return [self.index(torch.arange(bounds[i], bounds[i + 1])) for i in range(parts)]

    @staticmethod
    def concat(batches: list[TensorBatch]) -> TensorBatch:
        """Concatenate batches row-wise; keys must match; ``meta`` of the first is kept."""
        batches = [b for b in batches if len(b) > 0] or batches[:1]
        keys = list(batches[0].tensors)
        for b in batches[1:]:
            if list(b.tensors) != keys:
                raise ValueError(f"cannot concat batches with keys {keys} and {list(b.tensors)}")
        return TensorBatch({k: torch.cat([b.tensors[k] for b in batches]) for k in keys}, batches[0].meta.copy())

    def pad_to_multiple(self, multiple: int) -> tuple[TensorBatch, int]:
        """Append copies of the first rows until the length is a multiple of ``multiple``.

        Returns the padded batch (``self`` when nothing was added) and the
        number of rows appended, which sit at the end.
        """
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty batch")
        pad = (-n) % multiple
        if pad == 0:
            return self, 0
        return TensorBatch.concat([self, self.index(torch.arange(pad) % n)]), pad

    def to(self, device: torch.device | str) -> TensorBatch:
        """A copy with every tensor on ``device``."""
        return TensorBatch({k: v.to(device) for k, v in self.tensors.items()}, self.meta.copy())
