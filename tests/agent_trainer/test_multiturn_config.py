"""Seed 004's keys: the shipped configs load, aliases resolve to one value, conflicts and no-ops are refused."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer import core_algos
from agent_trainer.checks.load import load_config
from agent_trainer.config import condenser_config, keep_last_n
from agent_trainer.checks.prepare import CONFIG_DIR, prepare

SEED_CONFIGS = ("multiturn_grpo_trainer", "multiturn_grpo_math", "multiturn_grpo_coding")
CONDENSED = {"algorithm": {"adv_estimator": "grpo_multiturn"}, "ctx_manager": {"mode": "condensed"}}


def _compose(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(name, overrides=list(overrides))


@pytest.mark.parametrize("name", SEED_CONFIGS)
def test_seed_configs_load_and_the_projects_keys_follow_the_seed_keys(name, tiny_model_path):
    cfg, tags = prepare(_compose(name, f"model_path={tiny_model_path}"))
    mt = cfg.algorithm.multiturn_grpo
    assert cfg.es_manager.train.group_size == mt.n_trajectories_per_question
    assert cfg.agent_proxy.max_turn == cfg.data.max_turns == mt.max_turns_per_trajectory
    assert cfg.actor_rollout_ref.rollout.max_model_len == mt.max_context_length
    gen = cfg.multiturn_trajectory.generation
    assert cfg.actor_rollout_ref.rollout.response_length == gen.max_new_tokens
    assert cfg.actor_rollout_ref.rollout.temperature == gen.temperature
    assert cfg.reward_computation.enable and cfg.trajectory_profiling.enable and "PromptData" in tags
    assert core_algos.estimator_options(cfg.algorithm) == {"epsilon": cfg.algorithm.advantage_epsilon}


def test_overriding_a_seed_key_moves_its_alias_and_overriding_only_the_alias_is_refused(tiny_model_path):
    cfg, _ = prepare(_compose("multiturn_grpo_math", f"model_path={tiny_model_path}",
                              "algorithm.multiturn_grpo.n_trajectories_per_question=3"))
    assert cfg.es_manager.train.group_size == 3
    with pytest.raises(ValueError, match=r"algorithm.multiturn_grpo.n_trajectories_per_question = 6 is an alias of "
                                         r"es_manager.train.group_size, which is 2"):
        prepare(_compose("multiturn_grpo_math", f"model_path={tiny_model_path}", "es_manager.train.group_size=2"))
    with pytest.raises(ValueError, match=r"generation.temperature = 0.8 is an alias of "
                                         r"actor_rollout_ref.rollout.temperature, which is 1.0"):
        prepare(_compose("multiturn_grpo_math", f"model_path={tiny_model_path}",
                         "actor_rollout_ref.rollout.temperature=1.0"))


def test_keep_last_n_is_one_value_under_two_names():
    assert keep_last_n(load_config({})) == 2
    assert keep_last_n(load_config({"ctx_manager": {"keep_last_n_turns": 3}})) == 3
    steps = {"multiturn_trajectory": {"context_condenser": {"keep_last_n_steps": 1}}}
    assert keep_last_n(load_config({**steps, **CONDENSED})) == 1
    both = {**CONDENSED, "ctx_manager": {"mode": "condensed", "keep_last_n_turns": 4}, **steps}
    with pytest.raises(ValueError, match="keep_last_n_steps = 1 and its alias ctx_manager.keep_last_n_turns = 4"):
        load_config(both)


def test_the_condenser_budget_defaults_to_the_room_a_prompt_has_and_must_leave_room_for_the_reply():
    rollout = {"actor_rollout_ref": {"rollout": {"max_model_len": 512, "response_length": 64}}}
    assert condenser_config(load_config({**rollout, **CONDENSED})).max_condensed_tokens == 448
    too_big = {**rollout, **CONDENSED, "multiturn_trajectory": {"context_condenser": {"max_condensed_tokens": 500}}}
    with pytest.raises(ValueError, match="max_condensed_tokens = 500 leaves no room for a reply.*set it <= 448"):
        load_config(too_big)


@pytest.mark.parametrize("raw, message", [
    ({"multiturn_trajectory": {"context_condenser": {"type": "summary"}}},
     "context_condenser.type is set but ctx_manager.mode = 'full' never condenses"),
    ({"multiturn_trajectory": {"context_condenser": {"type": "nope"}}}, "context_condenser.type = 'nope' is unknown"),
    ({"reward_computation": {"enable": True}}, "reward_computation.enable = True scores trajectories of per-turn rows"),
    ({**CONDENSED, "reward_computation": {"enable": True}}, "has no 'PromptData'"),
    ({"reward_computation": {"domain": "poetry"}}, "reward_computation.domain = 'poetry' is not one of"),
    ({"reward_computation": {"env_reward_weight": -1}}, "env_reward_weight = -1.0 must be a finite number >= 0"),
    ({"algorithm": {"advantage_epsilon": 0.0}}, "algorithm.advantage_epsilon = 0.0 must lie in"),
    ({"multiturn_trajectory": {"generation": {"batch_size": 5}}}, "batch_size = 5 must equal the trajectories per"),
    ({"algorithm": {"multiturn_grpo": {"max_context_length": 99}}}, "max_context_length = 99 is an alias of"),
])
def test_bad_multiturn_keys_are_refused_in_one_line(raw, message):
    with pytest.raises(ValueError, match=message) as err:
        load_config(raw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("raw, message", [
    ({"multiturn_trajectory": {"context_condenser": {"summary_max_tokens": 64}}},
     "context_condenser.summary_max_tokens is set but ctx_manager.mode = 'full' never condenses"),
    ({"reward_computation": {"domain": "math"}}, "reward_computation.domain is set but reward_computation.enable"),
    ({"reward_computation": {"sandbox": {"wall_s": 2.0}}}, "reward_computation.sandbox.wall_s is set but"),
    ({"algorithm": {"advantage_epsilon": 1e-4}}, "advantage_epsilon = 0.0001 is never read by .* 'gae'"),
    ({"algorithm": {"advantage_epsilon": 1e-4, "adv_estimator": "gigpo"}, "es_manager": {"train": {"group_size": 4}},
      "agent_proxy": {"max_turn": 2}}, "set algorithm.gigpo.epsilon instead"),
])
def test_keys_that_would_have_no_effect_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        load_config(raw)
    if "advantage_epsilon" in str(raw) and "gigpo" not in str(raw):  # read by the grpo family
        loaded = load_config({**raw, "algorithm": {"advantage_epsilon": 1e-4, "adv_estimator": "grpo"}})
        assert core_algos.estimator_options(loaded.algorithm) == {"epsilon": 1e-4}
