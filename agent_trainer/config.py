"""Typed configuration: one dataclass per component, defaults in one place.

The YAML files under ``config/`` (hydra) are merged onto these dataclasses, so
an unknown key or a value of the wrong type fails at start-up naming the key.
Cross-field rules live in :func:`validate_config` and run before ``ray.init``;
each error gives the values, the rule and the fix.

Section names follow RAGEN's ``base.yaml``: ``model_path``,
``actor_rollout_ref``, ``critic``, ``algorithm``, ``trainer``, ``agent_proxy``,
``es_manager``, ``ctx_manager``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agent_trainer import core_algos
from agent_trainer.ctx_manager import CTX_MODES
from agent_trainer.es_manager import EsManagerConfig

CONDENSED_ESTIMATORS = ("grpo_multiturn",)
"""Estimators that read the per-turn rows of ``ctx_manager.mode=condensed`` as trajectories (via ``traj_uid``)."""


@dataclass
class ModelConfig:
    """Which checkpoint a worker loads."""

    path: str = "${model_path}"
    """Hugging Face folder or hub id (any causal LM; the tiny model is just a folder)."""
    dtype: str = "float32"
    """Parameter dtype for training and rollout: float32 | bfloat16 (bfloat16 needs a GPU or a recent CPU)."""
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


@dataclass
class ActorConfig:
    """The policy's PPO update (verl's ``actor_rollout_ref.actor``)."""

    ppo_mini_batch_size: int = "${ppo_mini_batch_size}"  # type: ignore[assignment]
    """Rows (sequences) per optimizer step, across all ranks."""
    ppo_micro_batch_size_per_gpu: int = "${micro_batch_size_per_gpu}"  # type: ignore[assignment]
    """Rows per forward/backward on one rank (gradient accumulation inside a mini-batch)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per training step."""
    clip_ratio: float = 0.2
    """Symmetric PPO clip range, used where clip_ratio_low/high are unset."""
    clip_ratio_low: float = 0.2
    """Lower clip range (1 - low); StarPO-S uses 0.2."""
    clip_ratio_high: float = 0.28
    """Upper clip range (1 + high); StarPO-S uses 0.28 (clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
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
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = field(default_factory=lambda: FSDPConfig(world_size=2))


@dataclass
class RefConfig:
    """The frozen reference policy (only started when a KL term needs it)."""

    log_prob_micro_batch_size_per_gpu: int = "${micro_batch_size_per_gpu}"  # type: ignore[assignment]
    """Rows per forward on one rank."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


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
    """Max new tokens per turn."""
    max_model_len: int = 2048
    """Max tokens of a whole episode (prompt and every turn); longer episodes are truncated and end."""
    num_workers: int = 1
    """Rollout engines; episodes are split across them."""
    kv_cache_space_gib: float = 1.0
    """vLLM CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.5
    """vLLM GPU memory share (GPU only)."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor parallelism (GPU only)."""
    num_cpus_per_worker: float = 0.5
    """Ray CPU accounting per engine."""
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
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


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
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(policy || ref) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for KL-in-reward."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)

    def estimator(self) -> str:
        """The estimator actually used (``bi_level_gae: true`` upgrades ``gae``)."""
        return core_algos.resolve_adv_estimator(self.adv_estimator, self.bi_level_gae)


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
    reward_normalization: RewardNormalizationConfig = field(default_factory=RewardNormalizationConfig)


@dataclass
class CtxManagerConfig:
    """How an episode's context is laid out for the policy."""

    mode: str = "full"
    """full: every turn is appended to one token sequence (one training row per episode). condensed: each
    turn's prompt is rebuilt from the instruction, a text summary of the last keep_last_n_turns turns and the
    current observation; one training row per turn (needs algorithm.adv_estimator=grpo_multiturn)."""
    keep_last_n_turns: int = 2
    """condensed mode: how many previous turns (answer, reward, observation) the summary in each prompt keeps."""


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
    """Validate every N steps (and after the last); <= 0 disables."""
    val_before_train: bool = False
    """Validate once before the first step."""
    save_freq: int = -1
    """Save a checkpoint every N steps; <= 0 disables."""
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: metrics.jsonl, tensorboard events, checkpoints."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console | jsonl | tensorboard."""
    device: str = "auto"
    """auto | cpu | cuda. auto picks cuda when available."""
    seed: int = 0
    """Seeds torch, the rollout engine and the environments."""
    ray_num_cpus: float | None = None
    """CPUs for a local Ray cluster (None = all). Ignored when joining RAY_ADDRESS."""
    progress_bar: bool = True
    """Show a tqdm progress bar over training steps."""


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
    es_manager: EsManagerConfig = field(default_factory=EsManagerConfig)
    ctx_manager: CtxManagerConfig = field(default_factory=CtxManagerConfig)
    envs_file: str = ""
    """YAML with the env tags (RAGEN's custom_envs); empty = config/envs.yaml of this project."""

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


def load_config(cfg: DictConfig | dict[str, Any]) -> AgentTrainerConfig:
    """Merge a (hydra) config onto the typed schema, resolve ``${...}``, validate.

    Raises ``ValueError`` naming the offending key for unknown keys, wrong
    types and broken cross-field rules.
    """
    schema = OmegaConf.structured(AgentTrainerConfig)
    try:
        merged = OmegaConf.merge(schema, cfg)
        OmegaConf.resolve(merged)
        typed: AgentTrainerConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except Exception as err:  # omegaconf's errors name the full key; keep that text
        raise ValueError(f"invalid config: {err}") from err
    validate_config(typed)
    return typed


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate_config(cfg: AgentTrainerConfig) -> None:
    """Cross-field checks, run before any worker starts."""
    actor = cfg.actor_rollout_ref.actor
    rollout = cfg.actor_rollout_ref.rollout
    core_algos.validate_algorithm_choices(
        adv_estimator=cfg.algorithm.adv_estimator,
        loss_agg_mode=actor.loss_agg_mode,
        kl_loss_type=actor.kl_loss_type,
        policy_loss_mode=actor.policy_loss_mode,
        kl_ctrl_type=cfg.algorithm.kl_ctrl.type,
        bi_level_gae=cfg.algorithm.bi_level_gae,
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        high_level_gamma=cfg.algorithm.high_level_gamma,
    )
    core_algos.check_choice("critic.loss_agg_mode", cfg.critic.loss_agg_mode, core_algos.LOSS_AGG_MODES)
    core_algos.check_choice("actor_rollout_ref.rollout.name", rollout.name, ("vllm", "hf"))
    core_algos.check_choice("trainer.device", cfg.trainer.device, ("auto", "cpu", "cuda"))
    for name in cfg.trainer.logger:
        _check(name in ("console", "jsonl", "tensorboard"),
               f"trainer.logger contains {name!r}; allowed: console, jsonl, tensorboard")
    _check(cfg.agent_proxy.max_turn >= 1, f"agent_proxy.max_turn = {cfg.agent_proxy.max_turn} must be >= 1")
    _check(rollout.response_length < rollout.max_model_len,
           f"actor_rollout_ref.rollout.response_length ({rollout.response_length}) must be smaller than "
           f"max_model_len ({rollout.max_model_len})")
    _check(actor.clip_ratio_c > 1.0, f"actor_rollout_ref.actor.clip_ratio_c = {actor.clip_ratio_c} must be > 1")
    _validate_ctx_manager(cfg)
    _validate_rollout_shaping(cfg)

    # Condensed mode makes one row per turn, so the row count varies per step and only the per-rank
    # split of a mini-batch can be checked here. The trainer pads every update to whole mini-batches
    # (trainer.pad_for_update), which also covers batches that rollout filtering shrank.
    train = cfg.es_manager.train
    rows = None if cfg.ctx_manager.mode == "condensed" else train.env_groups * train.group_size
    _check_batching("actor_rollout_ref.actor", rows, actor.ppo_mini_batch_size,
                    actor.ppo_micro_batch_size_per_gpu, actor.fsdp.world_size)
    if cfg.critic_enabled:
        _check_batching("critic", rows, cfg.critic.ppo_mini_batch_size,
                        cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.fsdp.world_size)
    elif cfg.algorithm.estimator() in core_algos.CRITIC_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator = {cfg.algorithm.estimator()} needs values but critic.enable is "
                         "false; set critic.enable=true or pick a critic-free estimator such as grpo")


