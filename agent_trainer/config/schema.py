"""Typed configuration: one dataclass per component, defaults in one place.

The YAML files under ``config/`` (hydra) are merged onto these dataclasses by
:func:`agent_trainer.config.loading.merge_config`: an unknown key (also in hydra's ``+key=value`` form) or a
value of the wrong type fails at start-up naming the key (``agent_trainer.config.errors``), and every
value that cannot work is refused by ``agent_trainer.checks.rl.validate_config``, all before
``ray.init``, each with one line giving the key, the value and the fix.

Section names follow RAGEN's ``base.yaml``: ``model_path``,
``actor_rollout_ref``, ``critic``, ``algorithm``, ``trainer``, ``agent_proxy``,
``es_manager``, ``ctx_manager``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from agent_trainer.config.envs import EnvGroupsConfig, EsManagerConfig
from agent_trainer.config.multiturn import (
    DEFAULT_KEEP_LAST_N,
    ContextCondenserConfig,
    MultiturnGRPOConfig,
     MultiturnTrajectoryConfig,
    TrajectoryProfilingConfig,
)
from agent_trainer.config.rewards import (DataConfig, JudgeConfig, RewardComputationConfig, RewardConfig,
                                          RewardModelConfig)
from agent_trainer.config.splits import Split
from agent_trainer.config.workers import ActorRolloutRefConfig, CriticConfig, FSDPConfig, ModelConfig, RefConfig


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
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``) on the stream of refilled groups
    (``trainer.refill=group``): a finished group whose episodes all score the same carries no group-relative
    signal; it is set aside (counted) and the stream plays the next group seeds until each env tag's ``n_groups``
    of the batch are informative. docs/algorithms.md, "Dynamic sampling"."""

    enable: bool = False
    """Set aside the finished groups whose episodes all scored the same (needs trainer.refill=group; counted in
    rollout/set_aside_groups) and keep playing until each env tag's n_groups of the batch are informative."""
    metric: str = "reward"
    """What must differ within a group: reward (the episode's reward as trained on: its turns' env rewards,
    format penalties included) | success (the env's success flag)."""
    max_num_gen_batches: int = 10
    """At most this many rollouts' worth of an env tag's groups (its n_groups each) set aside in a row; one more
    saves the last trained step and stops the run with an error naming this key (the task is then solved or
    hopeless at this policy's sampling; the same command continues from the checkpoint). At least 1."""


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
    rollout_rs: str | None = None
    """null (off) | token: IcePop-style masking (verl's rollout_rs): each generated token whose ratio pi_old /
    pi_rollout falls outside [rollout_rs_threshold_lower, rollout_rs_threshold] gets no gradient
    (actor/rollout_rs_masked_frac). With rollout_is set too, the kept tokens are also reweighted. Needs rollout
    temperature 1 and the trainer's old log-probs, as rollout_is. docs/algorithms.md."""
    rollout_rs_threshold: float = 5.0
    """The upper bound of the kept ratios (IcePop's beta, 5); at least 1."""
    rollout_rs_threshold_lower: float = 0.5
    """The lower bound of the kept ratios (IcePop's alpha, 0.5); in (0, 1]."""
    bypass_mode: bool = False
    """true: the engine's log-probs (rollout_log_probs) are the old policy of PPO's ratio, which then clips against
    the policy that sampled, and the old-log-prob forward (the log_prob phase) never runs (verl's bypass_mode).
    Needs rollout temperature 1 and rollout_is null (the weights pi_old / pi_rollout would all be 1)."""


