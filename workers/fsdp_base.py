"""Shared machinery of the FSDP2 workers: process group, sharding, micro-batching.

Each worker is a plain class (testable without Ray) holding one rank of a
``torch.distributed`` process group. The model is wrapped with FSDP2's
``fully_shard``: every decoder layer, then the root, so parameters are
sharded across ranks and all-gathered layer by layer in forward/backward.
gloo on CPU, NCCL on GPU; the code path is the same.
"""

from __future__ import annotations

import contextlib
import socket
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import DynamicCache

from agent_trainer import checkpoint
from agent_trainer.batch import TensorBatch
from agent_trainer.config import FSDPConfig, OptimConfig


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``*.model.dtype`` -> the torch dtype weights are loaded in."""


def scalar(value) -> float:
    """A detached Python float from a tensor or number (metrics only)."""
    return float(value.detach()) if torch.is_tensor(value) else float(value)


def pick_device(device: str) -> torch.device:
    """``auto`` is CUDA when a GPU is visible to this process, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


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
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=timeout_s)
        listener = getattr(self, "_rendezvous_listener", None)  # set on rank 0 by rendezvous_address
        store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=listener is not None,
                              timeout=timeout, master_listen_fd=listener.detach() if listener else None)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)

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
        return gather_full_weights(self.model, keep=self.rank == 0)

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path: str, role: str | None = None) -> None:
        """Write this role's full state under ``path`` (every rank calls, concurrently).

        ``role`` names the model for a process that hosts several (``ActorWorker`` with a colocated
        critic); a worker of one role has nothing to choose.

        Rank 0 writes the weights as a Hugging Face folder (safetensors; loadable by
        ``from_pretrained`` and vLLM), the optimizer's full state (tensors in
        ``optim/optimizer.safetensors``, the rest in ``optim/optimizer.json``) and the
        LR scheduler (``optim/lr_scheduler.json``); every rank writes its RNG state
        (``rng/rank_<r>.json``). Nothing is pickled.
        """
        assert self.model is not None and self.hf_auto_class is not None  # internal: after init_model
        out = Path(path)
        state = self.full_state_dict()
        optim = self.full_optimizer_state_dict() if self.optimizer is not None else None
        checkpoint.write_json(out / "rng" / f"rank_{self.rank}.json", checkpoint.rng_state())
        if self.rank != 0:
            return
        with torch.random.fork_rng(devices=[]):  # building the HF shell draws random init: keep the run's RNG
            model = self.hf_auto_class.from_config(self.model.config)
        model.load_state_dict(state, strict=False)
        model.save_pretrained(str(out))
        if optim is not None:
            tensors, meta = checkpoint.flatten_optimizer_state(optim)
            (out / "optim").mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / "optim" / "optimizer.safetensors"))
            checkpoint.write_json(out / "optim" / "optimizer.json", meta)
            checkpoint.write_json(out / "optim" / "lr_scheduler.json", self.lr_scheduler.state_dict())

    def load_checkpoint(self, path: str, role: str | None = None) -> None:
        """Restore what :meth:`save_checkpoint` wrote (every rank calls, concurrently; ``role`` as there).

        Each rank reads the full state dicts and keeps its shards
        (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
        ``full_state_dict=True``), so the world size may differ from the saving run's.
        On more than one node ``path`` must be on storage every node sees.
        """
        assert self.model is not None
        src = Path(path)
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
            self.lr_scheduler.load_state_dict(checkpoint.read_json(src / "optim" / "lr_scheduler.json"))
        rng_file = src / "rng" / f"rank_{self.rank}.json"
        if rng_file.exists():  # a run resumed on more ranks than it saved keeps its fresh seeds there
            checkpoint.set_rng_state(checkpoint.read_json(rng_file))

    def full_optimizer_state_dict(self) -> dict:
        """The optimizer's unsharded state on CPU, keyed by parameter name (collective, like the weights)."""
        if not dist.is_initialized():
            return get_optimizer_state_dict(self.model, self.optimizer)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

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
        ``meta["seq_len"]``, the uncut width, the sequence length the loss normalises by.
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
            micro.meta["seq_len"] = full
            plan.append((rows, micro))
        if self.world_size > 1 and prefix_sharing_supported(self.model):
            # FSDP gathers each unit once per model call: micro-batch k runs two calls on every rank or on none
            wanted = [float(self.layout(micro, two_calls=True).model_calls == 2) for _, micro in plan]
            for (_, micro), agreed in zip(plan, self._over_ranks(wanted, dist.ReduceOp.MIN)):
                micro.meta["two_calls"] = bool(agreed)
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

    @torch.no_grad()
    def forward_rows(self, batch: TensorBatch, batching: MicroBatching,
                     per_token: Callable[[TensorBatch], torch.Tensor]) -> torch.Tensor:
        """``per_token(micro)`` ([b, w] each) over the micro-batches, as one [B, T] tensor in row order on CPU."""
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for rows, micro in self.plan_micro_batches(batch, batching):
            out[rows] = pad_columns(per_token(micro).float().cpu(), out.shape[1])
        return out

    def run_update(self, batch: TensorBatch, *, epochs: int, mini_batch_size: int, batching: MicroBatching,
                   loss_agg_mode: str, grad_clip: float, micro_loss: Callable[[TensorBatch], tuple],
                   prefix: str) -> dict[str, float]:
        """The PPO update loop shared by the actor and the critic: epochs x mini-batches x micro-batches.

        Each mini-batch is one optimizer step; each micro-batch's loss (``micro_loss``
        returns it with its metrics) is weighted by its share of the mini-batch
        (:func:`micro_weight`) before backward, so the accumulated gradient is the
        mini-batch loss's whatever the micro-batching. Returns the metrics averaged over
        micro-batches, and ``<prefix>/grad_norm`` averaged over optimizer steps.
        """
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(epochs):
            for mini in batch.split(mini_batch_size):
                for _, micro in self.plan_micro_batches(mini, batching):
                    loss, micro_metrics = micro_loss(micro)
                    (loss * micro_weight(micro["response_mask"], mini["response_mask"], loss_agg_mode)).backward()
                    for key, value in micro_metrics.items():
                        metrics[key].append(value)
                metrics[f"{prefix}/grad_norm"].append(self.optimizer_step(grad_clip))
        return {k: sum(v) / len(v) for k, v in metrics.items()}

    def precision(self) -> contextlib.AbstractContextManager:
        """The context every forward of this role runs in: ``torch.autocast`` to bfloat16 with
        ``fsdp.mixed_precision: bf16`` (backward follows the forward's dtypes), else nothing."""
        if self.fsdp_config.mixed_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

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
        )

    def layout(self, batch: TensorBatch, two_calls: bool | None = None) -> Layout:
        """:func:`choose_layout` for right-padded rows; two model calls (``two_calls`` None) only where every
        rank's micro-batch allows them (``meta["two_calls"]``, from :meth:`plan_micro_batches`), or on one rank."""
        if not prefix_sharing_supported(self.model):
            return Layout()
        if two_calls is None:
            two_calls = batch.meta.get("two_calls", self.world_size == 1)
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
              head_input: Callable[[torch.Tensor], torch.Tensor] | None = None):
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

    With ``inputs.suffix_lengths`` the prefix and the rows' spans after it run packed in one row
    (:func:`_run_packed`); callers see the same ``[rows, width - L, ...]`` outputs either way.
    """
    length = inputs.shared_prefix
    if not length:
        with _output_head_input(model, head_input):
            return model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                         position_ids=inputs.position_ids)
    if inputs.suffix_lengths is not None:
        return _run_packed(model, inputs, head_input)
    prefix = (inputs.input_ids[:1, :length], inputs.position_ids[:1, :length])
    if torch.is_grad_enabled():
        keys_values = torch.utils.checkpoint.checkpoint(_prefix_keys_values, model, *prefix, use_reentrant=False)
    else:
        keys_values = _prefix_keys_values(model, *prefix)
    rows = inputs.input_ids.shape[0]
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in enumerate(zip(keys_values[0::2], keys_values[1::2])):
        cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer)
    with _output_head_input(model, head_input):
        return model(input_ids=inputs.input_ids[:, length:], position_ids=inputs.position_ids[:, length:],
                     past_key_values=cache)


def _run_packed(model: torch.nn.Module, inputs: ModelInputs, head_input: Callable | None):
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
        with _output_head_input(model, head_input):
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
def _output_head_input(model: torch.nn.Module, select: Callable[[torch.Tensor], torch.Tensor] | None):
    """Inside the block, ``model``'s output head (``get_output_embeddings()``, when it has one) gets
    ``select(hidden_states)`` in place of its input. The hook lives inside the model's own forward,
    so FSDP has unsharded the head's (tied) weights as usual."""
    head = model.get_output_embeddings() if select is not None else None
    if head is None:
        yield
        return
    hook = head.register_forward_pre_hook(lambda _module, args: (select(args[0]), *args[1:]))
    try:
        yield
    finally:
        hook.remove()


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
    return TensorBatch(tensors, dict(batch.meta))


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


