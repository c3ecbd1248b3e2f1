"""Per-GPU memory plan of a run, before renting GPUs (docs/cluster.md); the command line is ``agent_trainer.plan``.

    python -m agent_trainer.plan --config-name gpu_qwen7b_8gpu model_path=config/model_shapes/Qwen2.5-7B \\
        [key=value ...] [--gpu-memory-gib 80] [--gpus-per-node 8] [--nodes 1]

The config is composed and checked exactly as ``python -m agent_trainer.main`` does (the same
``--config-name`` and overrides); only the model's ``config.json`` is read, no weights. The plan prints,
for each kind of GPU of the run's layout and each phase of a step, the bytes one GPU holds:

* parameters, gradients and AdamW's two states of the actor (and of a critic when the estimator needs
  values), per FSDP2 shard: the architecture is built on the meta device, sharded with ``fully_shard``
  under torch's fake process group at the group's world size, and each rank's local shard is counted
  (:func:`shard_count`). FSDP2 keeps the sharded parameters in their own dtype (float32 master weights
  unless ``actor_rollout_ref.actor.allow_low_precision_master``) and casts each unit to the compute dtype
  (``MixedPrecisionPolicy.param_dtype``) as it all-gathers it, so the master copy is the parameter row;
* the reference policy in ``actor_rollout_ref.ref.dtype`` (null = ``model.dtype``), on the CPU with
  ``actor_rollout_ref.ref.fsdp.param_offload``;
* FSDP2's unsharded buffers: the root unit (embeddings, final norm, head) stays gathered from the
  forward through the backward; two decoder layers are gathered at a time (the running one and the
  prefetched one), and one layer's gradients are reduce-scattered in float32;
* activations at the configured micro-batch (``ppo_micro_batch_size_per_gpu`` rows of
  ``rollout.max_model_len`` tokens, or ``ppo_max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``):
  :func:`activation_bytes` documents the formula, with and without gradient checkpointing;
* the engine: ``rollout.gpu_memory_utilization`` of the GPU, which vLLM claims at start (weights in
  ``rollout.dtype`` divided by tensor parallelism, then the KV cache in what is left); the KV bytes the
  configured batch needs (2 x layers x KV heads x head dim x bytes x tokens) are shown beside it;
* a CUDA context per process.

Layouts: separate engines (training GPUs and engine GPUs, one phase each), or
``actor_rollout_ref.hybrid_engine`` (the engine on the actor ranks' GPUs: rollout with the engine awake and
the trainer's state resident unless offloaded, weight sync with the engine's weights awake and no KV cache
beside the trainer's state, one FSDP unit gathered whole and one bucket, training with the engine asleep).
A GPU's peak is the largest of its phases. A plan *fits* when every GPU's peak stays under ``(1 - MARGIN)``
of its memory; with ``trainer.gpu_memory_gib`` set,
the entry points refuse before ``ray.init`` a run whose peak exceeds the GPU's memory
(``agent_trainer.checks.memory``, one of the start-up checks of ``agent_trainer.checks.prepare``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from agent_trainer import core_algos
from agent_trainer.config import AgentTrainerConfig

GIB = 1024 ** 3
MIB = 1024 ** 2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MARGIN = 0.10
"""A plan fits when every GPU's peak is at most (1 - MARGIN) of its memory: the rest covers the caching
allocator's fragmentation and what the plan does not count (NCCL's buffers beyond its context, kernels'
workspaces, Python-side tensors)."""
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
"""One process's CUDA context, cuBLAS workspace and NCCL communicator buffers (about 0.5-1 GiB on H100s)."""
ENGINE_RESERVE_BYTES = 1 * GIB
"""What vLLM keeps inside its share besides weights and KV cache: the peak activations of its profiling run
and the CUDA graphs (an estimate; vLLM logs the real figure at start)."""
ENGINE_ASLEEP_BYTES = 1 * GIB
"""What a sleeping engine (vLLM sleep level 1: weights to CPU, KV cache released) still holds on its GPU."""
DEFAULT_GPU_MEMORY_GIB = 80.0