@dataclass
class DistillConfig:
    """On-policy distillation (``algorithm.distill``; prime-rl's opd, slime's --use-opd, TRL's DistillationTrainer):
    a frozen teacher scores every token the student sampled, and the per-token reverse KL on the sampled token,
    log pi_student - log pi_teacher, is the learning signal. docs/distillation.md."""

    enable: bool = False
    """Start the teacher and distill from it (off by default)."""
    teacher_path: str = ""
    """The teacher: a Hugging Face causal-LM folder or hub id with the student's tokenizer, or a full-weight checkpoint
    of this project (<run dir>/global_step_N/actor, saved with trainer.save_hf_model)."""
    mode: str = "advantage"
    """advantage: coef * (log pi_teacher - log pi_student) is each generated token's advantage (pure distillation;
    the task reward is logged, not trained on) | reward: the same per-token term is added to the token rewards
    before algorithm.adv_estimator runs (distillation mixed with the task reward)."""
    coef: float = 1.0
    """Weight of the per-token term (> 0)."""
    dtype: str | None = None
    """The teacher's parameter dtype: float32 | bfloat16 | float16 | null (= actor_rollout_ref.model.dtype)."""
    log_prob_micro_batch_size_per_gpu: int = "${micro_batch_size_per_gpu}"  # type: ignore[assignment]
    """Rows per teacher forward on one rank."""
    colocate: bool = False
    """Host the teacher in the actor's processes (as actor_rollout_ref.ref.colocate does the reference): each actor
    rank holds its shard of the teacher and scores its share of the batch, with no process of its own. False: a
    group of fsdp.world_size ranks of its own (its own CPUs or GPUs; a teacher larger than the student)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """The teacher group's sharding and CPUs (colocate=false); fsdp.param_offload keeps its shards in host memory
    (GPU only), colocated too. Colocated, the teacher is sharded over the actor's ranks: the other keys are refused."""

    def teacher_model(self, student: ModelConfig) -> ModelConfig:
        """The teacher's model section: the student's, at teacher_path, in the teacher's dtype, without LoRA."""
        return dataclasses.replace(student, path=self.teacher_path, dtype=self.dtype or student.dtype,
                                   lora_rank=0, lora_adapter_path=None, enable_gradient_checkpointing=False)

    def teacher_forward(self) -> RefConfig:
        """The reference-worker settings the teacher group runs with
        (``agent_trainer.workers.actor.ReferenceWorker``)."""
        return RefConfig(log_prob_micro_batch_size_per_gpu=self.log_prob_micro_batch_size_per_gpu, colocate=False,
                         fsdp=self.fsdp, dtype=self.dtype)


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL-in-reward."""

    adv_estimator: str = "gae"
    """gae | bi_level_gae | grpo | grpo_multiturn | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | gigpo."""
    bi_level_gae: bool = False
    """Alias (RAGEN's spelling) of adv_estimator=bi_level_gae, the documented spelling: true, with adv_estimator gae or
    bi_level_gae, is rewritten on load to adv_estimator=bi_level_gae (and reads back false); with any other estimator
    it is refused as a conflict."""
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
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling: groups whose episodes all score the same set aside, the stream refilling until
    the batch is full of informative groups (needs trainer.refill=group)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (off unless enable). docs/distillation.md."""
    nonfinite_reward: str = "error"
    """What a NaN or infinite episode reward does (checked right after each rollout, before shaping):
    error (stop, naming the env tag, env_id and group seed) | drop (leave the episode, all its rows, out of
    the step; counted in rollout/nonfinite_dropped). Non-finite advantages always stop the step."""


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
class GatewayConfig:
    """An agent written against the ``openai`` client, trained through the OpenAI-compatible gateway
    (docs/gateway.md)."""

    agent: str | None = None
    """Import path (package.module.function or package.module:function) of ``async def run(task, client)``:
    it plays one episode with an ``openai.AsyncOpenAI`` client whose base URL is the episode's gateway session
    and returns its reward (a float) or None (the env's rewards). null: the built-in agents (agent_cls)."""
    host: str = "127.0.0.1"
    """Where the gateway listens; another address exposes it beyond this machine (every request still needs
    the run's key)."""
    port: int = 0
    """0 takes a free port."""
    episode_timeout_s: float = 300.0
    """Per-episode deadline: an agent that has not returned by then is cancelled; its episode ends with the
    calls it made (rollout/gateway_agent_timeouts)."""


@dataclass
class McpServerConfig:
    """One MCP server whose tools the tool-calling agent (agent_cls=tool_call) offers the policy beside the env's
    actions (docs/agents.md, "MCP tools"). Set exactly one of command (stdio) and url (streamable HTTP)."""

    name: str = ""
    """The server's name in messages and tool-call records (required, unique among agent_proxy.mcp_servers)."""
    command: list[str] = field(default_factory=list)
    """stdio: the command line that starts the server (the run starts it and talks MCP over its stdin/stdout),
    e.g. [python, examples/mcp/calculator_server.py]; python (or python3) first is the run's own interpreter."""
    url: str | None = None
    """streamable HTTP: the server's endpoint, e.g. http://127.0.0.1:8765/mcp."""
    api_key_env: str | None = None
    """HTTP: the name of an environment variable (on the driver) holding the key sent as Authorization: Bearer;
    null: no key. The key itself is never in the config, a log or a checkpoint."""
    env_vars: list[str] = field(default_factory=list)
    """stdio: names of the driver's environment variables passed to the server (the SDK passes only HOME, PATH and
    a few others)."""
    tools: list[str] | None = None
    """The server's tools offered to the policy; null: every tool it lists."""
    connect_timeout_s: float = 20.0
    """How long starting or reaching the server and listing its tools may take."""
    call_timeout_s: float = 30.0
    """How long one tool call may take; a server that does not answer in time ends the episode as a service failure
    (rollout/service_failures, left out of training) and is reconnected for the next call."""
    max_result_chars: int = 2000
    """A tool result longer than this is cut (the policy reads it as a tool message)."""


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
    mcp_servers: list[McpServerConfig] = field(default_factory=list)
    """MCP servers whose tools the tool-calling agent (agent_cls=tool_call) offers besides the env's actions, e.g.
    [{name: calc, command: [python, examples/mcp/calculator_server.py]}]; each must answer at start-up. See
    docs/agents.md, "MCP tools"."""
    reward_normalization: RewardNormalizationConfig = field(default_factory=RewardNormalizationConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


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
    """Show a tqdm progress bar over training steps, only when stderr is a terminal. When the output goes to a
    file (``make train > log``, ``ray job submit`` logs) there is no bar and no redraw: the console logger's line
    per step (``trainer.logger`` console) is the progress."""
    log_trajectories_freq: int = 10
    """Every N training steps (and the last), write a sample of episodes to
    ``<run dir>/trajectories/step_N.jsonl`` and regenerate ``trajectories/viewer.html``; 0 disables.
    See docs/operations.md."""
    log_trajectories_per_tag: int = 4
    """Episodes per env tag in each training step's trajectory sample: half successes, half failures when both
    exist (``agent_trainer.eval`` writes every episode it evaluates)."""
    collapse_metrics_freq: int = 0
    """Every N training steps (and the last), log RAGEN-2's template-collapse diagnostic: the mutual information
    between each episode's first prompt and its first reply, per token (collapse/mi_estimate) and per reply
    (collapse/mi_seq_estimate), the conditional entropy H(R|X) (collapse/conditional_entropy_est, ..._seq_est) and
    its ceiling log M (collapse/mi_upper_bound), from every reply of the step's rollout (all groups, before the
    reward-variance filter) scored by the actor after up to collapse_metrics_num_prompts distinct prompts
    (timing_s/collapse). Low MI with a high conditional entropy is template collapse: the replies vary but no longer
    depend on the observation. 0 (the default: one more actor forward of replies x M rows on the steps it runs;
    0.12 to 0.22 s per step, on steps of 0.7 to 5.3 s, in the tiny model's 8-episode e2e run) disables; 10 is a
    good value.
    Needs es_manager.train.env_groups >= 2. See docs/operations.md."""
    collapse_metrics_num_prompts: int = 8
    """M, the distinct first-turn prompts (env groups) drawn for the diagnostic; every reply to a drawn prompt is scored
    after each of them (replies x M extra rows for the actor's log-prob forward). At least 2."""
    max_off_policy_steps: int = 0
    """0: each step's rollout runs before its update, with the weights of the step before (on-policy) | 1:
    one-step off-policy overlap (verl's one_step_off_policy): step t+1's rollout is generated while step t
    trains, so every batch is at most one optimizer step old (rollout/policy_staleness); old log-probs are
    then always recomputed, and algorithm.rollout_correction.rollout_is (token) corrects for the staleness.
    Measured on 2 CPU cores: 1.52x per step on a 50-500 ms env (with rollout.mode=async), 1.15x on the main
    job (docs/benchmarks.md, P6) | k >= 2: asynchronous: a producer thread keeps the next k steps' rollouts
    (whole groups) generating back to back, syncing the engines to the newest actor version between two of
    them (async_mode=continuous: also while they run); the trainer takes the oldest; no batch is more than k
    versions old (one that is would be dropped, rollout/stale_dropped). prime-rl's max_off_policy_steps, AReaL's
    max_head_offpolicyness, TRL's max_staleness. Measured on the same env with GRPO, episodes per second over
    synchronous: 1.94x at k = 2 and 2.72x at k = 4 with async_mode=continuous and k rollouts in flight
    (rollouts_in_flight), 1.12x at k = 2 with one rollout at a time (docs/benchmarks.md, P8).
    Critic-free estimators only. docs/architecture.md, docs/algorithms.md."""
    async_mode: str = "buffered"
    """How a run with max_off_policy_steps k >= 1 hands the engines new weights. buffered: only between two
    rollouts, so every episode (and batch) comes from one policy version (k = 1: one-step off-policy; k >= 2: the
    producer queue above) | continuous: also while a rollout runs, at a safe point between two engine calls (no
    call in flight; skipped while the actor updates, never waited for): episodes in flight go on under the new
    weights, each generated token records the version that produced it (batch key token_versions) and the
    bound applies per token: a group whose oldest token is more than k versions behind the weights its step
    trains from is handled by stale_groups (slime's --partial-rollout, AReaL's max_head_offpolicyness, verl's
    fully-async trainer, prime-rl's max_off_policy_steps). Needs k >= 1 and a critic-free estimator. The gateway's
    agents too: each chat completion's tokens carry the version of the engine call that served it.
    docs/architecture.md, "Rollout overlapping training"."""
    rollouts_in_flight: int | None = None
    """How many of the buffered rollouts (max_off_policy_steps k) run at once with async_mode=continuous, each on
    env actors of its own (agent_proxy.num_env_actors more per rollout); their engine calls are taken one at a
    time, the waiting ones together (share_engine_calls), and each weight sync waits for the call in flight. A
    rollout that waits on slow environments leaves the engines to the others, so the next steps' batches are
    ready sooner: the producer gets up to k steps ahead.
    null (the default): k with async_mode=continuous, else 1 (one rollout at a time, the only choice with
    buffered, where an episode must not change policy). Between 1 and k. AReaL's max_concurrent_rollouts.
    With refill=group: the group slots, this many times es_manager.train.env_groups.
    docs/architecture.md, "Several rollouts in flight"."""
    share_engine_calls: bool = True
    """With several rollouts in flight (rollouts_in_flight > 1) and rollout.mode=async: their requests that wait
    for the engines go out in one engine call (true), each prompt with its own seed, so a rollout samples the
    tokens it samples alone; the leader waits for the other rollouts' next requests at most a quarter of the last
    calls' time (and 50 ms). false: each engine call carries one rollout's requests. docs/architecture.md,
    "Several rollouts in flight"."""
    stale_groups: str = "drop"
    """A group of a taken batch whose oldest generated token is more than max_off_policy_steps versions behind:
    drop (the group leaves the batch, the step trains the others; the whole batch is dropped when no group is
    left) | replace (the whole batch is dropped and the step takes the next buffered one, else rolls out now).
    Either way its episodes count in rollout/stale_dropped. With async_mode=buffered every group of a batch has
    one version, so the two are the same."""
    refill: str = "rollout"
    """What the producer refills with async_mode=continuous. rollout: a whole rollout (every group of a step reset
    together, its batch ready when its slowest group ends) | group: the train split's env actors host
    rollouts_in_flight x es_manager.train.env_groups group slots (as many episodes in flight as that many whole
    rollouts), each reset with its env tag's next group seed as soon as its group ends, and a step takes each
    tag's n_groups finished groups of the oldest versions as soon as they are ready (AReaL's streaming rollout,
    verl's fully-async trainer): a slow group holds only its own slot. A tag's group starts only while its groups
    started (minus those dropped) number fewer than min(actor version + k + 1, total_training_steps) x n_groups;
    a group with a token more than k versions behind the next step's weights is ended at once (in flight) or
    left out when taken, counted in rollout/stale_dropped, and the next group takes its place, whatever
    stale_groups says. Needs actor_rollout_ref.rollout.mode=async and the built-in agents (not the gateway's,
    not ReMax's greedy baseline). A checkpoint discards the groups not yet trained
    (rollout/buffered_not_checkpointed). docs/architecture.md, "Groups refilled as they end"."""
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
    """Where eval_report.json, the trajectories and their viewer.html go; with ``--checkpoint`` (or a checkpoint's
    ``actor`` as model_path) it is ``<checkpoint>/eval`` unless given."""


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
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM judge's scores as rewards (off unless enable). docs/rewards.md, "Judges"."""
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
    def ref_enabled(self) -> bool:
        """Whether a reference-policy worker is started."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward


def keep_last_n(cfg: AgentTrainerConfig) -> int:
    """The one value of ctx_manager.keep_last_n_turns / context_condenser.keep_last_n_steps (checked to agree)."""
    steps = cfg.multiturn_trajectory.context_condenser.keep_last_n_steps
    turns = cfg.ctx_manager.keep_last_n_turns
    return next((v for v in (steps, turns) if v is not None), DEFAULT_KEEP_LAST_N)


def split_config(cfg: AgentTrainerConfig, split: Split | str) -> EnvGroupsConfig:
    """The groups a split plays; remax_baseline: the training groups with one episode each."""
    if split not in tuple(Split):
        raise ValueError(f"split must be one of {list(Split)}, got {split!r}")
    if split == Split.REMAX_BASELINE:
        return dataclasses.replace(cfg.es_manager.train, group_size=1)
    return cfg.es_manager.train if split == Split.TRAIN else cfg.es_manager.val


def rollouts_in_flight(cfg: AgentTrainerConfig) -> int:
    """``trainer.rollouts_in_flight``, its default resolved: ``max_off_policy_steps`` with
    ``async_mode=continuous``, else 1 (one rollout at a time)."""
    t = cfg.trainer
    if t.rollouts_in_flight is not None:
        return t.rollouts_in_flight
    return t.max_off_policy_steps if t.max_off_policy_steps >= 1 and t.async_mode == "continuous" else 1


def condenser_config(cfg: AgentTrainerConfig) -> ContextCondenserConfig:
    """``multiturn_trajectory.context_condenser`` with keep_last_n_steps and max_condensed_tokens resolved."""
    rollout = cfg.actor_rollout_ref.rollout
    cc = cfg.multiturn_trajectory.context_condenser
    budget = cc.max_condensed_tokens if cc.max_condensed_tokens is not None \
        else rollout.max_model_len - rollout.response_length
    return dataclasses.replace(cc, keep_last_n_steps=keep_last_n(cfg), max_condensed_tokens=budget)
