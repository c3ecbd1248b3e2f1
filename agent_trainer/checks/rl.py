"""Start-up checks of the typed config: a value that cannot work is refused before ``ray.init``.

Each error is one line naming the key, the value, the rule and the fix, e.g.
``actor_rollout_ref.rollout.temperature = -0.5 must be >= 0 (0 = greedy); e.g. actor_rollout_ref.rollout.temperature=1.0``.
Single-key ranges and choices are tables (``agent_trainer.checks.rules``); rules that
relate several keys are functions below. Checks that need the file system or the
model's config.json (model paths, ``envs_file``, ``max_position_embeddings``) run in
``agent_trainer.checks.inputs.check_inputs``, still before Ray starts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from agent_trainer import core_algos
from agent_trainer.agents.registry import resolve_agent_cls
from agent_trainer.checks.distill import check_distill
from agent_trainer.checks.engines import check_engine, check_engine_mode, engine_only_keys
from agent_trainer.checks.judge import check_judge
from agent_trainer.checks.multiturn import validate_multiturn
from agent_trainer.checks.plugins import check_plugins
from agent_trainer.checks.rules import (
    DTYPES,
    RANGES,
    check,
    check_optim,
    choices,
    get_key,
    is_number,
    validate_algorithm_choices,
)
from agent_trainer.config.choices import LOGGERS
from agent_trainer.config.errors import check_choice
from agent_trainer.config.rewards import TRAIN_TAG, VAL_TAG
from agent_trainer.config.schema import AgentTrainerConfig, rollouts_in_flight
from agent_trainer.config.splits import CONFIG_SPLITS, Split
from agent_trainer.config.workers import FSDPConfig, ModelConfig, RolloutConfig
from agent_trainer.agents.ctx_manager import COLLATED_KEYS
from agent_trainer.gateway.task import resolve_agent_fn


def validate_config(cfg: AgentTrainerConfig) -> None:
    """Every start-up rule; raises ValueError with one line naming the key, the value and the fix."""
    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    check_plugins(cfg)  # the names merged into the config exist, as the schema's __post_init__ checked before
    validate_algorithm_choices(
        adv_estimator=alg.adv_estimator, loss_agg_mode=actor.loss_agg(), kl_loss_type=actor.kl_loss_type,
        policy_loss_mode=actor.policy_loss_mode, kl_ctrl_type=alg.kl_ctrl.type, bi_level_gae=alg.bi_level_gae,
        gamma=alg.gamma, lam=alg.lam, high_level_gamma=alg.high_level_gamma,
    )
    for key, rule, example in RANGES:
        value = get_key(cfg, key)
        ok = rule.allow_none if value is None else is_number(value) and rule.test(value)
        if not ok:
            raise ValueError(f"{key} = {value!r} {rule.text}; e.g. {key}={example}")
    for key, value, allowed in choices(cfg):
        if value == "float64" and allowed is DTYPES:
            raise ValueError(f"{key} = 'float64' is not supported (FSDP mixed precision and vLLM run float32 at "
                             f"most); set {key}=float32 (or bfloat16 / float16 on GPUs)")
        check_choice(key, value, allowed)
    _check_optimizers(cfg)
    _check_precision(cfg)
    check_offload(cfg, cfg.trainer.device)
    _check_trainer(cfg)
    _check_rollout(cfg)
    _check_estimator(cfg)
    _validate_algorithm_options(cfg)
    _validate_ctx_manager(cfg)
    _check_agent(cfg)
    _validate_rollout_shaping(cfg)
    _check_all_batching(cfg)
    _check_token_budgets(cfg)
    _check_colocated(cfg)
    _check_rollout_correction(cfg)
    _check_async(cfg)
    _check_datasets(cfg)
    _check_reward_model(cfg)
    check_judge(cfg)
    check_distill(cfg)
    _check_lora(cfg)
    validate_multiturn(cfg)


def _check_optimizers(cfg: AgentTrainerConfig) -> None:
    for key, optim in (("actor_rollout_ref.actor.optim", cfg.actor_rollout_ref.actor.optim),
                       ("critic.optim", cfg.critic.optim)):
        check_optim(key, optim)


def _check_precision(cfg: AgentTrainerConfig) -> None:
    """A trained model's master weights (``*.model.dtype``, which AdamW updates in place, its states in the same
    dtype) must be float32 unless low precision is asked for: a bfloat16 weight keeps 8 mantissa bits, so an
    update below 2^-8 of it (lr 1e-6 on weights near 0.01-1) rounds away and the run silently stops learning;
    float16 has no loss scaler here and is refused outright. Compute in bfloat16 with fsdp.mixed_precision=bf16."""
    arr = cfg.actor_rollout_ref
    actor = "actor_rollout_ref.actor"
    trained = [("actor_rollout_ref", arr.model.dtype, arr.actor.allow_low_precision_master, actor,
                f"{actor}.fsdp.mixed_precision=bf16 (and actor_rollout_ref.rollout.dtype=bfloat16 for the engines)")]
    if core_algos.critic_enabled(cfg):  # a colocated critic runs under the actor's fsdp keys
        trained.append(("critic", cfg.critic.model.dtype, cfg.critic.allow_low_precision_master, "critic",
                        f"{actor if cfg.critic.colocate else 'critic'}.fsdp.mixed_precision=bf16"))
    for section, dtype, allowed, role, compute in trained:
        check(dtype != "float16",
              f"{section}.model.dtype = 'float16' trains float16 weights without a loss scaler (gradients underflow); "
              f"set {section}.model.dtype=float32 and compute in bfloat16 with {compute}")
        check(dtype != "bfloat16" or allowed,
              f"{section}.model.dtype = 'bfloat16' makes the master weights and AdamW states bfloat16, where small "
              f"updates round away; set {section}.model.dtype=float32 and compute in bfloat16 with "
              f"{compute}, or {role}.allow_low_precision_master=true")


def check_offload(cfg: AgentTrainerConfig, device: str) -> None:
    """*.fsdp.param_offload / optimizer_offload move GPU state to host memory: refused where the run is on CPU
    (``device``: trainer.device here; the resolved device once the cluster is known, ``auto`` skips), and the
    reference's optimizer_offload always (it has no optimizer)."""
    arr = cfg.actor_rollout_ref
    ref_fsdp = arr.ref.fsdp
    check(not ref_fsdp.optimizer_offload,
          "actor_rollout_ref.ref.fsdp.optimizer_offload = True has nothing to move: the reference has no optimizer; "
          "drop it (actor_rollout_ref.ref.fsdp.param_offload keeps its weights in host memory)")
    if device != "cpu":
        return
    roles = [("actor_rollout_ref.actor", arr.actor.fsdp), ("actor_rollout_ref.ref", ref_fsdp)]
    if core_algos.critic_enabled(cfg) and not cfg.critic.colocate:
        roles.append(("critic", cfg.critic.fsdp))
    if cfg.algorithm.distill.enable:
        roles.append(("algorithm.distill", cfg.algorithm.distill.fsdp))
    for section, fsdp in roles:
        for key in ("param_offload", "optimizer_offload"):
            check(not getattr(fsdp, key),
                  f"{section}.fsdp.{key} = True moves GPU memory to the host, but trainer.device = 'cpu' (nothing "
                  f"to offload); set {section}.fsdp.{key}=false, or train on GPUs")


