"""Typed configuration: one dataclass per component, defaults in one place.

The YAML files under ``config/`` (hydra) are merged onto these dataclasses by
:func:`load_config`: an unknown key (also in hydra's ``+key=value`` form) or a value
of the wrong type fails at start-up naming the key (``config_errors``), and every
value that cannot work is refused by ``config_checks.validate_config``, all before
``ray.init``, each with one line giving the key, the value and the fix.

Section names follow RAGEN's ``base.yaml``: ``model_path``,
``actor_rollout_ref``, ``critic``, ``algorithm``, ``trainer``, ``agent_proxy``,
``es_manager``, ``ctx_manager``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agent_trainer import compat, config_errors, core_algos
from agent_trainer.config_checks import CONDENSED_ESTIMATORS, validate_config  # noqa: F401 (re-exported)
from agent_trainer.es_manager import EsManagerConfig
from agent_trainer.multiturn_config import MultiturnGRPOConfig, MultiturnTrajectoryConfig, TrajectoryProfilingConfig
from agent_trainer.reward_config import DataConfig, RewardConfig, RewardModelConfig
from agent_trainer.trajectory_rewards.base import RewardComputationConfig

logger = logging.getLogger(__name__)

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
    recompute_old_log_prob: str = "auto"
    """auto: skip the old-log-prob forward (the log_prob phase) when the weights being updated generated the batch
    and ppo_epochs is 1: the first mini-batch uses the detached current log-probs, as TRL does, and the actor scores
    the later mini-batches' rows itself before its first optimizer step; the phase still runs when
    algorithm.rollout_correction.rollout_is needs the trainer's log-probs, or for KL-in-reward at a rollout
    temperature other than 1 | always: recompute every step. docs/algorithms.md."""
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
    a smaller cache makes the engine queue sequences, a larger one only costs memory."""
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
    actor_rollout_ref.hybrid_engine the rest is the FSDP rank's, while the engine is awake."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor parallelism (GPU only; refused with trainer.device=cpu): each engine's Ray actor holds this many
    GPUs in one placement-group bundle and runs vLLM's own worker processes on them
    (distributed_executor_backend=mp). 1 with actor_rollout_ref.hybrid_engine."""
    enable_sleep_mode: bool | None = None
    """vLLM sleep mode (GPU only; refused on a CPU run, where vLLM has none): after each rollout the engines
    sleep (weights to CPU RAM, KV cache freed); for the weight sync they wake their weights, then, after it,
    their KV cache. None = on exactly when actor_rollout_ref.hybrid_engine is on and the run is on GPUs.
    Not with trainer.max_off_policy_steps=1 (the next rollout runs while the step trains)."""
    num_cpus_per_worker: float = 0.5
    """Ray CPU accounting per engine."""
    num_threads: int = 0
    """Intra-op threads of each engine on CPU (its process's OMP_NUM_THREADS; ignored on GPUs). 0 = auto: 2 for a
    model of at least 4M parameters when one engine generates while the trainer waits (num_workers 1,
    trainer.max_off_policy_steps 0), else 1. Measured on 2 cores: a 19M model generates 1.5x faster on 2 threads,
    the 0.6M tiny model 0.9x (too little work per token to share)."""
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


@dataclass
class KLCtrlConfig:
    """KL-in-reward coefficient controller."""

    type: str = "fixed"
    """fixed | adaptive."""
    kl_coef: float = 0.001
    """(Initial) coefficient."""
    target_kl: float = 0.1
    """Adaptive controller's target."""
    horizon: int = 10000
    """Adaptive controller's horizon."""


@dataclass
class GiGPOConfig:
    """GiGPO's options (verl-agent's ``algorithm.gigpo``); used with adv_estimator=gigpo."""

    step_advantage_w: float = 1.0
    """Weight w of the step-level (anchor-state) advantage: A = A_episode + w * A_step."""
    mode: str = "mean_norm"
    """mean_norm (subtract the group mean, verl-agent's default) | mean_std_norm (also divide by the std),
    at both the episode and the step level."""
    epsilon: float = 1e-6
    """Added to the std in mean_std_norm."""


@dataclass
class RolloutCorrectionConfig:
    """Truncated importance sampling between the rollout engine and the trainer (verl's
    ``algorithm.rollout_correction``; TRL's ``vllm_importance_sampling_correction``). docs/algorithms.md."""

    rollout_is: str | None = None
    """null (off) | token (one weight per generated token) | sequence (one per row): the policy loss of each token
    is multiplied by min(pi_old / pi_rollout, rollout_is_threshold). Needs rollout temperature 1 (the engine
    reports temperature-1 log-probs) and the trainer's old log-probs (recompute_old_log_prob auto keeps them)."""
    rollout_is_threshold: float = 2.0
    """C, the upper truncation of each weight (verl's default 2.0; TRL's vllm_importance_sampling_cap 3.0)."""
    bypass_mode: bool = False
    """true: the engine's log-probs (rollout_log_probs) are the old policy of PPO's ratio, which then clips against
    the policy that sampled, and the old-log-prob forward (the log_prob phase) never runs (verl's bypass_mode).
    Needs rollout temperature 1 and rollout_is null (the weights pi_old / pi_rollout would all be 1)."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL-in-reward."""

    adv_estimator: str = "gae"
    """gae | bi_level_gae | grpo | grpo_multiturn | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | gigpo."""
    bi_level_gae: bool = False
    """RAGEN spelling: true with adv_estimator=gae selects bi_level_gae."""
    gamma: float = 1.0
    """Token-level discount."""
    lam: float = 1.0
    """GAE lambda."""
    high_level_gamma: float = 0.95
    """Turn-level discount of bi-level GAE."""
    norm_adv_by_std_in_grpo: bool = True
    """False gives Dr.GRPO (no division by the group std)."""
    advantage_epsilon: float = 1e-6
    """epsilon in (S - mean) / (std + epsilon) of grpo, grpo_multiturn, rloo and reinforce_plus_plus_baseline
    (seed 004's key; gigpo has algorithm.gigpo.epsilon)."""
    multiturn_grpo: MultiturnGRPOConfig = field(default_factory=MultiturnGRPOConfig)
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(policy || ref) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for KL-in-reward."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    gigpo: GiGPOConfig = field(default_factory=GiGPOConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    nonfinite_reward: str = "error"
    """What a NaN or infinite episode reward does (checked right after each rollout, before shaping):
    error (stop, naming the env tag, env_id and group seed) | drop (leave the episode, all its rows, out of
    the step; counted in rollout/nonfinite_dropped). Non-finite advantages always stop the step."""

    def estimator(self) -> str:
        """The estimator actually used (``bi_level_gae: true`` upgrades ``gae``)."""
        return core_algos.resolve_adv_estimator(self.adv_estimator, self.bi_level_gae)

    def estimator_options(self) -> dict:
        """Extra keyword options of the estimator in use (``core_algos.ESTIMATOR_OPTIONS``)."""
        if self.estimator() == "gigpo":
            return {"step_advantage_w": self.gigpo.step_advantage_w, "mode": self.gigpo.mode,
                    "epsilon": self.gigpo.epsilon}
        if "epsilon" in core_algos.ESTIMATOR_OPTIONS.get(self.estimator(), ()):
            return {"epsilon": self.advantage_epsilon}
        return {}


@dataclass
class RewardNormalizationConfig:
    """RAGEN's episode-score normalisation, applied to training rollouts before the estimator."""

    grouping: str = "state"
    """Which episodes are normalised together: state (same initial state, i.e. env group) | batch (all) |
    inductive (same env tag)."""
    method: str = "identity"
    """identity | mean (x - mean) | mean_std ((x - mean) / std) | asym_clip (mean_std clipped to [-1, 3]).
    The difference between the normalised and the raw episode score is added on the episode's last generated
    token, so per-turn rewards keep their place. Applied after rollout filtering, to the kept episodes."""


@dataclass
class AgentProxyConfig:
    """The multi-turn loop."""

    max_turn: int = 5
    """Max policy turns per episode."""
    enable_think: bool = True
    """Ask for <think>..</think> before <answer>..</answer>."""
    num_env_actors: int = 2
    """Ray env actors per split; episodes are sharded across them."""
    num_cpus_per_env_actor: float = 0.1
    """Ray CPU accounting per env actor (they mostly wait)."""
    agent_cls: str | None = None
    """The agent: what turns env outputs into model inputs and replies into env actions. null = the context
    manager of ctx_manager.mode; a registered name (full, condensed, tool_call: JSON tool calls in the chat
    template's tool format) or an import path package.module.ClassName of an agent_trainer.agents.base.Agent
    subclass whose layout matches ctx_manager.mode. See docs/agents.md."""
    reward_normalization: RewardNormalizationConfig = field(default_factory=RewardNormalizationConfig)


@dataclass
class CtxManagerConfig:
    """How an episode's context is laid out for the policy."""

    mode: str = "full"
    """full: every turn is appended to one token sequence (one training row per episode). condensed: each
    turn's prompt is rebuilt from the instruction, a text summary of the last keep_last_n_turns turns and the
    current observation; one training row per turn (needs algorithm.adv_estimator=grpo_multiturn or gigpo)."""
    keep_last_n_turns: int | None = None
    """condensed mode: how many previous turns (answer, reward, observation) the recap in each prompt keeps;
    alias of multiturn_trajectory.context_condenser.keep_last_n_steps (set either; both set must agree; null in
    both = 2)."""


@dataclass
class TrainerConfig:
    """The fit loop, logging and checkpoints."""

    project_name: str = "agent_trainer"
    """Groups runs in the output folder and loggers."""
    experiment_name: str = "frozenlake_ppo"
    """This run's name."""
    total_training_steps: int = 10
    """Training steps (one rollout + one update each)."""
    test_freq: int = 5
    """Validate every N steps (and after the last); <= 0 disables (then the val split starts no env actors)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    save_freq: int = -1
    """Save a full checkpoint every N steps (and after the last); <= 0 disables. See docs/checkpointing.md."""
    resume_mode: str = "auto"
    """auto: continue from the latest complete checkpoint in default_local_dir (a fresh start when there is
    none) | disable: start from model_path (an earlier run's files in the folder are archived first, never
    overwritten) | resume_path: continue from trainer.resume_from_path."""
    resume_from_path: str | None = None
    """A ``global_step_N`` checkpoint folder to resume from (with resume_mode=resume_path)."""
    max_actor_ckpt_to_keep: int | None = None
    """Keep at most this many checkpoints' actor states (oldest pruned first; None keeps all)."""
    max_critic_ckpt_to_keep: int | None = None
    """Keep at most this many checkpoints' critic states (oldest pruned first; None keeps all)."""
    save_hf_model: bool = True
    """Also write each checkpoint's actor (and critic) as a Hugging Face folder (``global_step_N/actor`` then
    loads with ``from_pretrained``, as ``model_path`` and in ``vllm serve``). The sharded state a resume reads
    (each rank's own shards, ``actor/shards/``) is written either way; the HF weights are assembled from it
    by actor rank 0, one tensor at a time, and cost a second copy of the weights on disk and the time to write
    it. Turn it off for large models (7B: 30 GB per checkpoint in float32) and export the checkpoint you want
    with ``python -m agent_trainer.export <global_step_N> --out DIR``. See docs/checkpointing.md."""
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: metrics.jsonl, tensorboard events, checkpoints."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console | jsonl | tensorboard | wandb (``pip install -e '.[wandb]'``; WANDB_MODE=offline works without
    network; a resumed run continues the same wandb run). See docs/operations.md."""
    device: str = "auto"
    """auto | cpu | cuda, for every worker. auto picks cuda when the Ray cluster has GPUs (decided after ray.init,
    from the cluster's resources: the driver, e.g. a `ray job submit` entrypoint on a GPU-less head node, needs
    none); cuda on a cluster without GPUs is refused once joined."""
    seed: int = 0
    """Seeds everything random: python/numpy/torch on the driver and every worker rank, the rollout
    engine's sampling (reseeded from (seed, step, turn) every turn, so a resumed run samples what an
    uninterrupted one would) and the environments (es_manager.seed)."""
    ray_num_cpus: float | None = None
    """CPUs for a local Ray cluster (None = all). Ignored when joining RAY_ADDRESS."""
    dashboard_host: str = "127.0.0.1"
    """Interface the Ray dashboard of a local run listens on (127.0.0.1: this machine only; 0.0.0.0 exposes
    it, and the job API, to the network). Ignored when joining RAY_ADDRESS. See docs/cluster.md."""
    dashboard_port: int | None = None
    """Port of the local run's Ray dashboard; None = 8265, or the next free port when it is taken.
    Ignored when joining RAY_ADDRESS."""
    progress_bar: bool = True
    """Show a tqdm progress bar over training steps."""
    log_trajectories_freq: int = 10
    """Every N training steps (and the last), write a sample of episodes to
    ``<run dir>/trajectories/step_N.jsonl`` and regenerate ``trajectories/viewer.html``; 0 disables.
    See docs/operations.md."""
    log_trajectories_per_tag: int = 4
    """Episodes per env tag in each trajectory sample: half successes, half failures when both exist."""
    max_off_policy_steps: int = 0
    """0: each step's rollout runs before its update, with the weights of the step before (on-policy) | 1:
    one-step off-policy overlap (verl's one_step_off_policy): step t+1's rollout is generated while step t
    trains, so every batch is at most one optimizer step old (rollout/policy_staleness); old log-probs are
    then always recomputed, and algorithm.rollout_correction.rollout_is (token) corrects for the staleness.
    Measured on 2 CPU cores: 1.52x per step on a 50-500 ms env (with rollout.mode=async), 1.15x on the main
    job (docs/benchmarks.md, P6). docs/architecture.md, docs/algorithms.md."""
    max_restarts: int = 0
    """How often a run whose actor, critic or reference rank died is restarted in place: every worker is
    torn down and started again, and training continues from the latest checkpoint in default_local_dir
    (from model_path when there is none). 0: the run exits non-zero naming the group and rank."""
    collective_timeout_s: float = 600.0
    """Timeout of the FSDP ranks' torch.distributed collectives (gloo/NCCL process group): a peer lost
    mid-collective fails its group after this long instead of blocking forever."""
    placement_timeout_s: float = 120.0
    """How long a worker group's Ray placement group may take to be placed before the run fails naming
    every group's demand and what the cluster has (the demand is also checked up front)."""
    save_on_signal: bool = True
    """On SIGINT/SIGTERM save a checkpoint at the next step boundary before shutting down (exit 130/143);
    false shuts down without saving. A second signal exits at once."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (e.g. 80 for an H100 80GB). Set, the run's memory plan (``python -m
    agent_trainer.plan``: parameters, gradients, optimizer states, reference, critic, engine share and
    activations per GPU and phase) is computed before ``ray.init`` from the model's config.json, and a run
    whose peak exceeds it is refused naming the setting to turn (gradient checkpointing, offload, micro-batch,
    more GPUs). null: no check. docs/cluster.md."""


@dataclass
class EvalConfig:
    """``python -m agent_trainer.eval``: validation only, no optimizer or critic. See docs/operations.md."""

    k: int = 4
    """Sampled episodes per validation seed (actor_rollout_ref.rollout.temperature/top_p/top_k); pass@k counts
    a seed solved when any of its k succeeds. 0 = greedy only."""
    output_dir: str = "${trainer.default_local_dir}/eval"
    """Where eval_report.json, the trajectories and their viewer.html go."""


@dataclass
class AgentTrainerConfig:
    """The whole run."""

    model_path: str = "models/tiny-qwen2"
    """Default for every ``*.model.path``."""
    micro_batch_size_per_gpu: int = 4
    """Default micro batch for actor, ref and critic."""
    ppo_mini_batch_size: int = 8
    """Default mini batch for actor and critic."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    agent_proxy: AgentProxyConfig = field(default_factory=AgentProxyConfig)
    # One source of truth for the env seeds: es_manager.seed follows trainer.seed unless set.
    es_manager: EsManagerConfig = field(
        default_factory=lambda: EsManagerConfig(seed="${trainer.seed}"))  # type: ignore[arg-type]
    ctx_manager: CtxManagerConfig = field(default_factory=CtxManagerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    multiturn_trajectory: MultiturnTrajectoryConfig = field(default_factory=MultiturnTrajectoryConfig)
    """Multi-turn GRPO (seed 004): the context condenser of ctx_manager.mode=condensed. docs/multiturn_grpo.md."""
    reward_computation: RewardComputationConfig = field(default_factory=RewardComputationConfig)
    """Trajectory reward computers of multi-turn GRPO (off unless enable). docs/multiturn_grpo.md."""
    trajectory_profiling: TrajectoryProfilingConfig = field(default_factory=TrajectoryProfilingConfig)
    envs_file: str = ""
    """YAML with the env tags (RAGEN's custom_envs); empty = config/envs.yaml of this project."""
    train_cfgs: dict[str, Any] = field(default_factory=dict)
    """align-anything's section (seed 002), accepted in config files and on the command line: each key is
    rewritten onto this project's key with a one-line notice, or refused naming what to set
    (docs/compatibility.md); a key the command line sets under this project's name wins over the file's."""
    model_cfgs: dict[str, Any] = field(default_factory=dict)
    """align-anything's section, rewritten like train_cfgs (e.g. use_reward_critic -> critic.enable)."""
    env_cfgs: dict[str, Any] = field(default_factory=dict)
    """align-anything's section, rewritten like train_cfgs (its keys are refused, naming what to set)."""

    @property
    def critic_enabled(self) -> bool:
        """Whether a critic worker is started."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.estimator() in core_algos.CRITIC_ESTIMATORS

    @property
    def ref_enabled(self) -> bool:
        """Whether a reference-policy worker is started."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward


@lru_cache(maxsize=1)
def config_schema() -> DictConfig:
    """The typed schema as an OmegaConf node: every key, its type and default (callers must not modify it)."""
    return OmegaConf.structured(AgentTrainerConfig)


def load_config(cfg: DictConfig | Mapping[str, Any], overrides: Sequence[str] = ()) -> AgentTrainerConfig:
    """Rewrite align-anything sections, check the keys against the typed schema, merge, resolve ``${...}``, validate.

    The keys are checked on the plain key tree first: hydra's ``+key=value`` adds a key
    that the schema lacks, and a merge onto the schema would keep it (config_errors).
    ``overrides`` (the command line's) win over a config file's ``train_cfgs`` / ``model_cfgs`` /
    ``env_cfgs`` keys (``compat.rewrite_config_sections``, one notice per key).
    Raises ``ValueError`` with one line naming the key, the value and the fix.
    """
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    raw, notices = compat.rewrite_config_sections(raw, overrides)
    for notice in notices:
        logger.warning(notice)
    typed: AgentTrainerConfig = merge_onto_schema(raw, config_schema())
    validate_config(typed)
    return typed


def merge_onto_schema(cfg: DictConfig | Mapping[str, Any], schema: DictConfig) -> Any:
    """Refuse unknown keys, merge ``cfg`` onto a structured ``schema``, resolve ``${...}``; the typed object.

    Shared by every entry point's config (RL, SFT). Raises ``ValueError`` with one line.
    """
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    config_errors.check_known_keys(raw, schema)
    merged = None
    try:
        merged = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(config_errors.one_line(err, schema, config=merged)) from None
