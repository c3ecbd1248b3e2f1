"""Shared machinery of the FSDP2 workers: process group, sharding, micro-batching.

Each worker is a plain class (testable without Ray) holding one rank of a
``torch.distributed`` process group. The model is wrapped with FSDP2's
``fully_shard``: every decoder layer, then the root, so parameters are
sharded across ranks and all-gathered layer by layer in forward/backward.
gloo on CPU, NCCL on GPU; the code path is the same.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from agent_trainer.batch import TensorBatch
from agent_trainer.config import FSDPConfig, OptimConfig


def pick_device(device: str) -> torch.device:
    """``auto`` is CUDA when a GPU is visible to this process, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


@dataclass
class ModelInputs:
    """The three tensors a causal LM forward needs."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor


class FSDPWorker:
    """One rank of an FSDP2 worker group (base of the actor and critic workers)."""

    def __init__(self, *, rank: int, world_size: int, fsdp: FSDPConfig, device: str = "auto") -> None:
        self.rank = rank
        self.world_size = world_size
        self.fsdp_config = fsdp
        self.device = pick_device(device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, fsdp.num_threads))
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    # -- process group -------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port for the process-group rendezvous (rank 0 only)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        import ray  # only meaningful inside a Ray worker

        return ray.util.get_node_ip_address(), port

    def init_distributed(self, master_addr: str, master_port: int, backend: str) -> None:
        """Join the group's process group (every rank must call this concurrently)."""
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=timedelta(minutes=10))

    # -- model ---------------------------------------------------------------------------
    def shard_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply FSDP2: each decoder layer is its own unit, then the root module."""
        model.to(self.device)
        if dist.is_initialized():
            for layer in _decoder_layers(model):
                fully_shard(layer)
            fully_shard(model)
        return model

    def build_optimizer(self, optim: OptimConfig) -> None:
        """AdamW with a linear warm-up schedule."""
        assert self.model is not None  # internal: called after the model is built
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
        )
        warmup = max(0, optim.warmup_steps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

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
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    # -- batches -------------------------------------------------------------------------
    def model_inputs(self, batch: TensorBatch) -> ModelInputs:
        """Move the forward inputs of ``batch`` to this rank's device."""
        return ModelInputs(
            input_ids=batch["input_ids"].to(self.device),
            attention_mask=batch["attention_mask"].to(self.device),
            position_ids=batch["position_ids"].to(self.device),
        )


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM / token classifier."""
    for attr in ("model", "transformer"):
        base = getattr(model, attr, None)
        if base is not None:
            layers = getattr(base, "layers", None) or getattr(base, "h", None)
            if layers is not None:
                return list(layers)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def micro_batches(batch: TensorBatch, size: int) -> list[TensorBatch]:
    """Consecutive micro-batches of ``size`` rows."""
    return batch.split(max(1, size))


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


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]``; column 0 is 0.

    Aligned with ``input_ids`` (the batch contract): the logit at position
    t-1 predicts token t.
    """
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution, aligned like :func:`token_log_probs`."""
    logits = logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0))