def _check_trainer(cfg: AgentTrainerConfig) -> None:
    t = cfg.trainer
    for key in ("project_name", "experiment_name", "default_local_dir"):
        check(bool(str(getattr(t, key)).strip()), f"trainer.{key} = {getattr(t, key)!r} must not be empty; "
                                                   "give it a name")
    for name in t.logger:
        check_choice("trainer.logger", name, LOGGERS)
    if "wandb" in t.logger:
        check(importlib.util.find_spec("wandb") is not None,
              f"trainer.logger = {list(t.logger)} names 'wandb', which is not installed; "
              "pip install -e '.[wandb]' (or drop wandb from trainer.logger)")
    check(t.resume_mode != "resume_path" or bool(t.resume_from_path),
          f"trainer.resume_mode = 'resume_path' needs trainer.resume_from_path (got {t.resume_from_path!r}); set "
          "trainer.resume_from_path=<run dir>/global_step_N, or use trainer.resume_mode=auto")
    check(t.resume_from_path is None or t.resume_mode == "resume_path",
          f"trainer.resume_from_path = {t.resume_from_path!r} is only read with trainer.resume_mode=resume_path "
          f"(got {t.resume_mode!r}); add trainer.resume_mode=resume_path or drop resume_from_path")
    groups = cfg.es_manager.train.env_groups
    check(t.collapse_metrics_freq <= 0 or groups >= 2,
          f"trainer.collapse_metrics_freq = {t.collapse_metrics_freq} compares the replies across distinct prompts, "
          f"but es_manager.train.env_groups = {groups} gives one prompt per step (the mutual information is then 0); "
          "set es_manager.train.env_groups >= 2 or trainer.collapse_metrics_freq=0")
    # trainer.device=cuda is checked against the Ray cluster once joined (agent_trainer.workers.build.check_device): the
    # driver, e.g. a `ray job submit` entrypoint on a head node without GPUs, need not see one.


def check_eval(cfg: AgentTrainerConfig) -> None:
    """The evaluation entry's own rule (``python -m agent_trainer.eval``): k samples must be able to differ."""
    temperature = cfg.actor_rollout_ref.rollout.temperature
    check(cfg.eval.k <= 1 or temperature > 0,
          f"eval.k = {cfg.eval.k} samples per seed with actor_rollout_ref.rollout.temperature = {temperature} would "
          "all be the greedy episode; set actor_rollout_ref.rollout.temperature=1.0 or eval.k=0 (greedy only)")


def _check_rollout(cfg: AgentTrainerConfig) -> None:
    r = cfg.actor_rollout_ref.rollout
    check(r.response_length < r.max_model_len,
          f"actor_rollout_ref.rollout.response_length = {r.response_length} must be smaller than "
          f"actor_rollout_ref.rollout.max_model_len = {r.max_model_len} (the whole episode, prompt included); "
          "raise max_model_len or lower response_length")
    engine = check_engine(cfg)  # the registered engine (or import path); tensor parallelism needs one that splits
    if r.tensor_model_parallel_size > 1:
        # trainer.device=auto: checked against the cluster's GPUs once joined (agent_trainer.workers.build.check_device).
        check(cfg.trainer.device != "cpu", f"actor_rollout_ref.rollout.tensor_model_parallel_size = "
                                            f"{r.tensor_model_parallel_size} splits the engine over GPUs, and "
                                            "trainer.device = 'cpu'; set it to 1 (or trainer.device=cuda)")
    _check_hybrid_engine(cfg)
    check_engine_keys(cfg, cfg.trainer.device)
    check_engine_mode(cfg, engine)
    engine.check(cfg)  # the engine's own start-up rules
    for split in CONFIG_SPLITS:
        groups = getattr(cfg.es_manager, split).env_groups
        check(cfg.agent_proxy.num_env_actors <= groups,
              f"agent_proxy.num_env_actors = {cfg.agent_proxy.num_env_actors} is more than es_manager.{split}."
              f"env_groups = {groups} (each actor holds whole groups, so some would hold none); "
              f"set agent_proxy.num_env_actors <= {groups}")


def check_engine_keys(cfg: AgentTrainerConfig, device: str) -> None:
    """A non-default ``actor_rollout_ref.rollout`` key that the chosen engine (or device) never reads is refused.

    Which engines read which keys comes from the engine registry (``checks.engines.engine_only_keys``: each engine
    class's ``only_keys``); every other rollout key is read by every engine on both devices.

    ``device``: cpu | cuda, or auto before the cluster is known (then only the engine's keys are checked; the
    device's once joined, ``agent_trainer.workers.build.check_device``). Raises ValueError with one line naming key, value, fix.
    """
    r, default = cfg.actor_rollout_ref.rollout, RolloutConfig()
    for key, (engines, on) in engine_only_keys().items():
        value = getattr(r, key)
        if value == getattr(default, key):
            continue
        name = f"actor_rollout_ref.rollout.{key}"
        if engines:
            check(r.name in engines,
                  f"{name} = {value!r} is read by the {' / '.join(engines)} engine only, and "
                  f"actor_rollout_ref.rollout.name = {r.name!r} ignores it; drop it (or set rollout.name={engines[0]})")
        check(not on or device in ("auto", on),
              f"{name} = {value!r} is read on {on} only, and the run's engines are on {device} "
              f"(trainer.device = {cfg.trainer.device!r}); drop it")