# -- shards ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardCount:
    """Element counts of one role's model under FSDP2 at a world size (dtype-free: times the bytes later)."""

    total: int
    """Parameters of the whole model (tied weights once)."""
    per_rank: int
    """Elements of the largest rank's local shard (rank 0's: FSDP2 chunks dim 0 and pads every rank to it)."""
    largest_layer: int
    """Parameters of the largest decoder layer (one FSDP unit, all-gathered whole in forward and backward)."""
    root: int
    """Parameters outside the decoder layers (embeddings, final norm, head): the root unit."""
    method: str
    """'meta fully_shard' (fake process group) or 'hand count' (when a process group already exists)."""


def build_meta_model(model_config: Any, role: str):
    """The role's Hugging Face model on the meta device: ``causal`` (actor, reference, engine) or ``value``
    (the critic: ``AutoModelForTokenClassification`` with one label, as agent_trainer/workers/critic.py builds it)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    with torch.device("meta"):
        if role == "value":
            config = copy.deepcopy(model_config)
            config.num_labels = 1
            config.classifier_dropout = 0.0
            return AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def decoder_layers(model) -> list:
    """The transformer blocks of a Hugging Face causal LM / token classifier (inside a ``peft.PeftModel`` too): the
    units ``agent_trainer/workers/fsdp_base.py`` shards one by one, and this plan counts."""
    if hasattr(model, "get_base_model"):  # peft's wrapper: PeftModel -> LoraModel -> the HF model
        model = model.get_base_model()
    for attr in ("model", "transformer"):
        base = getattr(model, attr, None)
        if base is not None:
            layers = getattr(base, "layers", None) or getattr(base, "h", None)
            if layers is not None:
                return list(layers)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def hand_count(model, world_size: int) -> int:
    """Elements of rank 0's shard by hand: FSDP2 gives each rank ceil(dim0 / world) rows of every parameter."""
    return sum(math.ceil(p.shape[0] / world_size) * (p.numel() // max(1, p.shape[0])) if p.dim() else p.numel()
               for p in model.parameters())


@lru_cache(maxsize=32)
def shard_count(model_path: str, role: str, world_size: int) -> ShardCount:
    """Build the role's architecture on the meta device, ``fully_shard`` every decoder layer then the root
    (as agent_trainer/workers/fsdp_base.py does) under torch's fake process group of ``world_size`` ranks, and count
    rank 0's local shard. Where this process already has a process group, the shard is counted by hand instead."""
    import torch.distributed as dist
    from transformers import AutoConfig

    model = build_meta_model(AutoConfig.from_pretrained(model_path), role)
    layers = decoder_layers(model)
    total = sum(p.numel() for p in model.parameters())
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    largest, root = max(layer_sizes, default=0), total - sum(layer_sizes)
    if dist.is_initialized():
        return ShardCount(total, hand_count(model, world_size), largest, root, "hand count")
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        per_rank = sum(p.to_local().numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    return ShardCount(total, per_rank, largest, root, "meta fully_shard")


# -- the plan -------------------------------------------------------------------------------

@dataclass
class Line:
    """One row of a GPU's table: bytes per phase (a phase it is absent from holds 0)."""

    what: str
    bytes: dict[str, int]
    note: str = ""


@dataclass
class GpuKind:
    """GPUs of one role in the layout (e.g. the actor's ranks) and what each holds per phase."""

    name: str
    count: int
    phases: list[str]
    lines: list[Line] = field(default_factory=list)

    def add(self, what: str, note: str = "", **per_phase: int) -> None:
        self.lines.append(Line(what, {k: int(v) for k, v in per_phase.items() if v}, note))

    def total(self, phase: str) -> int:
        return sum(line.bytes.get(phase, 0) for line in self.lines)

    def peak(self) -> tuple[str, int]:
        phase = max(self.phases, key=self.total)
        return phase, self.total(phase)


@dataclass
class Plan:
    """The run's GPUs: every kind with its phases, the GPU memory and cluster it is planned for."""

    model_path: str
    layout: str
    gpu_memory: int
    gpus_per_node: int
    nodes: int
    kinds: list[GpuKind]
    notes: list[str]
    shard_method: str

    @property
    def gpus_needed(self) -> int:
        return sum(k.count for k in self.kinds)

    def worst(self) -> tuple[GpuKind, str, int]:
        kind = max(self.kinds, key=lambda k: k.peak()[1])
        return (kind, *kind.peak())

    def fits(self, margin: float = MARGIN) -> bool:
        return self.gpus_needed <= self.gpus_per_node * self.nodes and self.worst()[2] <= (1 - margin) * self.gpu_memory


@dataclass(frozen=True)
class Precision:
    """Bytes per element of one role: sharded (master) parameters, gradients and optimizer states; compute."""

    master: int
    compute: int


def precision(model_cfg: Any, fsdp_cfg: Any) -> Precision:
    """Master weights (and so gradients and AdamW states) in ``model.dtype`` (float32 unless the role's
    ``allow_low_precision_master``, agent_trainer.checks); compute in bfloat16 with ``fsdp.mixed_precision=bf16``
    (FSDP2's MixedPrecisionPolicy) or a 2-byte ``model.dtype``."""
    master = DTYPE_BYTES[model_cfg.dtype]
    compute = 2 if master == 2 or fsdp_cfg.mixed_precision == "bf16" else 4
    return Precision(master, compute)


def activation_bytes(model_config: Any, tokens: int, compute: int, checkpointing: bool, head: str) -> dict[str, int]:
    """Activation memory of one micro-batch's forward + backward on one rank, for ``tokens`` tokens
    (rows x longest row). Per token and decoder layer, the tensors autograd keeps (h hidden, i intermediate,
    kv = KV heads x head dim, c compute bytes):

    * attention: the layer input and its normed copy (2h), q, k, v (h + 2kv), RoPE's rotate_half copies
      (h + kv) and the rotated q, k (h + kv; SDPA keeps these), the attention output, o_proj's input (h):
      6h + 4kv;
    * MLP: its input and normed copy (2h), gate and up projections (2i), SiLU's output (i), their
      product, down_proj's input (i): 2h + 4i;
    * the two RMSNorms upcast their input to float32: 2 x 4h bytes.

    So A = c (8h + 4kv + 4i) + 8h bytes per token per layer; layers x A without gradient checkpointing,
    layers x c h (each layer's input) + A (one layer recomputed in the backward) with it.
    The head (``causal``): the scored positions' logits in the compute dtype, their float32 copy, the
    softmax and the logits' gradient: rows x vocab x (c + 12), where the workers' chunked head
    (``agent_trainer/workers/fused_head.py``) holds one chunk of :func:`logit_chunk_rows` rows at a time, and a
    model whose logits are changed after the head (:func:`logits_untouched` false) all tokens (counted as
    scored: a bound). A value head (``value``) has one output per token: nothing worth counting.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    h, i, layers = text.hidden_size, text.intermediate_size, text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    per_layer = compute * (8 * h + 4 * kv * head_dim + 4 * i) + 8 * h
    body = (layers * compute * h + per_layer) if checkpointing else layers * per_layer
    out = {"layers": body * tokens}
    if head == "causal":
        rows = min(tokens, logit_chunk_rows(text.vocab_size)) if logits_untouched(text) else tokens
        out["logits"] = rows * text.vocab_size * (compute + 12)
    return out


LOGIT_CHUNK_ELEMENTS = 2 ** 26
"""Logits the workers' output head computes at a time (positions x vocabulary): 256 MiB of float32, 441 positions
of a 151,936-token vocabulary (``agent_trainer/workers/fused_head.py``)."""
LOGIT_CHANGING_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Model config keys (Gemma, Cohere, Granite, ...) under which a model changes its logits after the output head."""


def logit_chunk_rows(vocab: int) -> int:
    """Positions per chunk of the output head for a vocabulary of ``vocab`` tokens."""
    return max(1, LOGIT_CHUNK_ELEMENTS // max(1, vocab))


def logits_untouched(model_config: Any) -> bool:
    """True when a model of this config returns its output head's output as its logits (no scale, no soft cap)."""
    return all(getattr(model_config, key, None) in (None, 1, 1.0) for key in LOGIT_CHANGING_KEYS)


def kv_bytes_per_token(model_config: Any, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    return 2 * text.num_hidden_layers * kv * head_dim * dtype_bytes


def _micro_tokens(use_dynamic: bool, budget: int, micro_rows: int, max_len: int) -> int:
    return budget if use_dynamic else micro_rows * max_len


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def build_plan(cfg: AgentTrainerConfig, gpu_memory_gib: float | None = None, gpus_per_node: int = 8,
               nodes: int = 1) -> Plan:
    """The per-GPU plan of ``cfg`` on GPUs of ``gpu_memory_gib`` (else trainer.gpu_memory_gib, else 80): the actor's
    GPUs first (with a colocated critic, reference or engine on them), then each kind of GPU of its own."""
    from transformers import AutoConfig

    arr = cfg.actor_rollout_ref
    memory_gib = gpu_memory_gib or cfg.trainer.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB
    gpu_memory = int(memory_gib * GIB)
    model_config = AutoConfig.from_pretrained(arr.model.path)
    notes: list[str] = []
    actor_gpu, actor_shard, actor_act = plan_actor(cfg, model_config, notes)
    kinds = [actor_gpu]
    critic_act = plan_critic(cfg, actor_gpu, kinds) if core_algos.critic_enabled(cfg) else 0
    if cfg.ref_enabled:
        plan_reference(cfg, actor_gpu, kinds)
    actor_gpu.add("activations (micro-batch)", "layers" + (" (checkpointed)" if arr.model.enable_gradient_checkpointing
                                                           else "") + " + logits", train=max(actor_act, critic_act))
    contexts = 2 if arr.hybrid_engine else 1
    actor_gpu.add("CUDA context", "trainer rank" + (" + engine process" if arr.hybrid_engine else ""),
                  **{p: contexts * CUDA_CONTEXT_BYTES for p in actor_gpu.phases})
    plan_engines(cfg, model_config, actor_gpu, actor_shard, gpu_memory, kinds, notes)
    if cfg.reward_model.enable:
        notes.append("reward_model GPUs are not planned")
    if cfg.algorithm.distill.enable:
        notes.append("the distillation teacher's GPUs (algorithm.distill.fsdp.world_size) are not planned")
    return Plan(arr.model.path, "hybrid_engine (engines on the actor's GPUs)" if arr.hybrid_engine
                else "separate engines", gpu_memory, gpus_per_node, nodes, kinds, notes, actor_shard.method)


def plan_actor(cfg: AgentTrainerConfig, model_config: Any, notes: list[str]) -> tuple[GpuKind, ShardCount, int]:
    """The actor's GPUs (phases rollout, sync and train under hybrid_engine, else train) with the actor's sharded
    state and unsharded buffers; also its shard count and one micro-batch's activation bytes (added later, beside
    a colocated critic's)."""
    arr, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    hybrid, world = arr.hybrid_engine, arr.actor.fsdp.world_size
    train_phases = ["rollout", "sync", "train"] if hybrid else ["train"]
    actor_gpu = GpuKind("actor rank" + (" + engine (hybrid_engine)" if hybrid else ""), world, train_phases)
    prec = precision(arr.model, arr.actor.fsdp)
    actor_shard = shard_count(arr.model.path, "causal", world)
    offload_params = arr.actor.fsdp.param_offload
    offload_optim = arr.actor.fsdp.optimizer_offload
    ckpt = arr.model.enable_gradient_checkpointing
    params = actor_shard.per_rank * prec.master
    resident = {"rollout": 0 if offload_params else params, "sync": params, "train": params}
    actor_gpu.add("actor parameters (master)", f"{actor_shard.per_rank:,} of {actor_shard.total:,} x {prec.master} B"
                  + (", on CPU during rollout" if hybrid and offload_params else ""), **resident)
    actor_gpu.add("actor gradients", f"sharded, {prec.master} B", train=params)
    optim = 2 * params
    optim_note = "2 x the shard" + (", on CPU during rollout" if hybrid and offload_optim else "")
    actor_gpu.add("actor optimizer (AdamW m, v)", optim_note,
                  rollout=0 if offload_optim else optim, sync=optim, train=optim)
    note, gathered = unsharded_buffers(actor_shard, prec.compute, world)
    actor_gpu.add("FSDP unsharded buffers", note, train=gathered)
    tokens = _micro_tokens(arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu,
                           arr.actor.ppo_micro_batch_size_per_gpu, r.max_model_len)
    act = activation_bytes(model_config, tokens, prec.compute, ckpt, "causal")
    notes.append(f"actor micro-batch: {tokens:,} tokens, gradient checkpointing {'on' if ckpt else 'off'}, "
                 f"compute {prec.compute} B")
    return actor_gpu, actor_shard, act["layers"] + act["logits"]


def unsharded_buffers(shard: ShardCount, compute: int, world: int) -> tuple[str, int]:
    """FSDP2's unsharded buffers during an update (note, train bytes): on several ranks the root unit and two
    decoder layers gathered at a time, one layer's gradients in float32; on one rank the whole model stays gathered
    from the first micro-batch to the last (``agent_trainer.workers.fsdp_base.gathered_once``)."""
    if world == 1:
        return ("the model gathered once per update (one rank), 1 layer's grads",
                shard.total * compute + shard.largest_layer * (compute + 4))
    return ("root unit + 2 layers gathered, 1 layer's grads",
            shard.root * compute + shard.largest_layer * (3 * compute + 4))


def plan_critic(cfg: AgentTrainerConfig, actor_gpu: GpuKind, kinds: list[GpuKind]) -> int:
    """The critic's state on the actor's GPUs (``critic.colocate``) or on a kind of its own (appended to ``kinds``,
    with its own buffers, activations and CUDA context). Returns a colocated critic's activation bytes (the actor's
    GPUs hold the larger of the two micro-batches), 0 for a critic of its own."""
    from transformers import AutoConfig

    arr, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    hybrid, world = arr.hybrid_engine, arr.actor.fsdp.world_size
    c_fsdp = arr.actor.fsdp if cfg.critic.colocate else cfg.critic.fsdp  # a colocated critic runs with the actor's
    c_offload, c_optim_off = c_fsdp.param_offload, c_fsdp.optimizer_offload
    cprec = precision(cfg.critic.model, c_fsdp)
    cworld = world if cfg.critic.colocate else cfg.critic.fsdp.world_size
    cshard = shard_count(cfg.critic.model.path, "value", cworld)
    cparams = cshard.per_rank * cprec.master
    ctokens = _micro_tokens(cfg.critic.use_dynamic_bsz, cfg.critic.ppo_max_token_len_per_gpu,
                            cfg.critic.ppo_micro_batch_size_per_gpu, r.max_model_len)
    critic_act = activation_bytes(AutoConfig.from_pretrained(cfg.critic.model.path), ctokens, cprec.compute,
                                  cfg.critic.model.enable_gradient_checkpointing, "value")["layers"]
    target = actor_gpu if cfg.critic.colocate else GpuKind("critic rank", cworld, ["train"])
    if target is not actor_gpu:
        kinds.append(target)
    phases = {p: cparams for p in target.phases}
    if hybrid and target is actor_gpu and c_offload:
        phases["rollout"] = 0
    target.add("critic parameters + gradients", f"value model {cshard.total:,} params, sharded x {cprec.master} B",
               **{**phases, "train": 2 * cparams})
    target.add("critic optimizer (AdamW m, v)", "",
               **{p: (0 if (hybrid and target is actor_gpu and c_optim_off and p == "rollout") else 2 * cparams)
                  for p in target.phases})
    if target is actor_gpu:
        return critic_act
    note, gathered = unsharded_buffers(cshard, cprec.compute, cworld)
    target.add("FSDP unsharded buffers", note, train=gathered)
    target.add("activations (critic micro-batch)", "", train=critic_act)
    target.add("CUDA context", "1 process", train=CUDA_CONTEXT_BYTES)
    return 0


def plan_reference(cfg: AgentTrainerConfig, actor_gpu: GpuKind, kinds: list[GpuKind]) -> None:
    """The frozen reference's parameters (only) on the actor's GPUs (``ref.colocate``) or on a kind of its own."""
    arr = cfg.actor_rollout_ref
    ref_dtype = arr.ref.dtype or arr.model.dtype
    ref_bytes = DTYPE_BYTES[ref_dtype]
    rworld = arr.actor.fsdp.world_size if arr.ref.colocate else arr.ref.fsdp.world_size
    rshard = shard_count(arr.model.path, "causal", rworld)
    ref_off = arr.ref.fsdp.param_offload
    target = actor_gpu if arr.ref.colocate else GpuKind("reference rank", rworld, ["train"])
    if target is not actor_gpu:
        kinds.append(target)
        target.add("CUDA context", "1 process", train=CUDA_CONTEXT_BYTES)
    on_gpu = 0 if ref_off else rshard.per_rank * ref_bytes
    target.add("reference parameters", f"{ref_dtype}" + (", param_offload: on CPU, gathered per layer" if ref_off
                                                        else ""),
               **{p: on_gpu for p in target.phases})
    if ref_off:
        target.add("reference gathered layers", "offloaded units streamed in", train=2 * rshard.largest_layer
                   * ref_bytes + rshard.root * ref_bytes)


def plan_engines(cfg: AgentTrainerConfig, model_config: Any, actor_gpu: GpuKind, actor_shard: ShardCount,
                 gpu_memory: int, kinds: list[GpuKind], notes: list[str]) -> None:
    """The rollout engines: on the actor's GPUs under hybrid_engine (awake in the rollout, woken weights in the sync,
    asleep in the update), else a kind of their own; notes on the KV cache the batch needs."""
    arr, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    hybrid, world, tp = arr.hybrid_engine, arr.actor.fsdp.world_size, r.tensor_model_parallel_size
    rollout_dtype = r.dtype or arr.model.dtype
    rbytes = DTYPE_BYTES[rollout_dtype]
    weights = actor_shard.total * rbytes // tp
    share = int(r.gpu_memory_utilization * gpu_memory)
    kv_available = share - weights - ENGINE_RESERVE_BYTES
    rows = cfg.es_manager.train.env_groups * cfg.es_manager.train.group_size
    if cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train:
        rows = max(rows, cfg.es_manager.val.env_groups * cfg.es_manager.val.group_size)
    engines = r.num_workers
    kv_needed = math.ceil(rows / engines) * r.max_model_len * kv_bytes_per_token(model_config, rbytes) // tp
    if hybrid:
        bucket = int(r.update_weights_bucket_megabytes * MIB)
        unit = max(actor_shard.root, actor_shard.largest_layer) * precision(arr.model, arr.actor.fsdp).master
        if r.enable_sleep_mode is False:  # None = on under hybrid_engine on GPUs
            actor_gpu.add("engine (awake: weights + KV cache)", f"rollout.gpu_memory_utilization "
                          f"{r.gpu_memory_utilization} of the GPU, never asleep (enable_sleep_mode=false)",
                          **{p: share for p in actor_gpu.phases})
        else:
            actor_gpu.add("engine (awake: weights + KV cache)",
                          f"rollout.gpu_memory_utilization {r.gpu_memory_utilization} of the GPU", rollout=share)
            actor_gpu.add("engine weights (woken for the sync)", f"{rollout_dtype}, / TP {tp}", sync=weights)
            actor_gpu.add("engine asleep", "sleep level 1: weights on CPU, KV cache freed", train=ENGINE_ASLEEP_BYTES)
        actor_gpu.add("weight sync: gathered unit + bucket", "the largest FSDP unit unsharded, one bucket",
                      sync=unit + bucket)
    else:
        engine_gpu = GpuKind(f"engine GPU (TP {tp})", engines * tp, ["rollout"])
        engine_gpu.add("engine weights", f"{rollout_dtype}, / TP {tp}", rollout=weights)
        engine_gpu.add("engine KV cache + reserve", f"the rest of gpu_memory_utilization {r.gpu_memory_utilization}",
                       rollout=share - weights)
        engine_gpu.add("CUDA context", "engine process", rollout=CUDA_CONTEXT_BYTES)
        kinds.append(engine_gpu)
    notes.append(f"engine KV cache: {gib(max(0, kv_available))} GiB available per GPU, {gib(kv_needed)} GiB needed "
                 f"for {math.ceil(rows / engines)} sequences x {r.max_model_len} tokens per engine")
    if kv_available < 0:
        notes.append("the engine's weights do not fit its share: raise "
                     "actor_rollout_ref.rollout.gpu_memory_utilization or tensor_model_parallel_size")
    elif kv_available < kv_needed:
        notes.append("the KV cache holds less than one rollout batch: the engine queues sequences (slower, not out of "
                     "memory); raise gpu_memory_utilization or num_workers to generate all at once")
    if hybrid and engines < world:
        notes.append(f"{engines} of the {world} actor GPUs host an engine; the others peak lower")


def render(plan: Plan) -> str:
    """The plan as a text table per GPU kind (GiB per phase) and a verdict."""
    out = [f"memory plan: {plan.model_path}, layout {plan.layout}, {plan.gpu_memory / GIB:g} GiB per GPU, "
           f"{plan.nodes} node(s) x {plan.gpus_per_node} GPU(s); shards by {plan.shard_method}"]
    for kind in plan.kinds:
        out.append("")
        out.append(f"{kind.name}: {kind.count} GPU(s), GiB per GPU")
        width = max(len(line.what) for line in kind.lines + [Line("peak", {})])
        out.append(f"  {'':{width}}  " + "  ".join(f"{p:>8}" for p in kind.phases) + "  note")
        for line in kind.lines:
            cells = "  ".join(f"{gib(line.bytes.get(p, 0)) if line.bytes.get(p) else '-':>8}" for p in kind.phases)
            out.append(f"  {line.what:{width}}  {cells}  {line.note}")
        out.append(f"  {'total':{width}}  " + "  ".join(f"{gib(kind.total(p)):>8}" for p in kind.phases))
        phase, peak = kind.peak()
        used = peak / plan.gpu_memory
        out.append(f"  peak {gib(peak)} GiB ({phase}) = {used:.0%} of {plan.gpu_memory / GIB:g} GiB; "
                   f"{'fits' if used <= 1 - MARGIN else 'over'} the {1 - MARGIN:.0%} line "
                   f"(margin {gib(plan.gpu_memory - peak)} GiB)")
    out.append("")
    have = plan.gpus_per_node * plan.nodes
    out.append(f"GPUs: {plan.gpus_needed} needed, {have} in the cluster")
    for note in plan.notes:
        out.append(f"note: {note}")
    short = plan.gpus_needed > have
    if short:
        out.append("the run needs more GPUs than the cluster has: lower the world sizes or rollout.num_workers, or set "
                   "actor_rollout_ref.hybrid_engine=true (engines on the actor's GPUs)")
    out.append(f"verdict: {'FITS' if plan.fits() else 'DOES NOT FIT'} (every GPU under {1 - MARGIN:.0%} of its memory"
               f"{', and not enough GPUs' if short else ''})")
    return "\n".join(line.rstrip() for line in out)
