"""Start-up checks of seed 004's multi-turn GRPO keys: aliases agree with their keys; condenser, reward
computation and profiling keys can take effect (the sections: agent_trainer.config.multiturn)."""

from __future__ import annotations

from functools import reduce
from typing import Any

from agent_trainer import core_algos
from agent_trainer.checks.rules import changed_keys
from agent_trainer.config.compat import SEED_ALIASES
from agent_trainer.config.multiturn import DEFAULT_EPSILON, MultiturnTrajectoryConfig
from agent_trainer.config.rewards import TRAIN_TAG
from agent_trainer.config.schema import AgentTrainerConfig, condenser_config
from agent_trainer.trajectory_rewards import load_ground_truth

ALIASES = SEED_ALIASES
"""(seed key, this project's key): the seed key, when set, must hold the project key's value (one table, in
``agent_trainer.config.compat``, which also rewrites a seed key set alone on the command line)."""
_CONDENSER = "multiturn_trajectory.context_condenser"


def _get(cfg: Any, key: str) -> Any:
    return reduce(getattr, key.split("."), cfg)


def validate_multiturn(cfg: AgentTrainerConfig) -> None:
    """Aliases agree with their keys; condenser, reward computation and profiling keys can take effect.

    Raises ValueError with one line naming the key, the value and the fix.
    """
    _check_aliases(cfg)
    _check_condenser(cfg)
    _check_reward_computation(cfg)
    eps, estimator = cfg.algorithm.advantage_epsilon, core_algos.estimator(cfg.algorithm)
    _check(isinstance(eps, (int, float)) and 0 < eps < 1,
           f"algorithm.advantage_epsilon = {eps!r} must lie in (0, 1) (it keeps (S - mean) / (std + eps) finite "
           "for a group whose rewards are all equal); e.g. algorithm.advantage_epsilon=1e-6")
    _check_epsilon(eps, estimator)


EPSILON_KEY = "algorithm.advantage_epsilon"


def _check_epsilon(eps: float, estimator: str) -> None:
    """algorithm.advantage_epsilon is read by the estimators whose spec names it as their ``epsilon`` option."""
    specs = [core_algos.estimator_spec(name) for name in core_algos.estimator_names()]
    readers = [s.name for s in specs if s.options.get("epsilon") == EPSILON_KEY]
    others = [f"{s.name} has {s.options['epsilon']}" for s in specs
              if s.options.get("epsilon", EPSILON_KEY) != EPSILON_KEY]
    only = " and ".join(filter(None, (", ".join(readers[:-1]), readers[-1] if readers else "")))
    own = core_algos.estimator_spec(estimator).options.get("epsilon")
    _check(eps == DEFAULT_EPSILON or own is not None,
           f"{EPSILON_KEY} = {eps!r} is never read by algorithm.adv_estimator = {estimator!r} (only "
           f"{only or 'no estimator'}{'; ' if others else ''}{', '.join(others)}); drop it")
    _check(eps == DEFAULT_EPSILON or own in (None, EPSILON_KEY),
           f"{EPSILON_KEY} = {eps!r} is not {estimator}'s: set {own} instead")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_aliases(cfg: AgentTrainerConfig) -> None:
    for alias, key in ALIASES:
        value, target = _get(cfg, alias), _get(cfg, key)
        _check(value is None or value == target,
               f"{alias} = {value!r} is an alias of {key}, which is {target!r}: set one of them (or both to the "
               f"same value); the seed configs set {key}: ${{{alias}}}")
    steps = cfg.multiturn_trajectory.context_condenser.keep_last_n_steps
    turns = cfg.ctx_manager.keep_last_n_turns
    _check(steps is None or turns is None or steps == turns,
           f"{_CONDENSER}.keep_last_n_steps = {steps} and its alias ctx_manager.keep_last_n_turns = {turns} "
           "disagree; set one of them")
    batch = cfg.multiturn_trajectory.generation.batch_size
    train = cfg.es_manager.train
    _check(batch is None or batch == train.env_groups * train.group_size,
           f"multiturn_trajectory.generation.batch_size = {batch} must equal the trajectories per step, "
           f"es_manager.train.env_groups x group_size = {train.env_groups} x {train.group_size} = "
           f"{train.env_groups * train.group_size}; set it to that (or null)")


def _check_condenser(cfg: AgentTrainerConfig) -> None:
    cc, rollout = cfg.multiturn_trajectory.context_condenser, cfg.actor_rollout_ref.rollout
    changed = changed_keys(cc, MultiturnTrajectoryConfig().context_condenser, _CONDENSER)
    _check(cfg.ctx_manager.mode == "condensed" or not changed,
           f"{changed[0] if changed else _CONDENSER} is set but ctx_manager.mode = {cfg.ctx_manager.mode!r} never "
           "condenses; set ctx_manager.mode=condensed (and algorithm.adv_estimator=grpo_multiturn) or drop it")
    room = rollout.max_model_len - rollout.response_length
    _check(cc.max_condensed_tokens is None or cc.max_condensed_tokens <= room,
           f"{_CONDENSER}.max_condensed_tokens = {cc.max_condensed_tokens} leaves no room for a reply: a context plus "
           f"actor_rollout_ref.rollout.response_length = {rollout.response_length} must fit max_model_len = "
           f"{rollout.max_model_len}; set it <= {room} (or null = {room})")
    _check(cc.type != "summary" or cc.summary_max_tokens < condenser_config(cfg).max_condensed_tokens,
           f"{_CONDENSER}.summary_max_tokens = {cc.summary_max_tokens} must be < the context budget "
           f"{condenser_config(cfg).max_condensed_tokens}; lower it")


def _check_reward_computation(cfg: AgentTrainerConfig) -> None:
    rc = cfg.reward_computation
    if not rc.enable:
        changed = changed_keys(rc, type(rc)(), "reward_computation")
        _check(not changed, f"{changed[0] if changed else ''} is set but reward_computation.enable = False, so no "
                            "trajectory is scored; set reward_computation.enable=true or drop it")
        return
    _check(cfg.ctx_manager.mode == "condensed",
           f"reward_computation.enable = True scores trajectories of per-turn rows, but ctx_manager.mode = "
           f"{cfg.ctx_manager.mode!r}; set ctx_manager.mode=condensed and algorithm.adv_estimator=grpo_multiturn")
    _check(TRAIN_TAG in cfg.es_manager.train.env_configs.tags,
           f"reward_computation.enable = True checks answers against a dataset's ground truth, but "
           f"es_manager.train.env_configs.tags = {list(cfg.es_manager.train.env_configs.tags)} has no {TRAIN_TAG!r} "
           "(the question environment over data.train_files); set data.train_files and that tag")
    _check(rc.env_reward_weight != 0 or rc.trajectory_reward_weight != 0,
           "reward_computation.env_reward_weight and trajectory_reward_weight are both 0: every reward would be 0; "
           "set trajectory_reward_weight=1.0")
    if rc.ground_truth_file:
        load_ground_truth(rc.ground_truth_file)  # a missing or malformed file fails here, naming the key