def _check_hybrid_engine(cfg: AgentTrainerConfig) -> None:
    """actor_rollout_ref.hybrid_engine and rollout.enable_sleep_mode (the device itself: agent_trainer.workers.build.check_device)."""
    arr = cfg.actor_rollout_ref
    r, world = arr.rollout, arr.actor.fsdp.world_size
    if arr.hybrid_engine:
        check(r.tensor_model_parallel_size == 1,
              f"actor_rollout_ref.hybrid_engine = true places one engine in each actor rank's bundle (one GPU), but "
              f"actor_rollout_ref.rollout.tensor_model_parallel_size = {r.tensor_model_parallel_size}; set it to 1 "
              "or actor_rollout_ref.hybrid_engine=false")
        check(r.num_workers <= world,
              f"actor_rollout_ref.hybrid_engine = true places engine i in actor rank i's bundle, but "
              f"actor_rollout_ref.rollout.num_workers = {r.num_workers} is more than actor_rollout_ref.actor.fsdp."
              f"world_size = {world}; set rollout.num_workers <= {world}")
    if r.weight_sync == "cuda_ipc":
        check(cfg.trainer.device != "cpu" and arr.hybrid_engine and r.num_workers == 1,
              f"actor_rollout_ref.rollout.weight_sync = 'cuda_ipc' reaches the one engine on the actor's rank-0 GPU "
              f"(trainer.device cuda, actor_rollout_ref.hybrid_engine=true, rollout.num_workers=1; got device "
              f"{cfg.trainer.device!r}, hybrid_engine={arr.hybrid_engine}, num_workers={r.num_workers}); use "
              "actor_rollout_ref.rollout.weight_sync=auto or collective")
    if r.enable_sleep_mode:
        check(cfg.trainer.device != "cpu",
              "actor_rollout_ref.rollout.enable_sleep_mode = true needs GPU engines (vLLM has no sleep mode on CPU), "
              "and trainer.device = 'cpu'; set actor_rollout_ref.rollout.enable_sleep_mode=false (or null)")
        check(cfg.trainer.max_off_policy_steps == 0,
              "actor_rollout_ref.rollout.enable_sleep_mode = true puts the engines to sleep while the step trains, "
              f"but trainer.max_off_policy_steps = {cfg.trainer.max_off_policy_steps} generates the next rollout "
              "then; set trainer.max_off_policy_steps=0 or actor_rollout_ref.rollout.enable_sleep_mode=false")
    elif r.enable_sleep_mode is None and arr.hybrid_engine and cfg.trainer.device == "cuda":  # auto: once joined
        check(cfg.trainer.max_off_policy_steps == 0,
              "actor_rollout_ref.hybrid_engine = true on GPUs turns sleep mode on (rollout.enable_sleep_mode=null), "
              f"which trainer.max_off_policy_steps = {cfg.trainer.max_off_policy_steps} cannot overlap with; set "
              "trainer.max_off_policy_steps=0, or actor_rollout_ref.rollout.enable_sleep_mode=false to keep both "
              "awake")


def batch_keys(cfg: AgentTrainerConfig) -> tuple[str, ...]:
    """The keys a training batch of ``cfg`` holds when the advantage is computed: what the context manager collates
    (``COLLATED_KEYS``), the critic's ``values``, the reference's ``ref_log_prob``, and ``reward_baselines`` from
    the greedy baseline episodes the trainer plays for an estimator that reads them (ReMax)."""
    spec = core_algos.estimator_spec(core_algos.estimator(cfg.algorithm))
    return (*COLLATED_KEYS, *(("values",) if core_algos.critic_enabled(cfg) else ()),
            *(("ref_log_prob",) if cfg.ref_enabled else ()), *(("reward_baselines",) if spec.greedy_baseline else ()))


def _check_estimator(cfg: AgentTrainerConfig) -> None:
    """The estimator's preconditions (its ``@register_estimator`` spec): groups to compare, turns to compare,
    values when it needs them, every batch key it reads."""
    estimator = core_algos.estimator(cfg.algorithm)
    spec = core_algos.estimator_spec(estimator)
    group_size = cfg.es_manager.train.group_size
    check(not spec.compares_group or group_size >= 2,
          f"algorithm.adv_estimator = {estimator!r} compares the episodes of a group, but es_manager.train.group_size"
          f" = {group_size}: a group of one has nothing to compare with, so the estimator would silently become "
          "REINFORCE without a baseline; set es_manager.train.group_size >= 2 (e.g. 4) or pick a critic "
          "estimator such as gae")
    check(not spec.compares_turns or cfg.agent_proxy.max_turn >= 2,
          f"algorithm.adv_estimator = {estimator!r} compares turns from the same state across episodes, but "
          f"agent_proxy.max_turn = {cfg.agent_proxy.max_turn} gives one-turn episodes (it would equal grpo); "
          "set agent_proxy.max_turn >= 2 or algorithm.adv_estimator=grpo")
    needs_values = spec.needs_critic
    check(cfg.critic.enable is not False or not needs_values,
          f"algorithm.adv_estimator = {estimator!r} needs values but critic.enable = False; set critic.enable=true "
          "(or null) or pick a critic-free estimator such as grpo")
    critics = " / ".join(core_algos.CRITIC_ESTIMATORS)
    check(cfg.critic.enable is not True or needs_values,
          f"critic.enable = True trains a critic whose values algorithm.adv_estimator = {estimator!r} never reads; "
          f"set critic.enable=null (on exactly for {critics}) or algorithm.adv_estimator=gae")
    made = batch_keys(cfg)
    for key in spec.batch_keys:
        check(key in made,
              f"algorithm.adv_estimator = {estimator!r} reads batch[{key!r}], which no part of this run makes (a "
              f"training batch holds {list(made)}); make it before the advantage step (docs/algorithms.md, "
              "'Adding an estimator') or pick another algorithm.adv_estimator")


