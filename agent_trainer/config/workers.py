"""The worker sections of the schema: models, optimizers, FSDP layout, actor, reference, rollout engines, critic.

Plain dataclasses (stdlib only); :mod:`agent_trainer.config.schema` assembles them into the run's config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POLICY_LOSS_DEFAULTS: dict[str, tuple[float, float, str]] = {
    "vanilla": (0.2, 0.28, "token-mean"),
    "gspo": (3e-4, 4e-4, "seq-mean-token-mean"),
}
"""Per policy loss: (clip_ratio_low, clip_ratio_high, loss_agg_mode) where the config leaves them unset.
vanilla: StarPO-S's clip-higher; gspo: the GSPO paper's sequence-level ranges (verl's GSPO recipe)."""


@dataclass
class ModelConfig:
    """Which checkpoint a worker loads."""

    path: str = "${model_path}"
    """Hugging Face folder or hub id (any causal LM; the tiny model is just a folder)."""
    dtype: str = "float32"
    """The model's parameter dtype: float32 | bfloat16. For a trained model (actor, critic) these are the master
    weights the optimizer updates, and its AdamW states: keep float32 and compute in bfloat16 with
    fsdp.mixed_precision=bf16 (a bfloat16 master with an optimizer is refused unless allow_low_precision_master:
    a 1e-6 step rounds away against bfloat16's 8 mantissa bits; float16 is refused for training, there is no
    loss scaler). The engines' dtype is actor_rollout_ref.rollout.dtype and the reference's
    actor_rollout_ref.ref.dtype, each defaulting to this one."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (long multi-turn sequences on GPU)."""
    lora_rank: int = 0
    """LoRA rank (verl's key): > 0 trains a peft LoRA adapter of this rank on the target_modules instead of the full
    model (actor only: the base weights stay frozen, only the adapter gets gradients and AdamW state; the reference
    policy is the same model with the adapter switched off; the engines get the merged weights W + (alpha/r) B A;
    checkpoints hold the adapter in peft's layout). 0 = off. docs/lora.md."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (verl's key): the adapter's output is scaled by lora_alpha / lora_rank."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """With lora_rank > 0: the linear modules that get an adapter, by the last part of their name (q_proj, v_proj,
    gate_proj, ...), or [all-linear] for every linear layer but the output head (verl's default, peft's shorthand)."""
    lora_dropout: float = 0.0
    """With lora_rank > 0: dropout on the adapter's input during the update (log-prob passes run without it)."""
    lora_adapter_path: str | None = None
    """With lora_rank > 0 (verl's key): a peft adapter folder (adapter_config.json + adapter_model.safetensors:
    an SFT run's final/, a checkpoint's actor/, any PeftModel.save_pretrained) whose weights the adapter starts
    from instead of fresh ones; path stays the base model. Its r / lora_alpha / target_modules must equal
    lora_rank / lora_alpha / target_modules (refused before the run otherwise). null = fresh adapter. docs/lora.md."""


@dataclass
class OptimConfig:
    """AdamW settings."""

    lr: float = 1e-5
    """Learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    lr_scheduler_type: str = "constant"
    """constant | cosine (verl's names). cosine decays the learning rate along the run, from ``lr`` at its first
    step to ``lr * min_lr_ratio`` at its end, by the run's progress (the trainer's step out of
    ``trainer.total_training_steps``; the SFT's optimizer step out of its total), on top of the warm-up: a
    run's last steps, where a saturated task gives few episodes anything to learn from, take small steps.
    A resumed run picks the schedule up where it was (it follows the step, not a saved state)."""
    min_lr_ratio: float = 0.0
    """cosine's floor, a fraction of ``lr`` in [0, 1]; only with ``lr_scheduler_type: cosine``."""


@dataclass
class FSDPConfig:
    """How a model is sharded."""

    world_size: int = 1
    """Ranks (processes) in the worker group; the model is sharded with FSDP2 across them."""
    num_cpus_per_rank: float = 0.25
    """Ray CPU accounting per rank (fractional so that every worker fits on a 2-core laptop)."""
    num_threads: int = 1
    """torch intra-op threads per rank on CPU (several workers on 2 cores oversubscribe otherwise)."""
    mixed_precision: str = "none"
    """none | bf16: FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on every sharded unit
    (verl's fsdp mixed_precision): parameters are all-gathered and the forward and backward run in bfloat16; the
    gradients are reduce-scattered in float32 into the float32 master shards, which the optimizer updates with
    float32 states; log-probs, entropies and losses are computed in float32. A worker without a process group (a
    unit test, a one-rank worker built without torch.distributed) falls back to torch.autocast to bfloat16 (HF
    Trainer's bf16=True). Pays only on bfloat16 hardware (GPUs from Ampere on; CPUs with AVX512-BF16 or AMX):
    docs/benchmarks.md measures it. The trainer's log-probs then differ from a float32 engine's by about 3e-3 per
    token on the tiny model, against 1e-7 in float32 (actor/rollout_vs_actor_logprob_diff)."""
    param_offload: bool = False
    """GPU only (refused on cpu). actor / critic: move this rank's parameter shards to host memory while the engines
    generate and back before the next forward (verl's param_offload; FSDPWorker.offload_to_cpu / reload_to_device,
    called by the trainer around the rollout), freeing their GPU memory for colocated engines. ref: keep the frozen
    reference's shards in pinned host memory for good (FSDP2's CPUOffloadPolicy: each unit is copied to the GPU for
    its forward), a colocated reference too."""
    optimizer_offload: bool = False
    """GPU only (refused on cpu; not for the reference, which has no optimizer). Move this rank's optimizer states
    (AdamW's two float32 moments: twice the parameters' memory) to host memory while the engines generate and back
    before the next update (verl's optimizer_offload)."""


@dataclass
class ActorConfig:
    """The policy's PPO update (verl's ``actor_rollout_ref.actor``)."""

    ppo_mini_batch_size: int = "${ppo_mini_batch_size}"  # type: ignore[assignment]
    """Rows (sequences) per optimizer step, across all ranks."""
    ppo_micro_batch_size_per_gpu: int = "${micro_batch_size_per_gpu}"  # type: ignore[assignment]
    """Rows per forward/backward on one rank (gradient accumulation inside a mini-batch)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per training step."""
    clip_ratio: float | None = None
    """Symmetric clip range: the value of clip_ratio_low and clip_ratio_high where those are unset (verl).
    None = the policy loss's own defaults: vanilla 0.2 low / 0.28 high (StarPO-S clip-higher), gspo 3e-4 /
    4e-4 (the GSPO paper)."""
    clip_ratio_low: float | None = None
    """Lower clip range: the ratio is clipped at 1 - low. None = clip_ratio, else the policy loss's default."""
    clip_ratio_high: float | None = None
    """Upper clip range: the ratio is clipped at 1 + high. None = clip_ratio, else the policy loss's default."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: str | None = None
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm. None = the policy loss's
    default: token-mean (vanilla), seq-mean-token-mean (gspo, as in verl's GSPO recipe)."""
    policy_loss_mode: str = "vanilla"
    """vanilla (PPO clip, token ratio) | gspo (sequence-level ratio)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) loss term (GRPO style); starts a reference worker."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """kl|k1, abs, mse|k2, low_var_kl|k3."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    target_kl: float | None = None
    """Stop a step's update early (CleanRL's and Stable-Baselines3's ``target_kl``): once a mini-batch's
    ``actor/approx_kl`` (their estimator, mean of (r - 1) - log r over its generated tokens, r = pi / pi_old: the
    policy after the step's earlier optimizer steps against the weights the step trains from; averaged over the
    ranks) exceeds it, that mini-batch and the rest of the step take no optimizer step (the learning-rate
    schedule still counts them). null = off. ``actor/kl_stopped`` is 1 for a step that stopped,
    ``actor/optimizer_steps`` counts the steps taken. docs/algorithms.md."""
    recompute_old_log_prob: str = "auto"
    """auto: skip the old-log-prob forward (the log_prob phase) when the weights being updated generated the batch
    and ppo_epochs is 1: the first mini-batch uses the detached current log-probs, as TRL does, and the actor scores
    the later mini-batches' rows itself before its first optimizer step; the phase still runs when
    algorithm.rollout_correction.rollout_is needs the trainer's log-probs, with algorithm.distill (the student's
    side of the reverse KL), or for KL-in-reward at a rollout temperature other than 1 | always: recompute every step. docs/algorithms.md."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget (ppo_max_token_len_per_gpu) instead of ppo_micro_batch_size_per_gpu rows,
    for the update and the log-prob pass; verl's key. Gradients are the same either way (docs/algorithms.md)."""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: the most padded tokens (rows x longest row) in one micro-batch on one rank; at least
    actor_rollout_ref.rollout.max_model_len, so every row fits."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = field(default_factory=lambda: FSDPConfig(world_size=2))
    allow_low_precision_master: bool = False
    """Train with actor_rollout_ref.model.dtype=bfloat16 master weights and AdamW states (refused otherwise: updates
    smaller than 2^-8 of a weight round away, so small learning rates silently stop learning). Only for memory
    experiments; fp32 master weights with fsdp.mixed_precision=bf16 cost 4 extra bytes per parameter per shard."""

    def clip_ratios(self) -> tuple[float, float]:
        """(low, high) clip ranges of the policy loss: each side as set, else clip_ratio, else the loss's default."""
        default_low, default_high, _ = POLICY_LOSS_DEFAULTS.get(self.policy_loss_mode, POLICY_LOSS_DEFAULTS["vanilla"])
        low = next(v for v in (self.clip_ratio_low, self.clip_ratio, default_low) if v is not None)
        high = next(v for v in (self.clip_ratio_high, self.clip_ratio, default_high) if v is not None)
        return low, high

    def loss_agg(self) -> str:
        """The loss aggregation in use: loss_agg_mode as set, else the policy loss's default."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return POLICY_LOSS_DEFAULTS.get(self.policy_loss_mode, POLICY_LOSS_DEFAULTS["vanilla"])[2]


@dataclass
class RefConfig:
    """The frozen reference policy (only started when a KL term needs it)."""

    log_prob_micro_batch_size_per_gpu: int = "${micro_batch_size_per_gpu}"  # type: ignore[assignment]
    """Rows per forward on one rank."""
    log_prob_use_dynamic_bsz: bool = False
    """Micro-batches by token budget (log_prob_max_token_len_per_gpu) instead of rows (verl's key);
    config/base.yaml ties it to actor_rollout_ref.actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int = 16384
    """With log_prob_use_dynamic_bsz: the most padded tokens per forward on one rank (>= rollout.max_model_len)."""
    colocate: bool = True
    """Host the reference weights in the actor's processes (verl colocates them): each actor rank holds its
    shard of the frozen copy too and computes ``ref_log_prob`` data-parallel over the actor's ranks, with no
    process of its own. False: a separate group of ``ref.fsdp.world_size`` ranks (its own CPUs or GPUs)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """The separate group's sharding (only with colocate=false: colocated, the reference uses the actor's, except
    fsdp.param_offload, which is the reference's own either way)."""
    dtype: str | None = None
    """The frozen reference's parameter dtype: float32 | bfloat16 | float16 | null (= actor_rollout_ref.model.dtype).
    It only runs forwards, so bfloat16 halves its memory at the cost of bfloat16 rounding in ref_log_prob (the KL
    term's reference side); with fsdp.mixed_precision=bf16 it computes in bfloat16 anyway."""


@dataclass
class ValKwargs:
    """Sampling for validation rollouts."""

    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling."""


@dataclass
class RolloutConfig:
    """The generation engine."""

    name: str = "vllm"
    """vllm (vLLM's CPU build here, CUDA vLLM on GPUs) | hf (transformers generate, a fallback)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    response_length: int = 100
    """Max new tokens per turn, for every env tag: the global cap. A tag's max_tokens (config/envs.yaml) is its
    own per-turn budget, so a turn of that tag generates at most min(max_tokens, response_length) tokens."""
    max_model_len: int = 2048
    """Max tokens of a whole episode (prompt and every turn); longer episodes are truncated and end."""
    num_workers: int = 1
    """Rollout engines; episodes are split across them."""
    mode: str = "sync"
    """sync: turn-synchronous rollout (every turn waits for all generations, then all env steps) | async: no
    turn barrier (verl's name): each group's next turn goes to the engine as soon as its own env step returns,
    env steps of different groups run at once; needs name=vllm (per-request seeds). docs/architecture.md."""
    generate_timeout_s: float = 600.0
    """Seconds one generate call (one turn of an engine's share of the episodes) may take; past it the engine
    is killed, restarted and re-synced, and the turn is generated once more (rollout/engine_failures)."""
    kv_cache_space_gib: float = 0.25
    """vLLM CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE), allocated at start: it should hold the tokens of the
    largest rollout batch (2 x layers x KV heads x head dim x dtype bytes per token; the tiny model: 1 KiB);
    a smaller cache makes the engine queue sequences, a larger one only costs memory. vLLM on CPU only: a
    non-default value is refused with rollout.name=hf or on GPUs (checks.rl.check_engine_keys)."""
    dtype: str | None = None
    """The engine's weights and activations dtype: float32 | bfloat16 | float16; None = actor_rollout_ref.model.dtype.
    The weight sync casts the actor's weights to it."""
    weight_sync: str = "auto"
    """How the actor's weights reach the engines after each update: auto | object_store | collective | cuda_ipc.
    auto: collective (an NCCL group of the actor's rank 0 and every engine worker) to separate GPU engines, cuda_ipc
    (CUDA IPC handles, no copy) to engines colocated on the actor's GPUs (hybrid_engine), object_store (each bucket
    put once into Ray's object store) on CPU. collective runs over gloo on CPU. docs/architecture.md, Weight sync."""
    update_weights_bucket_megabytes: float = 256
    """verl's name: the weight sync sends the weights in buckets of at most this many MiB (one tensor larger than
    that goes alone), cast to the engine's dtype; the sync's transient memory is one FSDP unit plus one bucket."""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of its GPU's memory (GPU only): weights, activations and KV cache. With
    actor_rollout_ref.hybrid_engine the rest is the FSDP rank's, while the engine is awake. vLLM on GPUs only: a
    non-default value is refused with rollout.name=hf or on CPU."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor parallelism (GPU only; refused with trainer.device=cpu): each engine's Ray actor holds this many
    GPUs in one placement-group bundle and runs vLLM's own worker processes on them
    (distributed_executor_backend=mp). 1 with actor_rollout_ref.hybrid_engine."""
    enable_sleep_mode: bool | None = None
    """vLLM sleep mode (GPU only; refused on a CPU run, where vLLM has none): after each rollout the engines
    sleep (weights to CPU RAM, KV cache freed); for the weight sync they wake their weights, then, after it,
    their KV cache. None = on exactly when actor_rollout_ref.hybrid_engine is on and the run is on GPUs.
    Not with trainer.max_off_policy_steps >= 1 (the next rollouts run while the step trains)."""
    num_cpus_per_worker: float = 0.5
    """Ray CPU accounting per engine."""
    num_threads: int = 0
    """Intra-op threads of each engine on CPU (its process's OMP_NUM_THREADS; GPUs do not read it). 0 = auto: 2 for a
    model of at least 4M parameters when one engine generates while the trainer waits (num_workers 1,
    trainer.max_off_policy_steps 0), else 1. Measured on 2 cores: a 19M model generates 1.5x faster on 2 threads,
    the 0.6M tiny model 0.9x (too little work per token to share). A non-default value is refused on GPUs."""
    rollout_filter_strategy: str = "top_k"
    """StarPO-S group filtering by in-group reward std: top_k (keep the top fraction of groups) |
    top_p (groups whose std sums to that fraction of the total) | min_p (groups with std >= value x the largest)."""
    rollout_filter_value: float = 1.0
    """Filter threshold: a ratio in (0, 1] for top_k / top_p, in [0, 1] for min_p; top_k 1.0 keeps every
    group (StarPO-S uses top_k 0.25). Whole groups are kept; each update is then padded to whole mini-batches
    with zero-mask rows, so a ppo_mini_batch_size that divides the kept rows wastes nothing."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)


@dataclass
class ActorRolloutRefConfig:
    """verl's ``actor_rollout_ref`` section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    hybrid_engine: bool = False
    """Colocate the rollout engines with the actor's FSDP ranks (verl's key): engine i runs in actor rank i's
    placement-group bundle and shares its GPU (half of the bundle's GPU each in Ray's accounting; the memory split is
    rollout.gpu_memory_utilization) and its CPUs (the bundle holds the rank's and the engine's). Needs
    rollout.num_workers <= actor.fsdp.world_size and tensor_model_parallel_size 1. On GPUs sleep mode is then on by
    default (rollout.enable_sleep_mode), so one GPU holds training and generation in turn. false: engines get
    placement groups of their own (their own GPUs), the layout for large clusters."""


@dataclass
class CriticConfig:
    """The value model (same backbone, scalar head)."""

    enable: bool | None = None
    """None = on exactly when the estimator needs values (gae, bi_level_gae)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo_mini_batch_size: int = "${ppo_mini_batch_size}"  # type: ignore[assignment]
    """Rows per critic optimizer step."""
    ppo_micro_batch_size_per_gpu: int = "${micro_batch_size_per_gpu}"  # type: ignore[assignment]
    """Rows per forward/backward on one rank."""
    ppo_epochs: int = 1
    """Passes over the batch per training step."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""
    loss_agg_mode: str = "token-mean"
    """How the value loss is averaged."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    use_dynamic_bsz: bool = False
    """Micro-batches by token budget instead of ppo_micro_batch_size_per_gpu rows (verl's key);
    config/base.yaml ties it to actor_rollout_ref.actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: the most padded tokens per update micro-batch on one rank (>= rollout.max_model_len)."""
    forward_max_token_len_per_gpu: int | None = None
    """With use_dynamic_bsz: the same for compute_values; null = ppo_max_token_len_per_gpu."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    allow_low_precision_master: bool = False
    """Train the critic with critic.model.dtype=bfloat16 master weights and AdamW states (refused otherwise, as for
    actor_rollout_ref.actor.allow_low_precision_master: the critic has its own dtype, so its own key)."""
    colocate: bool = True
    """Host the critic in the actor's processes (verl's fused worker): each actor rank also holds its shard of
    the value model and its optimizer, and computes values and the critic update data-parallel over the actor's
    ranks, with no process of its own (one process and its ~0.4 GiB of torch/transformers imports fewer).
    False: a separate group of ``critic.fsdp.world_size`` ranks (its own CPUs or GPUs). docs/architecture.md."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """The separate group's sharding and threads (only with colocate=false: colocated, the critic uses the
    actor's)."""