@dataclass
class TargetLogits:
    """The next-token logits of the positions that predict the tokens at ``where``, and only those.

    ``logits`` [N, V] belong to the N true entries of ``where`` [b, w] in row-major order:
    ``logits[n]`` is the model's output at the position before the n-th target token, which
    is ``targets[n]``. Results are scattered back to [b, w] aligned with ``input_ids`` (the
    batch contract: the logit at t-1 scores token t), 0 where ``where`` is false.
    """

    logits: torch.Tensor
    targets: torch.Tensor
    where: torch.Tensor

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] -> [b, w]: ``values`` at the target tokens, 0 elsewhere (differentiable)."""
        zeros = torch.zeros(self.where.shape, dtype=values.dtype, device=values.device)
        return zeros.masked_scatter(self.where, values)

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


def target_logits(model: torch.nn.Module, inputs: ModelInputs, where: torch.Tensor) -> TargetLogits:
    """Run ``model`` on ``inputs``, projecting to the vocabulary only the positions that predict ``where``'s tokens.

    The output projection (``lm_head``) and the log-softmax after it are a quarter of the tiny model's
    forward and backward, and their [b, w, V] float output the largest activation of a large vocabulary's;
    the trainer needs them on the generated tokens only (``response_mask``, about 12% of the main job's
    tokens). A pre-forward hook on the model's output embeddings hands them the
    selected hidden states [N, H] in place of [b, w, H] (TRL's ``logits_to_keep``, per token instead of
    a suffix). Column 0 has no predicting position and is never a target. The hook lives only for this
    call, inside the model's own forward, so FSDP has unsharded the head's (tied) weights as usual.
    """
    where = where.to(inputs.input_ids.device).bool().clone()
    where[:, 0] = False
    predicts = where[:, 1:]
    if model.get_output_embeddings() is None:
        raise RuntimeError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None); "
                           "target_logits needs a causal LM")
    suffix = predicts[:, inputs.shared_prefix:]  # run_model's outputs start at the shared prefix's end
    logits = run_model(model, inputs, head_input=lambda hidden: hidden[:, :-1][suffix]).logits
    if logits.shape[:-1] != (int(predicts.sum()),):
        raise RuntimeError(f"{type(model).__name__}'s output head did not take the selected positions "
                           f"(logits {tuple(logits.shape)}); target_logits needs a model that applies "
                           f"get_output_embeddings() to its last hidden states")
    return TargetLogits(logits, inputs.input_ids[where], where)