def _validate_algorithm_options(cfg: AgentTrainerConfig) -> None:
    """algorithm.nonfinite_reward, algorithm.gigpo.*, and what ReMax's greedy baseline can be compared with."""
    alg = cfg.algorithm
    check_choice("algorithm.nonfinite_reward", alg.nonfinite_reward, core_algos.NONFINITE_REWARD_POLICIES)
    check_choice("algorithm.gigpo.mode", alg.gigpo.mode, core_algos.GIGPO_MODES)
    check(is_number(alg.gigpo.epsilon) and alg.gigpo.epsilon > 0,
          f"algorithm.gigpo.epsilon = {alg.gigpo.epsilon} must be > 0 (it keeps the division by a zero std "
          "finite); use e.g. 1e-6")
    check(is_number(alg.gigpo.step_advantage_w) and alg.gigpo.step_advantage_w >= 0,
          f"algorithm.gigpo.step_advantage_w = {alg.gigpo.step_advantage_w} must be >= 0 (0 = episode-level "
          "advantage only); e.g. algorithm.gigpo.step_advantage_w=1.0")
    # The greedy episode's raw reward is the baseline; normalised episode rewards would sit on another scale.
    method = cfg.agent_proxy.reward_normalization.method
    estimator = core_algos.estimator(alg)
    check(not core_algos.estimator_spec(estimator).greedy_baseline or method == "identity",
          f"algorithm.adv_estimator = {estimator!r} subtracts the raw reward of a greedy episode, but "
          f"agent_proxy.reward_normalization.method = {method!r} rescales the sampled episodes' rewards; set "
          "agent_proxy.reward_normalization.method=identity or pick algorithm.adv_estimator=grpo")


def _validate_ctx_manager(cfg: AgentTrainerConfig) -> None:
    """Context mode and estimator must agree: per-turn rows need a trajectory-level estimator, and back."""
    mode, estimator = cfg.ctx_manager.mode, core_algos.estimator(cfg.algorithm)
    layouts = core_algos.estimator_spec(estimator).layouts
    # Raise rather than fall back: with one row per episode grpo_multiturn computes exactly grpo, and a
    # verl/RAGEN user who picks it expects condensed per-turn rows; a silent equivalence hides the mistake.
    check(mode != "full" or "full" in layouts,
          f"algorithm.adv_estimator = {estimator!r} needs one training row per turn, but ctx_manager.mode = "
          f"'full' makes one row per episode ({estimator} would silently equal its one-row-per-episode counterpart, "
          "e.g. grpo_multiturn = grpo); set ctx_manager.mode=condensed (see config/frozenlake_grpo_multiturn.yaml) "
          "or algorithm.adv_estimator=grpo")
    # Per-turn rows of one episode only form a trajectory for estimators that group them by traj_uid:
    # GAE / bi-level GAE would lose the value bootstrap between rows, and per-row outcome estimators
    # (grpo, rloo, reinforce_plus_plus*, remax) would score each turn as if it were a whole episode.
    condensed = [n for n in core_algos.estimator_names() if "condensed" in core_algos.estimator_spec(n).layouts]
    check(mode != "condensed" or "condensed" in layouts,
          f"ctx_manager.mode = 'condensed' makes one row per turn, which only {condensed} reads as "
          f"trajectories, but algorithm.adv_estimator = {estimator!r} (critic estimators would lose the value "
          "bootstrap across rows; per-row outcome estimators would score each turn alone); set "
          "algorithm.adv_estimator=grpo_multiturn or ctx_manager.mode=full")


def _check_agent(cfg: AgentTrainerConfig) -> None:
    """agent_proxy.agent_cls: importable, an Agent subclass, of the layout ctx_manager.mode says (docs/agents.md)."""

    resolve_agent_cls(cfg)
    g = cfg.agent_proxy.gateway
    if g.agent is None or g.agent == "":
        return
    check(not cfg.agent_proxy.agent_cls,
          f"agent_proxy.agent_cls = {cfg.agent_proxy.agent_cls!r} and agent_proxy.gateway.agent = {g.agent!r} are both "
          "set; a run has one agent: unset agent_proxy.agent_cls (docs/gateway.md)")
    resolve_agent_fn(cfg)
    check(isinstance(g.host, str) and g.host != "",
          f"agent_proxy.gateway.host = {g.host!r} must be an address to listen on; e.g. agent_proxy.gateway.host=127.0.0.1")
    check(isinstance(g.port, int) and 0 <= g.port <= 65535,
          f"agent_proxy.gateway.port = {g.port!r} must be 0 (a free port) to 65535")
    at_once = rollouts_in_flight(cfg)
    check(not g.port or at_once == 1,
          f"agent_proxy.gateway.port = {g.port} is one port, but {at_once} rollouts run at once "
          "(trainer.rollouts_in_flight; with trainer.async_mode=continuous its default is "
          "trainer.max_off_policy_steps), each serving its episodes on a gateway of its own; set "
          "agent_proxy.gateway.port=0 (a free port each), or trainer.rollouts_in_flight=1")
    check(is_number(g.episode_timeout_s) and g.episode_timeout_s > 0,
          f"agent_proxy.gateway.episode_timeout_s = {g.episode_timeout_s!r} must be > 0 seconds; e.g. 300")


def _validate_rollout_shaping(cfg: AgentTrainerConfig) -> None:
    """Rollout filtering thresholds (the names are checked in :func:`choices`)."""
    rollout = cfg.actor_rollout_ref.rollout
    strategy, value = rollout.rollout_filter_strategy, rollout.rollout_filter_value
    low_ok = value >= 0.0 if strategy == "min_p" else value > 0.0
    check(is_number(value) and low_ok and value <= 1.0,
          f"actor_rollout_ref.rollout.rollout_filter_value = {value} must lie in "
          f"{'[0, 1]' if strategy == 'min_p' else '(0, 1]'} for rollout_filter_strategy {strategy!r}; "
          "use 1.0 to keep every group (StarPO-S uses top_k 0.25)")
    # top_k ranks groups by in-group reward std; with one episode per group every std is 0 and the
    # kept groups would be an arbitrary prefix.
    check(not (strategy == "top_k" and value < 1.0 and cfg.es_manager.train.group_size < 2),
          f"actor_rollout_ref.rollout.rollout_filter_value = {value} filters groups by their reward std, which is "
          f"0 for groups of one (es_manager.train.group_size = {cfg.es_manager.train.group_size}); set "
          "es_manager.train.group_size >= 2 or rollout_filter_value=1.0")