def _validate_ctx_manager(cfg: AgentTrainerConfig) -> None:
    """Context mode and estimator must agree: per-turn rows need a trajectory-level estimator, and back."""
    mode, estimator = cfg.ctx_manager.mode, cfg.algorithm.estimator()
    core_algos.check_choice("ctx_manager.mode", mode, CTX_MODES)
    _check(cfg.ctx_manager.keep_last_n_turns >= 0,
           f"ctx_manager.keep_last_n_turns = {cfg.ctx_manager.keep_last_n_turns} must be >= 0 (0 = no history)")
    # Raise rather than fall back: with one row per episode grpo_multiturn computes exactly grpo, and a
    # verl/RAGEN user who picks it expects condensed per-turn rows; a silent equivalence hides the mistake.
    _check(not (estimator == "grpo_multiturn" and mode == "full"),
           "algorithm.adv_estimator = 'grpo_multiturn' needs one training row per turn, but ctx_manager.mode = "
           "'full' makes one row per episode (grpo_multiturn would silently equal grpo); set ctx_manager.mode="
           "condensed (see config/frozenlake_grpo_multiturn.yaml) or algorithm.adv_estimator=grpo")
    # Per-turn rows of one episode only form a trajectory for estimators that group them by traj_uid:
    # GAE / bi-level GAE would lose the value bootstrap between rows, and per-row outcome estimators
    # (grpo, rloo, reinforce_plus_plus*, remax) would score each turn as if it were a whole episode.
    _check(mode != "condensed" or estimator in CONDENSED_ESTIMATORS,
           f"ctx_manager.mode = 'condensed' makes one row per turn, which only {list(CONDENSED_ESTIMATORS)} reads as "
           f"trajectories, but algorithm.adv_estimator = {estimator!r} (critic estimators would lose the value "
           "bootstrap across rows; per-row outcome estimators would score each turn alone); set "
           "algorithm.adv_estimator=grpo_multiturn or ctx_manager.mode=full")


