"""align-anything / RAGEN keys (agent_trainer/config/compat.py): rewritten with a notice, or refused in one line."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_trainer import core_algos
from agent_trainer.checks.load import load_config
from agent_trainer.config import compat, config_schema
from agent_trainer.config.errors import all_keys
from agent_trainer.checks.prepare import compose_and_prepare

SEED_EXAMPLE = ["train_cfgs.multi_turn=true", "train_cfgs.bi_level_gae=true", "train_cfgs.high_level_gamma=0.95",
                "model_cfgs.use_reward_critic=true"]


def test_the_issue_example_resolves_with_one_notice_per_key(tiny_model_path, caplog):
    with caplog.at_level(logging.WARNING, logger="agent_trainer.checks.prepare"):
        cfg, _ = compose_and_prepare([*SEED_EXAMPLE, f"model_path={tiny_model_path}"])
    assert cfg.algorithm.adv_estimator == "bi_level_gae" and cfg.algorithm.high_level_gamma == 0.95
    assert core_algos.estimator(cfg.algorithm) == "bi_level_gae" and cfg.algorithm.bi_level_gae is False
    assert cfg.critic.enable is True and core_algos.critic_enabled(cfg)
    assert cfg.agent_proxy.max_turn == 6  # multi_turn=true leaves the config's turns alone
    notices = [r.getMessage() for r in caplog.records]
    assert notices == [
        "train_cfgs.multi_turn is align-anything's name; train_cfgs.multi_turn=true needs nothing set here "
        f"({compat.BY_KEY['train_cfgs.multi_turn'].meaning})",
        "train_cfgs.bi_level_gae is align-anything's name; using algorithm.bi_level_gae=true",
        "train_cfgs.high_level_gamma is align-anything's name; using algorithm.high_level_gamma=0.95",
        "model_cfgs.use_reward_critic is align-anything's name; using critic.enable=true",
        "algorithm.bi_level_gae=true is RAGEN's spelling; using algorithm.adv_estimator=bi_level_gae",
    ]


def test_plus_form_and_translated_values(tiny_model_path):
    cfg, _ = compose_and_prepare(["+train_cfgs.multi_turn=false", "+train_cfgs.gae_lambda=0.9",
                                  "train_cfgs.kl_coeff=0.02", "++train_cfgs.update_iters=2",
                                  f"model_cfgs.actor_model_name_or_path={tiny_model_path}"])
    assert cfg.agent_proxy.max_turn == 1 and cfg.algorithm.lam == 0.9
    assert cfg.algorithm.use_kl_in_reward is True and cfg.algorithm.kl_ctrl.kl_coef == 0.02
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 2
    assert cfg.actor_rollout_ref.model.path == tiny_model_path == cfg.model_path


@pytest.mark.parametrize("override, names", [
    ("train_cfgs.epochs=3", "set trainer.total_training_steps"),
    ("+env_cfgs.env_name=frozen_lake", "es_manager.train.env_configs.tags"),
    ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp.world_size"),
    ("enable_response_mask=false", "cannot be turned off"),
    ("train_cfgs.per_device_train_batch_size=4", "docs/compatibility.md"),
])
def test_a_refused_key_is_one_line_naming_what_to_set(override, names, tiny_model_path):
    with pytest.raises(SystemExit) as exit_info:
        compose_and_prepare([override, f"model_path={tiny_model_path}"])
    line = exit_info.value.code
    assert line.startswith("agent-trainer: " + override.lstrip("+").partition("=")[0]) and "\n" not in line, line
    assert names in line, line


def test_a_config_file_with_seed_sections_is_rewritten_with_the_same_notices(caplog):
    with caplog.at_level(logging.WARNING, logger="agent_trainer.config"):
        cfg = load_config({"train_cfgs": {"bi_level_gae": True, "gae_lambda": 0.9},
                           "model_cfgs": {"use_reward_critic": True}})
    assert cfg.algorithm.adv_estimator == "bi_level_gae" and cfg.algorithm.lam == 0.9 and cfg.critic.enable is True
    assert cfg.train_cfgs == {} and cfg.model_cfgs == {}  # consumed, never silently kept
    assert [r.getMessage() for r in caplog.records] == [
        "train_cfgs.bi_level_gae is align-anything's name; using algorithm.bi_level_gae=true",
        "train_cfgs.gae_lambda is align-anything's name; using algorithm.lam=0.9",
        "model_cfgs.use_reward_critic is align-anything's name; using critic.enable=true",
        "algorithm.bi_level_gae=true is RAGEN's spelling; using algorithm.adv_estimator=bi_level_gae"]


@pytest.mark.parametrize("section, words", [
    ({"train_cfgs": {"epochs": 2}}, "train_cfgs.epochs is align-anything's key and is refused here: counts passes"),
    ({"train_cfgs": {"foo_typo": 1}}, "train_cfgs.foo_typo is an align-anything key with no meaning here"),
    ({"env_cfgs": {"env_name": "x"}}, "es_manager.train.env_configs.tags"),
    ({"model_cfgs": 3}, "model_cfgs = 3 must be a section of keys"),
    ({"enable_response_mask": True}, "enable_response_mask is RAGEN's name; in a config file write nothing"),
])
def test_a_refused_key_in_a_config_file_is_one_line(section, words):
    with pytest.raises(ValueError) as err:
        load_config(section)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_shipped_seed_style_config_composes_and_the_command_line_wins(tiny_model_path, caplog):
    with caplog.at_level(logging.WARNING):
        cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "algorithm.high_level_gamma=0.9"],
                                     config_name="seed_style_frozenlake")
    assert core_algos.estimator(cfg.algorithm) == "bi_level_gae" and core_algos.critic_enabled(cfg) and not cfg.reward_model.enable
    assert cfg.agent_proxy.max_turn == 4 and cfg.algorithm.high_level_gamma == 0.9
    notices = [r.getMessage() for r in caplog.records if "align-anything's name" in r.getMessage()]
    assert len(notices) == 8 and "using algorithm.bi_level_gae=true" in notices[1]
    assert notices[2] == ("train_cfgs.high_level_gamma is align-anything's name; using algorithm.high_level_gamma="
                          "0.95 (the command line's algorithm.high_level_gamma wins)")
    with pytest.raises(SystemExit) as exit_info:
        compose_and_prepare([f"model_path={tiny_model_path}", "+train_cfgs.foo_typo=1"],
                            config_name="seed_style_frozenlake")
    assert exit_info.value.code == ("agent-trainer: train_cfgs.foo_typo is an align-anything key with no meaning "
                                    "here; docs/compatibility.md lists the ones that map onto this project's keys")


def test_every_mapping_lands_on_a_schema_key():
    known = set(all_keys(config_schema()))
    for entry in compat.TABLE:
        assert (entry.old in known) == (entry.alias_of is not None), f"{entry.old} is already this project's key"
        assert (entry.rewrite is None) != (entry.refusal is None), entry.old
        for value in (True, False, 0.5):
            try:
                new = entry.rewrite(value) if entry.rewrite else {}
            except ValueError:
                continue
            assert set(new) <= known, (entry.old, new)


SEED_KEY_VALUES = {
    "train_cfgs.multi_turn": (False, "agent_proxy.max_turn", 1),
    "train_cfgs.bi_level_gae": (True, "algorithm.adv_estimator", "bi_level_gae"),
    "train_cfgs.high_level_gamma": (0.9, "algorithm.high_level_gamma", 0.9),
    "train_cfgs.max_turn": (3, "agent_proxy.max_turn", 3),
    "train_cfgs.gamma": (0.9, "algorithm.gamma", 0.9),
    "train_cfgs.gae_lambda": (0.9, "algorithm.lam", 0.9),
    "train_cfgs.kl_coeff": (0.02, "algorithm.kl_ctrl.kl_coef", 0.02),
    "train_cfgs.update_iters": (2, "actor_rollout_ref.actor.ppo_epochs", 2),
    "train_cfgs.clip_range_ratio": (0.3, "actor_rollout_ref.actor.clip_ratio", 0.3),
    "train_cfgs.clip_range_value": (0.3, "critic.cliprange_value", 0.3),
    "train_cfgs.actor_lr": (2e-5, "actor_rollout_ref.actor.optim.lr", 2e-5),
    "train_cfgs.critic_lr": (2e-5, "critic.optim.lr", 2e-5),
    "train_cfgs.actor_weight_decay": (0.1, "actor_rollout_ref.actor.optim.weight_decay", 0.1),
    "train_cfgs.critic_weight_decay": (0.1, "critic.optim.weight_decay", 0.1),
    "train_cfgs.adam_betas": ([0.8, 0.9], "actor_rollout_ref.actor.optim.betas", [0.8, 0.9]),
    "train_cfgs.actor_gradient_checkpointing": (True, "actor_rollout_ref.model.enable_gradient_checkpointing", True),
    "train_cfgs.critic_gradient_checkpointing": (True, "critic.model.enable_gradient_checkpointing", True),
    "train_cfgs.seed": (7, "trainer.seed", 7),
    "train_cfgs.eval_interval": (3, "trainer.test_freq", 3),
    "train_cfgs.use_reward_critic": (True, "critic.enable", True),
    "algorithm.multiturn_grpo.n_trajectories_per_question": (2, "es_manager.train.group_size", 2),
    "algorithm.multiturn_grpo.max_turns_per_trajectory": (3, "agent_proxy.max_turn", 3),
    "algorithm.multiturn_grpo.max_context_length": (1024, "actor_rollout_ref.rollout.max_model_len", 1024),
    "multiturn_trajectory.generation.max_sequence_length": (1024, "actor_rollout_ref.rollout.max_model_len", 1024),
    "multiturn_trajectory.generation.max_new_tokens": (32, "actor_rollout_ref.rollout.response_length", 32),
    "multiturn_trajectory.generation.temperature": (0.7, "actor_rollout_ref.rollout.temperature", 0.7),
    "multiturn_trajectory.generation.top_p": (0.9, "actor_rollout_ref.rollout.top_p", 0.9),
    "multiturn_trajectory.generation.top_k": (5, "actor_rollout_ref.rollout.top_k", 5),
}
"""Seed key -> (a value, the canonical key it sets, what that key reads back). Every train_cfgs and seed 004
alias row of the table is here: the reward-model rows need a reward model to load."""
NEEDS_MORE = {"train_cfgs.use_reward_model", "model_cfgs.actor_model_name_or_path", "model_cfgs.reward_model_name_or_path",
              "model_cfgs.reward_critic_model_name_or_path", "model_cfgs.model_max_length", "model_cfgs.use_reward_model",
              "model_cfgs.use_reward_critic", "agent_proxy.use_environment", "enable_response_mask"}
"""Rows tested elsewhere in this file (a path, a reward model, or a value that can only be true)."""


def _get(cfg, key):
    return functools.reduce(getattr, key.split("."), cfg)


def test_every_seed_key_that_maps_is_in_the_one_key_test():
    mapped = {entry.old for entry in compat.TABLE if entry.rewrite is not None}
    assert mapped - NEEDS_MORE == set(SEED_KEY_VALUES)


@pytest.mark.parametrize("key", sorted(SEED_KEY_VALUES))
def test_a_seed_key_set_alone_on_the_command_line_sets_its_canonical_key(key, tiny_model_path):
    value, canonical, expected = SEED_KEY_VALUES[key]
    path = f"model_path={tiny_model_path}"
    before = _get(compose_and_prepare([path])[0], canonical)
    cfg, _ = compose_and_prepare([f"{key}={compat.hydra_literal(value)}", path])
    assert _get(cfg, canonical) == expected != before
    entry = compat.BY_KEY[key]
    if entry.alias_of is not None:  # one value under two names
        assert _get(cfg, key) == expected


def test_a_seed_alias_and_its_project_key_both_on_the_command_line_must_agree(tiny_model_path):
    path = f"model_path={tiny_model_path}"
    cfg, _ = compose_and_prepare(["agent_proxy.max_turn=3", "algorithm.multiturn_grpo.max_turns_per_trajectory=3", path])
    assert cfg.agent_proxy.max_turn == 3 == cfg.algorithm.multiturn_grpo.max_turns_per_trajectory
    with pytest.raises(SystemExit, match="max_turns_per_trajectory = 3 is an alias of agent_proxy.max_turn, which is 2"):
        compose_and_prepare(["algorithm.multiturn_grpo.max_turns_per_trajectory=3", "agent_proxy.max_turn=2", path])


def test_bi_level_gae_has_one_spelling_and_the_alias_conflicting_with_another_estimator_is_refused(tiny_model_path):
    path = f"model_path={tiny_model_path}"
    for overrides in (["algorithm.bi_level_gae=true"], ["algorithm.adv_estimator=bi_level_gae"],
                      ["algorithm.adv_estimator=bi_level_gae", "algorithm.bi_level_gae=true"]):
        algorithm = compose_and_prepare([*overrides, path])[0].algorithm
        assert (algorithm.adv_estimator, algorithm.bi_level_gae) == ("bi_level_gae", False), overrides
    with pytest.raises(SystemExit) as exit_info:
        compose_and_prepare(["algorithm.bi_level_gae=true", "algorithm.adv_estimator=grpo", path])
    assert exit_info.value.code == (
        "agent-trainer: algorithm.bi_level_gae = true (RAGEN's spelling of algorithm.adv_estimator=bi_level_gae) "
        "conflicts with algorithm.adv_estimator = grpo; set algorithm.adv_estimator=bi_level_gae, or drop "
        "algorithm.bi_level_gae")


def test_console_scripts_run_the_module_entry(tmp_path):
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HYDRA_FULL_ERROR")}
    help_out = subprocess.run([bin_dir / "agent-trainer", "--help"], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)
    assert help_out.returncode == 0 and "frozenlake" in help_out.stdout, help_out.stderr
    refused = subprocess.run([bin_dir / "train-multi-turn", "--config-name", "frozenlake_grpo",
                              f"hydra.run.dir={tmp_path}/hydra", "train_cfgs.high_level_gamma=abc"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1, refused.stderr
    assert lines[0].startswith("agent-trainer: algorithm.high_level_gamma = 'abc'"), lines[0]


def test_compatibility_doc_is_current():
    stale = "docs/compatibility.md is stale: run python -m launch.config_docs"
    assert compat.DOC.read_text() == compat.render(), stale
    for entry in compat.TABLE:
        assert f"| `{entry.old}` |" in compat.DOC.read_text()