def _check_all_batching(cfg: AgentTrainerConfig) -> None:
    # Condensed mode makes one row per turn, so the row count varies per step and only the per-rank
    # split of a mini-batch can be checked here. The trainer pads every update to whole mini-batches
    # (trainer.pad_for_update), which also covers batches that rollout filtering shrank.
    train = cfg.es_manager.train
    # A gateway agent's calls may make several rows per episode (n > 1, a template that re-renders a reply).
    varies = cfg.ctx_manager.mode == "condensed" or bool(cfg.agent_proxy.gateway.agent)
    rows = None if varies else train.env_groups * train.group_size
    actor = cfg.actor_rollout_ref.actor
    _check_batching("actor_rollout_ref.actor", rows, actor.ppo_mini_batch_size,
                    actor.ppo_micro_batch_size_per_gpu, actor.fsdp.world_size)
    if core_algos.critic_enabled(cfg):  # a colocated critic runs on the actor's ranks
        critic_world = actor.fsdp.world_size if cfg.critic.colocate else cfg.critic.fsdp.world_size
        _check_batching("critic", rows, cfg.critic.ppo_mini_batch_size,
                        cfg.critic.ppo_micro_batch_size_per_gpu, critic_world)


def _check_batching(section: str, rows: int | None, mini: int, micro: int, world: int) -> None:
    """Every rank must run the same number of micro-batches, or FSDP collectives hang.

    ``rows`` is the number of rows per step, or None when it varies (condensed mode).
    """
    for key, value in (("ppo_mini_batch_size", mini), ("ppo_micro_batch_size_per_gpu", micro)):
        check(value >= 1, f"{section}.{key} = {value} must be >= 1; e.g. {section}.{key}=4")
    check(rows is None or rows % mini == 0,
          f"{section}.ppo_mini_batch_size ({mini}) must divide the rows per step "
          f"(es_manager.train.env_groups x group_size = {rows}); pick a divisor of {rows}")
    check(mini % world == 0,
          f"{section}.ppo_mini_batch_size ({mini}) must be divisible by fsdp.world_size ({world})")
    check((mini // world) % micro == 0,
          f"{section}.ppo_micro_batch_size_per_gpu ({micro}) must divide ppo_mini_batch_size / fsdp.world_size "
          f"({mini} / {world} = {mini // world})")


def _check_token_budgets(cfg: AgentTrainerConfig) -> None:
    """With dynamic batch size every row must fit one micro-batch's token budget (as verl asserts)."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    longest = arr.rollout.max_model_len
    budgets = [("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.use_dynamic_bsz,
                arr.actor.ppo_max_token_len_per_gpu),
               ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_use_dynamic_bsz and
                cfg.ref_enabled, arr.ref.log_prob_max_token_len_per_gpu),
               ("critic.ppo_max_token_len_per_gpu", critic.use_dynamic_bsz and core_algos.critic_enabled(cfg),
                critic.ppo_max_token_len_per_gpu),
               ("critic.forward_max_token_len_per_gpu", critic.use_dynamic_bsz and core_algos.critic_enabled(cfg),
                critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu)]
    for key, on, budget in budgets:
        check(not on or budget >= longest,
              f"{key} = {budget} is smaller than actor_rollout_ref.rollout.max_model_len = {longest}, so a long "
              f"episode would not fit one micro-batch; set {key}={max(longest, 16384)} or lower max_model_len")


def _check_colocated(cfg: AgentTrainerConfig) -> None:
    """A colocated reference or critic lives in the actor's ranks: its own group's sharding keys would do nothing."""
    arr = cfg.actor_rollout_ref
    hosted = [("actor_rollout_ref.ref", arr.ref, cfg.ref_enabled),
              ("critic", cfg.critic, core_algos.critic_enabled(cfg))]
    for section, role, enabled in hosted:
        if not (enabled and role.colocate):
            continue
        for key, default in vars(FSDPConfig()).items():
            if section == "actor_rollout_ref.ref" and key == "param_offload":
                continue  # the reference's own host-memory shards, colocated or not
            value = getattr(role.fsdp, key)
            check(value == default,
                  f"{section}.fsdp.{key} = {value} has no effect: {section}.colocate=true hosts it in the actor's "
                  f"ranks (actor_rollout_ref.actor.fsdp.*); set {section}.colocate=false for a group of its own, "
                  f"or drop {section}.fsdp.{key}")


def _check_rollout_correction(cfg: AgentTrainerConfig) -> None:
    """The IS weights and bypass mode use the engine's log-probs, which are temperature-1 log-probs."""
    rc, temperature = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.rollout.temperature
    level = rc.rollout_is
    check(level is None or temperature == 1.0,
          f"algorithm.rollout_correction.rollout_is = {level!r} compares the trainer's log-probs at "
          f"actor_rollout_ref.rollout.temperature = {temperature} with the engine's temperature-1 log-probs, which "
          "differ by the temperature, not by a mismatch; set actor_rollout_ref.rollout.temperature=1.0 or "
          "algorithm.rollout_correction.rollout_is=null")
    check(rc.rollout_rs is None or temperature == 1.0,
          f"algorithm.rollout_correction.rollout_rs = {rc.rollout_rs!r} masks by the ratio of the trainer's log-probs "
          f"at actor_rollout_ref.rollout.temperature = {temperature} to the engine's temperature-1 log-probs, which "
          "differ by the temperature, not by a mismatch; set actor_rollout_ref.rollout.temperature=1.0 or "
          "algorithm.rollout_correction.rollout_rs=null")
    if not rc.bypass_mode:
        return
    check(rc.rollout_rs is None,
          f"algorithm.rollout_correction.rollout_rs = {rc.rollout_rs!r} masks by pi_old / pi_rollout, which is 1 "
          "everywhere when algorithm.rollout_correction.bypass_mode = true makes the engine's log-probs the old "
          "ones; set algorithm.rollout_correction.rollout_rs=null or bypass_mode=false")
    check(temperature == 1.0,
          f"algorithm.rollout_correction.bypass_mode = true puts the engine's temperature-1 log-probs in PPO's ratio "
          f"against the trainer's at actor_rollout_ref.rollout.temperature = {temperature}; set "
          "actor_rollout_ref.rollout.temperature=1.0 or algorithm.rollout_correction.bypass_mode=false")
    check(level is None,
          f"algorithm.rollout_correction.rollout_is = {level!r} weighs by pi_old / pi_rollout, which is 1 everywhere "
          "when algorithm.rollout_correction.bypass_mode = true makes the engine's log-probs the old ones; set "
          "algorithm.rollout_correction.rollout_is=null or bypass_mode=false")
    recompute = cfg.actor_rollout_ref.actor.recompute_old_log_prob
    check(recompute == "auto",
          f"actor_rollout_ref.actor.recompute_old_log_prob = {recompute!r} asks for the old-log-prob forward, which "
          "algorithm.rollout_correction.bypass_mode = true replaces by the engine's log-probs; drop one of them")


def _check_async(cfg: AgentTrainerConfig) -> None:
    """trainer.max_off_policy_steps >= 2 or trainer.async_mode=continuous (``agent_trainer.rollout.overlap``): critic-free
    estimators, engines and actor awake; continuous needs a rollout ahead (k >= 1) and the turn loops' versions."""
    k = cfg.trainer.max_off_policy_steps
    continuous = cfg.trainer.async_mode == "continuous"
    check(not continuous or k >= 1,
          "trainer.async_mode = 'continuous' updates the engines' weights while rollouts run ahead of training, but "
          "trainer.max_off_policy_steps = 0 runs no rollout ahead; set trainer.max_off_policy_steps=2 (or 1), or "
          "trainer.async_mode=buffered")
    in_flight = cfg.trainer.rollouts_in_flight
    check(in_flight is None or in_flight == 1 or continuous,
          f"trainer.rollouts_in_flight = {in_flight} runs rollouts at once, which take new weights while the others "
          f"run, but trainer.async_mode = {cfg.trainer.async_mode!r} keeps an episode on one policy; set "
          "trainer.async_mode=continuous, or trainer.rollouts_in_flight=1")
    check(in_flight is None or in_flight <= max(1, k),
          f"trainer.rollouts_in_flight = {in_flight} is more rollouts than trainer.max_off_policy_steps = {k} lets "
          f"run ahead of training; set trainer.rollouts_in_flight={max(1, k)} (or null), or raise "
          "trainer.max_off_policy_steps")
    check(cfg.trainer.share_engine_calls or (rollouts_in_flight(cfg) > 1
                                             and cfg.actor_rollout_ref.rollout.mode == "async"),
          f"trainer.share_engine_calls = false keeps apart the engine calls of rollouts in flight, but this run has "
          f"{rollouts_in_flight(cfg)} rollout(s) in flight with actor_rollout_ref.rollout.mode = "
          f"{cfg.actor_rollout_ref.rollout.mode!r}, so no call is ever shared; drop the key, or set "
          "trainer.async_mode=continuous, trainer.max_off_policy_steps=2 and actor_rollout_ref.rollout.mode=async")
    _check_group_refill(cfg)
    _check_filter_groups(cfg)
    if k < 2 and not continuous:
        return
    alg = cfg.algorithm
    check(not core_algos.critic_enabled(cfg),
          f"trainer.max_off_policy_steps = {k} trains on batches up to {k} policies old, and algorithm.adv_estimator "
          f"= {alg.adv_estimator!r} fits a critic whose GAE targets have no correction for that; use a critic-free "
          "estimator (e.g. algorithm.adv_estimator=grpo), or trainer.max_off_policy_steps=1 with "
          "trainer.async_mode=buffered")
    fsdp = cfg.actor_rollout_ref.actor.fsdp
    for key in ("param_offload", "optimizer_offload"):
        check(not getattr(fsdp, key),
              f"actor_rollout_ref.actor.fsdp.{key} = True moves the actor off its GPU around each weight sync, "
              f"which trainer.max_off_policy_steps = {k} runs in the background while the actor trains; set "
              f"actor_rollout_ref.actor.fsdp.{key}=false, or trainer.max_off_policy_steps=1 with "
              "trainer.async_mode=buffered")


def _check_group_refill(cfg: AgentTrainerConfig) -> None:
    """trainer.refill=group (``agent_trainer.rollout.stream``): the continuous producer, the loop without a turn
    barrier and the built-in agents."""
    t = cfg.trainer
    if t.refill != "group":
        return
    check(t.async_mode == "continuous" and t.max_off_policy_steps >= 1,
          f"trainer.refill = 'group' refills the continuous producer's groups, but trainer.async_mode = "
          f"{t.async_mode!r} with trainer.max_off_policy_steps = {t.max_off_policy_steps}; set "
          "trainer.async_mode=continuous and trainer.max_off_policy_steps=2 (or 1), or trainer.refill=rollout")
    check(cfg.actor_rollout_ref.rollout.mode == "async",
          f"trainer.refill = 'group' plays each group on its own, but actor_rollout_ref.rollout.mode = "
          f"{cfg.actor_rollout_ref.rollout.mode!r} holds every episode at a turn barrier; set "
          "actor_rollout_ref.rollout.mode=async, or trainer.refill=rollout")
    check(not cfg.agent_proxy.gateway.agent,
          f"trainer.refill = 'group' plays the built-in agents' turns, but agent_proxy.gateway.agent = "
          f"{cfg.agent_proxy.gateway.agent!r} serves a whole rollout's sessions at once; set trainer.refill=rollout")
    check(Split.REMAX_BASELINE not in core_algos.trainer_splits(cfg),
          f"trainer.refill = 'group' hands the trainer groups from many resets, but algorithm.adv_estimator = "
          f"{cfg.algorithm.adv_estimator!r} replays one greedy rollout of a whole reset's seeds as its baseline; "
          "use a group estimator (e.g. algorithm.adv_estimator=grpo), or trainer.refill=rollout")


def _check_filter_groups(cfg: AgentTrainerConfig) -> None:
    """algorithm.filter_groups (DAPO's dynamic sampling) judges each group as it ends, on the stream of refilled
    groups, from what its env actor reports."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return
    check(cfg.trainer.refill == "group",
          f"algorithm.filter_groups.enable = True sets finished groups aside and plays more, which the stream of "
          f"refilled groups does, but trainer.refill = {cfg.trainer.refill!r}; set trainer.refill=group (with "
          "trainer.async_mode=continuous, trainer.max_off_policy_steps=2, actor_rollout_ref.rollout.mode=async), "
          "or algorithm.filter_groups.enable=false")
    check(cfg.es_manager.train.group_size >= 2,
          f"algorithm.filter_groups.enable = True keeps groups whose episodes score differently, but "
          f"es_manager.train.group_size = {cfg.es_manager.train.group_size} makes every group one episode; set "
          "es_manager.train.group_size >= 2 (e.g. 4) or algorithm.filter_groups.enable=false")
    scorers = [key for key, on in (("reward_model.enable", cfg.reward_model.enable),
                                   ("judge.enable", cfg.judge.enable)) if on]
    check(fg.metric != "reward" or not scorers,
          f"algorithm.filter_groups.metric = 'reward' judges a group by its env rewards as it ends, but "
          f"{scorers[0] if scorers else ''} = True adds scores only once the batch is taken; set "
          "algorithm.filter_groups.metric=success, or algorithm.filter_groups.enable=false")


def _check_datasets(cfg: AgentTrainerConfig) -> None:
    """data.* and reward.custom_reward_function.*: each has an effect, or the run is refused (docs/rewards.md)."""
    data, fn = cfg.data, cfg.reward.custom_reward_function
    train_tags, val_tags = cfg.es_manager.train.env_configs.tags, cfg.es_manager.val.env_configs.tags
    check(not data.train_files or TRAIN_TAG in train_tags,
          f"data.train_files = {list(data.train_files)} is never played: es_manager.train.env_configs.tags = "
          f"{list(train_tags)} does not name {TRAIN_TAG!r}; add it (e.g. es_manager.train.env_configs.tags="
          f"[{TRAIN_TAG}]) or drop data.train_files")
    check(TRAIN_TAG not in [*train_tags, *val_tags] or bool(data.train_files),
          f"es_manager.*.env_configs.tags name {TRAIN_TAG!r} but data.train_files is empty; list the data files "
          "(e.g. data.train_files=[data/arith/train.jsonl])")
    check(not data.val_files or VAL_TAG in val_tags,
          f"data.val_files = {list(data.val_files)} is never played: es_manager.val.env_configs.tags = "
          f"{list(val_tags)} does not name {VAL_TAG!r}; add it or drop data.val_files")
    check(VAL_TAG not in [*train_tags, *val_tags] or bool(data.val_files or data.train_files),
          f"es_manager.*.env_configs.tags name {VAL_TAG!r} but data.val_files and data.train_files are empty; "
          "set data.val_files")
    check(not fn.path or bool(data.train_files),
          f"reward.custom_reward_function.path = {fn.path!r} scores prompt-dataset answers, but data.train_files "
          "is empty (environment rewards come from the environments); set data.train_files or drop the path")
    check(bool(fn.name.strip()), f"reward.custom_reward_function.name = {fn.name!r} must name the function; "
                                  "e.g. reward.custom_reward_function.name=compute_score")
    check(bool(data.prompt_key.strip()), f"data.prompt_key = {data.prompt_key!r} must name the prompt field; "
                                          "e.g. data.prompt_key=prompt")
    check(data.max_turns <= cfg.agent_proxy.max_turn,
          f"data.max_turns = {data.max_turns} is more than agent_proxy.max_turn = {cfg.agent_proxy.max_turn}, "
          f"which ends every episode first; set agent_proxy.max_turn >= {data.max_turns}")
    check(data.max_turns == 1 or bool(data.final_marker.strip()),
          f"data.final_marker = {data.final_marker!r} must be non-empty with data.max_turns = {data.max_turns} "
          "(it tells a final answer from a reasoning step); e.g. data.final_marker='Final answer:'")


def _check_reward_model(cfg: AgentTrainerConfig) -> None:
    """reward_model.*: a model to load when enabled, and no reward-model key that would be ignored."""
    rm = cfg.reward_model
    check(not rm.enable or bool(rm.model.path.strip()),
          "reward_model.enable = True needs reward_model.model.path (an AutoModelForSequenceClassification with "
          "one label); e.g. reward_model.model.path=models/tiny-qwen2-rm (built by `make model`)")
    check(rm.enable or not rm.model.path, f"reward_model.model.path = {rm.model.path!r} is never loaded: "
                                           "reward_model.enable = False; set reward_model.enable=true or drop the path")
    check(rm.enable or not rm.dump_scores, "reward_model.dump_scores = True has nothing to dump: reward_model.enable "
                                            "= False; set reward_model.enable=true or drop dump_scores")
    estimator = core_algos.estimator(cfg.algorithm)
    check(not (rm.enable and core_algos.estimator_spec(estimator).greedy_baseline),
          f"reward_model.enable = True with algorithm.adv_estimator = {estimator!r}: the greedy baseline episodes "
          "are not scored by the reward model, so the baseline would miss its reward; pick "
          "algorithm.adv_estimator=grpo")


def _check_lora(cfg: AgentTrainerConfig) -> None:
    """LoRA (``actor_rollout_ref.model.lora_rank`` > 0) trains the actor's adapter; the critic has none, and a
    colocated reference is the actor's model with its adapter off, in the actor's dtype and memory."""
    arr = cfg.actor_rollout_ref
    if cfg.critic.model.lora_rank:
        raise ValueError(f"critic.model.lora_rank = {cfg.critic.model.lora_rank!r}: LoRA trains the actor only here; "
                         "set critic.model.lora_rank=0 (the critic trains its full model)")
    defaults = ModelConfig()
    for section, model in (("actor_rollout_ref.model", arr.model), ("critic.model", cfg.critic.model)):
        if not model.lora_rank and model.lora_adapter_path:
            raise ValueError(f"{section}.lora_adapter_path = {model.lora_adapter_path!r} with {section}.lora_rank = "
                             "0 (LoRA off): the adapter would not be loaded; set actor_rollout_ref.model.lora_rank "
                             "(and lora_alpha, target_modules) to the adapter's adapter_config.json r, lora_alpha and "
                             f"target_modules, or drop {section}.lora_adapter_path")
        for key in ("lora_alpha", "target_modules", "lora_dropout"):
            value = getattr(model, key)
            if not model.lora_rank and value != getattr(defaults, key):
                raise ValueError(f"{section}.{key} = {value!r} does nothing with {section}.lora_rank = 0 (LoRA "
                                 f"off); set actor_rollout_ref.model.lora_rank (e.g. 8) to train a LoRA adapter, or "
                                 f"drop {section}.{key}")
    if not arr.model.lora_rank or not (cfg.ref_enabled and arr.ref.colocate):
        return
    if arr.ref.dtype is not None and arr.ref.dtype != arr.model.dtype:
        raise ValueError(f"actor_rollout_ref.ref.dtype = {arr.ref.dtype!r} with actor_rollout_ref.model.lora_rank = "
                         f"{arr.model.lora_rank}: the colocated reference is the actor's model with its adapter off, "
                         f"in actor_rollout_ref.model.dtype = {arr.model.dtype!r}; set actor_rollout_ref.ref.dtype=null "
                         "(or actor_rollout_ref.ref.colocate=false for a reference model of its own)")
    if arr.ref.fsdp.param_offload:
        raise ValueError(f"actor_rollout_ref.ref.fsdp.param_offload = True with actor_rollout_ref.model.lora_rank = "
                         f"{arr.model.lora_rank}: the colocated reference is the actor's model with its adapter off and "
                         "has no weights of its own to offload; set actor_rollout_ref.ref.fsdp.param_offload=false")


def _linear_modules(model_config) -> tuple[str, list[str]]:
    """(class name, the distinct last name parts of its ``nn.Linear`` modules but the output head) of the model
    built on the meta device from ``model_config``; needs torch and transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model_config)
    head = lm.get_output_embeddings()
    return type(lm).__name__, sorted({name.rsplit(".", 1)[-1] for name, module in lm.named_modules()
                                      if isinstance(module, torch.nn.Linear) and module is not head})


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What a peft adapter folder holds (``actor_rollout_ref.model.lora_adapter_path``)."""


def check_lora_adapter(cfg: AgentTrainerConfig, model_config) -> None:
    """``actor_rollout_ref.model.lora_adapter_path`` is a peft adapter folder whose ``adapter_config.json`` has this
    run's r, lora_alpha and target_modules (``all-linear`` on either side compared as the model's linear modules):
    the run's keys are never taken from the folder silently, each difference is refused naming both values."""
    model = cfg.actor_rollout_ref.model
    folder = model.lora_adapter_path
    if not model.lora_rank or not folder:
        return
    key = "actor_rollout_ref.model.lora_adapter_path"
    lacking = [name for name in ADAPTER_FILES if not (Path(folder) / name).is_file()]
    if lacking:
        raise ValueError(f"{key} = {folder!r} lacks {lacking}: point it at a peft adapter folder (an SFT run's "
                         "final/, a checkpoint's actor/ with trainer.save_hf_model, a PeftModel.save_pretrained)")
    try:
        saved = json.loads((Path(folder) / ADAPTER_FILES[0]).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{key} = {folder!r}: its {ADAPTER_FILES[0]} is not readable JSON ({err}); "
                         "re-save the adapter with peft") from None
    if saved.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{key} = {folder!r} holds a {saved.get('peft_type')} adapter; only LoRA adapters load here")

    def modules(value) -> list[str]:
        if isinstance(value, str):
            return _linear_modules(model_config)[1] if value == "all-linear" else [value]
        return sorted({name.rsplit(".", 1)[-1] for name in value or []})  # peft may save full module names

    run_targets = list(model.target_modules)
    differ = []
    if saved.get("r") != model.lora_rank:
        differ.append(f"r = {saved.get('r')} but actor_rollout_ref.model.lora_rank = {model.lora_rank}")
    if saved.get("lora_alpha") is None or float(saved["lora_alpha"]) != float(model.lora_alpha):
        differ.append(f"lora_alpha = {saved.get('lora_alpha')} but actor_rollout_ref.model.lora_alpha = "
                      f"{model.lora_alpha}")
    saved_targets = saved.get("target_modules")
    if saved_targets != run_targets and modules(saved_targets) != modules(
            run_targets[0] if run_targets == ["all-linear"] else run_targets):
        shown = saved_targets if isinstance(saved_targets, str) else modules(saved_targets)
        differ.append(f"target_modules = {shown} but actor_rollout_ref.model.target_modules = {run_targets}")
    if saved.get("use_dora") or saved.get("bias", "none") != "none" or saved.get("modules_to_save"):
        differ.append("it uses DoRA, trained biases or modules_to_save, which this actor's adapter has not")
    if differ:
        raise ValueError(f"{key} = {folder!r}: its {ADAPTER_FILES[0]} has {'; '.join(differ)}; set the run's keys "
                         "to the adapter's (they shape the adapter the weights load into)")


def check_lora_targets(cfg: AgentTrainerConfig, model_config) -> None:
    """``actor_rollout_ref.model.target_modules`` must name linear modules of the model (built on the meta device
    from ``model_config``, its ``PretrainedConfig``), or be [all-linear]; needs torch and transformers. Then
    :func:`check_lora_adapter`."""
    model = cfg.actor_rollout_ref.model
    targets = list(model.target_modules)
    if not model.lora_rank:
        return
    check_lora_adapter(cfg, model_config)
    if targets == ["all-linear"]:
        return
    lm_name, known = _linear_modules(model_config)
    unknown = [t for t in targets if t not in known]
    if unknown or not targets:
        raise ValueError(f"actor_rollout_ref.model.target_modules = {targets}: {unknown or 'nothing'} matches no "
                         f"linear module of {lm_name} (its linear modules: {known}); name some of those, "
                         "or [all-linear]")