def _validate_rollout_shaping(cfg: AgentTrainerConfig) -> None:
    """Reward normalisation and rollout filtering choices (names come from core_algos)."""
    norm = cfg.agent_proxy.reward_normalization
    rollout = cfg.actor_rollout_ref.rollout
    core_algos.check_choice("agent_proxy.reward_normalization.grouping", norm.grouping,
                            core_algos.REWARD_NORM_GROUPINGS)
    core_algos.check_choice("agent_proxy.reward_normalization.method", norm.method, core_algos.REWARD_NORM_METHODS)
    strategy, value = rollout.rollout_filter_strategy, rollout.rollout_filter_value
    core_algos.check_choice("actor_rollout_ref.rollout.rollout_filter_strategy", strategy,
                            core_algos.ROLLOUT_FILTER_STRATEGIES)
    low_ok = value >= 0.0 if strategy == "min_p" else value > 0.0
    _check(low_ok and value <= 1.0,
           f"actor_rollout_ref.rollout.rollout_filter_value = {value} must lie in "
           f"{'[0, 1]' if strategy == 'min_p' else '(0, 1]'} for rollout_filter_strategy {strategy!r}; "
           "use 1.0 to keep every group (StarPO-S uses top_k 0.25)")
    # top_k ranks groups by in-group reward std; with one episode per group every std is 0 and the
    # kept groups would be an arbitrary prefix.
    _check(not (strategy == "top_k" and value < 1.0 and cfg.es_manager.train.group_size < 2),
           f"actor_rollout_ref.rollout.rollout_filter_value = {value} filters groups by their reward std, which is "
           f"0 for groups of one (es_manager.train.group_size = {cfg.es_manager.train.group_size}); set "
           "es_manager.train.group_size >= 2 or rollout_filter_value=1.0")


def _check_batching(section: str, rows: int | None, mini: int, micro: int, world: int) -> None:
    """Every rank must run the same number of micro-batches, or FSDP collectives hang.

    ``rows`` is the number of rows per step, or None when it varies (condensed mode).
    """
    _check(mini >= 1 and micro >= 1 and world >= 1,
           f"{section}: ppo_mini_batch_size ({mini}), ppo_micro_batch_size_per_gpu ({micro}) and "
           f"fsdp.world_size ({world}) must all be >= 1")
    _check(rows is None or rows % mini == 0,
           f"{section}.ppo_mini_batch_size ({mini}) must divide the rows per step "
           f"(es_manager.train.env_groups x group_size = {rows}); pick a divisor of {rows}")
    _check(mini % world == 0,
           f"{section}.ppo_mini_batch_size ({mini}) must be divisible by fsdp.world_size ({world})")
    _check((mini // world) % micro == 0,
           f"{section}.ppo_micro_batch_size_per_gpu ({micro}) must divide ppo_mini_batch_size / fsdp.world_size "
           f"({mini} / {world} = {mini // world})")
