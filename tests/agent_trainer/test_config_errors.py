"""Malformed configs are refused before Ray starts, each with one line naming the key and the value.

The table runs in-process through ``compose_and_prepare``: hydra's compose API and then
``prepare``, the function the hydra entry point calls, with the same one-line refusal.
A few cases run the real command line to prove the exit code, the single stderr line and
that no Ray process was spawned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from agent_trainer.checks.prepare import compose_and_prepare
REPO = Path(__file__).resolve().parents[2]
GROUP = ["es_manager.train.group_size=1", "ppo_mini_batch_size=8"]  # 8 groups x 1 episode = 8 rows

JUDGE = ["judge.enable=true", "judge.base_url=http://127.0.0.1:9/v1", "judge.model=m"]
# id, overrides ({tmp} = a temp dir), key the line must name, value it must name, config name
CASES = [
    # unknown keys, with and without "+"
    ("typo", ["trainer.totl_steps=3"], "trainer.totl_steps", "=3", "frozenlake"),
    ("typo_plus", ["+trainer.totl_steps=3"], "trainer.totl_steps", "=3", "frozenlake"),
    ("plus_unknown_flag", ["+algorithm.use_reward_model=true"], "algorithm.use_reward_model", "=true", "frozenlake"),
    ("plus_old_schema_key", ["+trainer.resume_mod=auto"], "trainer.resume_mod", "=auto", "frozenlake"),
    ("plus_top_level", ["+foo=1"], "foo", "=1", "frozenlake"),
    ("plus_wrong_section", ["+trainer.use_kl_loss=true"], "trainer.use_kl_loss", "=true", "frozenlake"),
    ("plus_nested_typo", ["+es_manager.train.group_sz=2"], "es_manager.train.group_sz", "=2", "frozenlake"),
    # wrong types
    ("type_int", ["trainer.total_training_steps=abc"], "trainer.total_training_steps", "'abc'", "frozenlake"),
    ("type_save_freq", ["trainer.save_freq=1.5"], "trainer.save_freq", "1.5", "frozenlake"),
    ("type_test_freq", ["trainer.test_freq=often"], "trainer.test_freq", "'often'", "frozenlake"),
    ("type_bool", ["critic.enable=maybe"], "critic.enable", "'maybe'", "frozenlake"),
    ("type_list", ["trainer.logger=console"], "trainer.logger", "'console'", "frozenlake"),
    ("type_betas", ["actor_rollout_ref.actor.optim.betas=0.9"], "actor_rollout_ref.actor.optim.betas", "0.9",
     "frozenlake"),
    ("type_null", ["trainer.total_training_steps=null"], "trainer.total_training_steps", "'null'", "frozenlake"),
    ("bad_interpolation", ["trainer.default_local_dir=${nope}"], "trainer.default_local_dir", "${nope}",
     "frozenlake"),
    # zero / negative sizes
    ("steps_zero", ["trainer.total_training_steps=0"], "trainer.total_training_steps", "= 0", "frozenlake"),
    ("ppo_epochs_zero", ["actor_rollout_ref.actor.ppo_epochs=0"], "actor_rollout_ref.actor.ppo_epochs", "= 0",
     "frozenlake"),
    ("critic_epochs_neg", ["critic.ppo_epochs=-1"], "critic.ppo_epochs", "= -1", "frozenlake"),
    ("response_length_zero", ["actor_rollout_ref.rollout.response_length=0"],
     "actor_rollout_ref.rollout.response_length", "= 0", "frozenlake"),
    ("num_workers_zero", ["actor_rollout_ref.rollout.num_workers=0"], "actor_rollout_ref.rollout.num_workers",
     "= 0", "frozenlake"),
    ("kv_cache_zero", ["actor_rollout_ref.rollout.kv_cache_space_gib=0"],
     "actor_rollout_ref.rollout.kv_cache_space_gib", "= 0", "frozenlake"),
    ("env_actors_zero", ["agent_proxy.num_env_actors=0"], "agent_proxy.num_env_actors", "= 0", "frozenlake"),
    ("env_actors_beyond_groups", ["agent_proxy.num_env_actors=9"], "agent_proxy.num_env_actors", "= 9",
     "frozenlake"),
    ("max_turn_zero", ["agent_proxy.max_turn=0"], "agent_proxy.max_turn", "= 0", "frozenlake"),
    ("mini_batch_zero", ["ppo_mini_batch_size=0"], "ppo_mini_batch_size", "= 0", "frozenlake"),
    ("colocated_ref_world_size", ["actor_rollout_ref.ref.fsdp.world_size=2"], "actor_rollout_ref.ref.fsdp.world_size",
     "colocate=false", "frozenlake_grpo"),
    ("colocated_critic_threads", ["critic.fsdp.num_threads=2"], "critic.fsdp.num_threads = 2 has no effect",
     "critic.colocate=false", "frozenlake"),
    ("mixed_precision_unknown", ["actor_rollout_ref.actor.fsdp.mixed_precision=fp16"],
     "actor_rollout_ref.actor.fsdp.mixed_precision", "'fp16'", "frozenlake"),
    ("colocated_critic_precision", ["critic.fsdp.mixed_precision=bf16"],
     "critic.fsdp.mixed_precision = bf16 has no effect", "critic.colocate=false", "frozenlake"),
    ("world_size_zero", ["actor_rollout_ref.actor.fsdp.world_size=0"], "actor_rollout_ref.actor.fsdp.world_size",
     "= 0", "frozenlake"),
    ("group_size_zero", ["es_manager.train.group_size=0"], "es_manager.train.group_size", "0", "frozenlake"),
    # the learning-rate schedule
    ("lr_scheduler_unknown", ["actor_rollout_ref.actor.optim.lr_scheduler_type=linear"],
     "actor_rollout_ref.actor.optim.lr_scheduler_type", "'linear'", "frozenlake"),
    ("min_lr_ratio_without_cosine", ["critic.optim.min_lr_ratio=0.1"], "critic.optim.min_lr_ratio = 0.1",
     "lr_scheduler_type=cosine", "frozenlake"),
    ("min_lr_ratio_above_one", ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                                "actor_rollout_ref.actor.optim.min_lr_ratio=1.5"],
     "actor_rollout_ref.actor.optim.min_lr_ratio", "1.5", "frozenlake"),
    # ranges
    ("temperature_neg", ["actor_rollout_ref.rollout.temperature=-0.5"], "actor_rollout_ref.rollout.temperature",
     "-0.5", "frozenlake"),
    ("top_p_zero", ["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p", "= 0", "frozenlake"),
    ("top_p_above_one", ["actor_rollout_ref.rollout.top_p=1.5"], "actor_rollout_ref.rollout.top_p", "1.5",
     "frozenlake"),
    ("top_k_zero", ["actor_rollout_ref.rollout.top_k=0"], "actor_rollout_ref.rollout.top_k", "= 0", "frozenlake"),
    ("top_k_neg", ["actor_rollout_ref.rollout.top_k=-2"], "actor_rollout_ref.rollout.top_k", "-2", "frozenlake"),
    ("val_temperature_neg", ["actor_rollout_ref.rollout.val_kwargs.temperature=-1"],
     "actor_rollout_ref.rollout.val_kwargs.temperature", "-1", "frozenlake"),
    ("actor_lr_zero", ["actor_rollout_ref.actor.optim.lr=0"], "actor_rollout_ref.actor.optim.lr", "= 0",
     "frozenlake"),
    ("critic_lr_neg", ["critic.optim.lr=-1e-4"], "critic.optim.lr", "-0.0001", "frozenlake"),
    ("lr_nan", ["actor_rollout_ref.actor.optim.lr=nan"], "actor_rollout_ref.actor.optim.lr", "nan", "frozenlake"),
    ("dtype_float64", ["actor_rollout_ref.model.dtype=float64"], "actor_rollout_ref.model.dtype", "'float64'",
     "frozenlake"),
    ("clip_ratio_zero", ["actor_rollout_ref.actor.clip_ratio=0"], "actor_rollout_ref.actor.clip_ratio", "= 0",
     "frozenlake"),
    ("clip_high_neg", ["actor_rollout_ref.actor.clip_ratio_high=-0.1"], "actor_rollout_ref.actor.clip_ratio_high",
     "-0.1", "frozenlake"),
    ("clip_c_one", ["actor_rollout_ref.actor.clip_ratio_c=1"], "actor_rollout_ref.actor.clip_ratio_c", "= 1",
     "frozenlake"),
    ("kl_loss_coef_neg", ["actor_rollout_ref.actor.kl_loss_coef=-0.001"], "actor_rollout_ref.actor.kl_loss_coef",
     "-0.001", "frozenlake"),
    ("kl_ctrl_coef_neg", ["algorithm.kl_ctrl.kl_coef=-1"], "algorithm.kl_ctrl.kl_coef", "-1", "frozenlake"),
    ("entropy_neg", ["actor_rollout_ref.actor.entropy_coeff=-0.01"], "actor_rollout_ref.actor.entropy_coeff",
     "-0.01", "frozenlake"),
    ("grad_clip_zero", ["actor_rollout_ref.actor.grad_clip=0"], "actor_rollout_ref.actor.grad_clip", "= 0",
     "frozenlake"),
    ("target_kl_zero", ["actor_rollout_ref.actor.target_kl=0"], "actor_rollout_ref.actor.target_kl", "= 0",
     "frozenlake"),
    ("gamma_above_one", ["algorithm.gamma=1.5"], "algorithm.gamma", "1.5", "frozenlake"),
    ("format_penalty_pos", ["es_manager.format_penalty=0.5"], "es_manager.format_penalty", "0.5", "frozenlake"),
    ("env_step_timeout_zero", ["es_manager.env_step_timeout_s=0"], "es_manager.env_step_timeout_s", "= 0",
     "frozenlake"),
    ("env_reset_timeout_neg", ["es_manager.env_reset_timeout_s=-1"], "es_manager.env_reset_timeout_s", "= -1",
     "frozenlake"),
    ("reset_fraction_above_one", ["es_manager.max_failed_reset_fraction=1.5"],
     "es_manager.max_failed_reset_fraction", "1.5", "frozenlake"),
    ("observation_chars_tiny", ["es_manager.max_observation_chars=10"], "es_manager.max_observation_chars",
     "= 10", "frozenlake"),
    ("generate_timeout_zero", ["actor_rollout_ref.rollout.generate_timeout_s=0"],
     "actor_rollout_ref.rollout.generate_timeout_s", "= 0", "frozenlake"),
    ("seed_neg", ["trainer.seed=-1"], "trainer.seed", "-1", "frozenlake"),
    ("dashboard_port", ["trainer.dashboard_port=70000"], "trainer.dashboard_port", "70000", "frozenlake"),
    ("trajectories_freq_neg", ["trainer.log_trajectories_freq=-1"], "trainer.log_trajectories_freq", "-1",
     "frozenlake"),
    ("trajectories_per_tag_zero", ["trainer.log_trajectories_per_tag=0"], "trainer.log_trajectories_per_tag", "= 0",
     "frozenlake"),
    ("eval_k_neg", ["eval.k=-1"], "eval.k", "-1", "frozenlake"),
    ("max_restarts_neg", ["trainer.max_restarts=-1"], "trainer.max_restarts", "-1", "frozenlake"),
    ("collective_timeout_zero", ["trainer.collective_timeout_s=0"], "trainer.collective_timeout_s", "= 0",
     "frozenlake"),
    ("placement_timeout_neg", ["trainer.placement_timeout_s=-5"], "trainer.placement_timeout_s", "-5",
     "frozenlake"),
    ("tensor_parallel_on_cpu", ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.device=cpu"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size", "2", "frozenlake"),
    # batch sizes that do not divide
    ("mini_not_dividing_rows", ["ppo_mini_batch_size=7"], "actor_rollout_ref.actor.ppo_mini_batch_size", "(7)",
     "frozenlake"),
    ("micro_not_dividing", ["micro_batch_size_per_gpu=3"], "ppo_micro_batch_size_per_gpu", "(3)", "frozenlake"),
    ("mini_not_dividing_ranks", ["actor_rollout_ref.actor.fsdp.world_size=3"],
     "actor_rollout_ref.actor.ppo_mini_batch_size", "(3)", "frozenlake"),
    ("critic_mini_not_dividing", ["critic.ppo_mini_batch_size=5"], "critic.ppo_mini_batch_size", "(5)",
     "frozenlake"),
    # model path and context length
    ("model_path_empty", ["model_path="], "actor_rollout_ref.model.path", "''", "frozenlake"),
    ("model_path_missing", ["model_path=models/definitely-missing"], "actor_rollout_ref.model.path",
     "'models/definitely-missing'", "frozenlake"),
    ("model_path_absolute_missing", ["model_path=/nonexistent/model"], "actor_rollout_ref.model.path",
     "'/nonexistent/model'", "frozenlake"),
    ("model_path_bare_name", ["model_path=tiny-qwen2"], "actor_rollout_ref.model.path", "'tiny-qwen2'",
     "frozenlake"),
    ("model_path_not_a_model", ["model_path={tmp}"], "actor_rollout_ref.model.path", "{tmp}", "frozenlake"),
    ("context_beyond_model", ["actor_rollout_ref.rollout.max_model_len=4096"],
     "actor_rollout_ref.rollout.max_model_len", "4096", "frozenlake"),
    ("response_fills_context", ["actor_rollout_ref.rollout.response_length=1536"],
     "actor_rollout_ref.rollout.response_length", "1536", "frozenlake"),
    # names that do not exist
    ("unknown_env_tag", ["es_manager.train.env_configs.tags=[NoSuchEnv]"], "es_manager.train.env_configs.tags",
     "'NoSuchEnv'", "frozenlake"),
    ("unknown_estimator", ["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "'ppo'", "frozenlake"),
    ("unknown_policy_loss", ["actor_rollout_ref.actor.policy_loss_mode=dapo"],
     "actor_rollout_ref.actor.policy_loss_mode", "'dapo'", "frozenlake"),
    ("unknown_loss_agg", ["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode",
     "'mean'", "frozenlake"),
    ("unknown_logger", ["trainer.logger=[console,mlflow]"], "trainer.logger", "'mlflow'", "frozenlake"),
    ("unknown_engine", ["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name", "'sglang'",
     "frozenlake"),
    ("unknown_kl_type", ["actor_rollout_ref.actor.kl_loss_type=k9"], "actor_rollout_ref.actor.kl_loss_type", "'k9'",
     "frozenlake"),
    ("unknown_kl_penalty", ["algorithm.kl_penalty=k9"], "algorithm.kl_penalty", "'k9'", "frozenlake"),
    ("unknown_device", ["trainer.device=tpu"], "trainer.device", "'tpu'", "frozenlake"),
    ("unknown_resume_mode", ["trainer.resume_mode=latest"], "trainer.resume_mode", "'latest'", "frozenlake"),
    ("unknown_ctx_mode", ["ctx_manager.mode=compact"], "ctx_manager.mode", "'compact'", "frozenlake"),
    # env groups
    ("n_groups_sum", ["es_manager.train.env_configs.n_groups=[3]"], "es_manager.train.env_configs.n_groups", "[3]",
     "frozenlake"),
    ("n_groups_length", ["es_manager.val.env_configs.n_groups=[16,16]"], "es_manager.val.env_configs.n_groups",
     "[16, 16]", "frozenlake"),
    # estimators and their preconditions
    ("grpo_group_of_one", ["algorithm.adv_estimator=grpo", *GROUP], "es_manager.train.group_size", "= 1",
     "frozenlake"),
    ("rloo_group_of_one", ["algorithm.adv_estimator=rloo", *GROUP], "es_manager.train.group_size", "= 1",
     "frozenlake"),
    ("rpp_baseline_group_of_one", ["algorithm.adv_estimator=reinforce_plus_plus_baseline", *GROUP],
     "es_manager.train.group_size", "= 1", "frozenlake"),
    ("gigpo_group_of_one", ["algorithm.adv_estimator=gigpo", *GROUP], "es_manager.train.group_size", "= 1",
     "frozenlake"),
    ("grpo_multiturn_group_of_one", ["es_manager.train.group_size=1"], "es_manager.train.group_size", "= 1",
     "frozenlake_grpo_multiturn"),
    ("gigpo_one_turn", ["algorithm.adv_estimator=gigpo", "agent_proxy.max_turn=1"], "agent_proxy.max_turn", "= 1",
     "frozenlake"),
    ("grpo_multiturn_full_rows", ["algorithm.adv_estimator=grpo_multiturn"], "ctx_manager.mode", "'full'",
     "frozenlake_grpo"),
    ("gae_condensed_rows", ["ctx_manager.mode=condensed"], "ctx_manager.mode", "'condensed'", "frozenlake"),
    ("gae_without_critic", ["critic.enable=false"], "critic.enable", "False", "frozenlake"),
    ("critic_nobody_reads", ["critic.enable=true"], "critic.enable", "True", "frozenlake_grpo"),
    ("nonfinite_policy", ["algorithm.nonfinite_reward=skip"], "algorithm.nonfinite_reward", "'skip'", "frozenlake"),
    # files
    ("envs_file_missing", ["envs_file={tmp}/missing.yaml"], "envs_file", "missing.yaml", "frozenlake"),
    ("envs_file_malformed", ["envs_file={tmp}/bad_envs.yaml"], "envs_file", "bad_envs.yaml", "frozenlake"),
    ("resume_path_without_path", ["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "None",
     "frozenlake"),
    ("resume_path_ignored", ["trainer.resume_from_path={tmp}"], "trainer.resume_from_path", "{tmp}", "frozenlake"),
    ("resume_path_missing", ["trainer.resume_mode=resume_path", "trainer.resume_from_path={tmp}/nope"],
     "trainer.resume_from_path", "nope", "frozenlake"),
    # prompt datasets and reward sources (docs/rewards.md)
    ("data_files_unplayed", ["data.train_files=[data/arith/train.jsonl]"], "data.train_files", "'PromptData'",
     "frozenlake"),
    ("data_tag_without_files", ["es_manager.train.env_configs.tags=[PromptData]"], "data.train_files",
     "'PromptData'", "frozenlake"),
    ("val_files_unplayed", ["es_manager.val.env_configs.tags=[FrozenLake3x3]"], "data.val_files", "val.jsonl",
     "arith_grpo"),
    ("data_file_missing", ["data.train_files=[{tmp}/missing.jsonl]"], "data.train_files", "missing.jsonl",
     "arith_grpo"),
    ("data_file_malformed", ["data.train_files=[{tmp}/bad.jsonl]"], "data.train_files", "bad.jsonl:2",
     "arith_grpo"),
    ("data_prompt_key_missing", ["data.prompt_key=question"], "data.prompt_key", "'question'", "arith_grpo"),
    ("data_prompt_too_long", ["data.max_prompt_length=3"], "data.max_prompt_length", "= 3", "arith_grpo"),
    ("data_max_turns_zero", ["data.max_turns=0"], "data.max_turns", "= 0", "arith_grpo"),
    ("data_max_turns_over_max_turn", ["data.max_turns=2"], "data.max_turns", "= 2", "arith_grpo"),
    ("reward_fn_without_data", ["reward.custom_reward_function.path=data/arith/reward.py"],
     "reward.custom_reward_function.path", "reward.py", "frozenlake"),
    ("reward_fn_missing_file", ["reward.custom_reward_function.path={tmp}/nope.py"],
     "reward.custom_reward_function.path", "nope.py", "arith_grpo"),
    ("reward_fn_wrong_name", ["reward.custom_reward_function.name=score_it"], "reward.custom_reward_function.name",
     "'score_it'", "arith_grpo"),
    ("rm_without_path", ["reward_model.enable=true"], "reward_model.model.path", "True", "frozenlake"),
    ("rm_path_without_enable", ["reward_model.model.path=models/tiny-qwen2-rm"], "reward_model.model.path",
     "tiny-qwen2-rm", "frozenlake"),
    ("rm_dump_without_enable", ["reward_model.dump_scores=true"], "reward_model.dump_scores", "True", "frozenlake"),
    ("rm_input_choice", ["reward_model.input=prompt"], "reward_model.input", "'prompt'", "frozenlake_rm"),
    ("rm_weight_zero", ["reward_model.reward_weight=0"], "reward_model.reward_weight", "= 0", "frozenlake_rm"),
    ("rm_with_remax", ["reward_model.enable=true", "reward_model.model.path=x/y"], "reward_model.enable", "'remax'",
     "frozenlake_remax"),
    ("rm_missing_model", ["reward_model.enable=true", "reward_model.model.path={tmp}/nope"],
     "reward_model.model.path", "nope", "frozenlake"),
    ("rm_not_one_label", ["reward_model.enable=true", "reward_model.model.path=${model_path}"],
     "reward_model.model.path", "num_labels = 2", "frozenlake"),
    # the judge (agent_trainer/checks/judge.py; JUDGE is an endpoint that passes every other check)
    ("judge_key_without_enable", ["judge.model=gpt-4.1-mini"], "judge.model = 'gpt-4.1-mini'", "judge.enable = False",
     "frozenlake"),
    ("judge_key_env_without_enable", ["judge.api_key_env=sk-not-a-name"], "judge.api_key_env = (not shown)",
     "judge.enable = False", "frozenlake"),
    ("judge_without_url", ["judge.enable=true", "judge.model=m"], "judge.base_url", "''", "frozenlake"),
    ("judge_url_scheme", [*JUDGE, "judge.base_url=ftp://127.0.0.1/v1"], "judge.base_url", "'ftp://127.0.0.1/v1'",
     "frozenlake"),
    ("judge_without_model", [*JUDGE, "judge.model=''"], "judge.model", "''", "frozenlake"),
    ("judge_key_env_unset", [*JUDGE, "judge.api_key_env=AGENT_TRAINER_NO_SUCH_KEY"], "judge.api_key_env",
     "'AGENT_TRAINER_NO_SUCH_KEY' names an environment variable that is not set", "frozenlake"),
    ("judge_key_env_not_a_name", [*JUDGE, "judge.api_key_env=sk-not-a-name"], "judge.api_key_env", "NAME",
     "frozenlake"),
    ("judge_mode_unknown", [*JUDGE, "judge.mode=rank"], "judge.mode", "'rank'", "frozenlake"),
    ("judge_input_choice", [*JUDGE, "judge.input=prompt"], "judge.input", "'prompt'", "frozenlake"),
    ("judge_scores_range", [*JUDGE, "judge.min_score=1", "judge.max_score=1"], "judge.min_score", "1.0",
     "frozenlake"),
    ("judge_weight_zero", [*JUDGE, "judge.reward_weight=0"], "judge.reward_weight", "= 0", "frozenlake"),
    ("judge_timeout_zero", [*JUDGE, "judge.timeout_s=0"], "judge.timeout_s", "= 0", "frozenlake"),
    ("judge_fraction", [*JUDGE, "judge.max_unscored_fraction=1.5"], "judge.max_unscored_fraction", "1.5",
     "frozenlake"),
    ("judge_with_remax", JUDGE, "judge.enable", "'remax'", "frozenlake_remax"),
    # align-anything / RAGEN keys refused here (agent_trainer/config/compat.py, docs/compatibility.md)
    ("aa_epochs", ["train_cfgs.epochs=3"], "train_cfgs.epochs", "trainer.total_training_steps", "frozenlake"),
    ("aa_env_name", ["+env_cfgs.env_name=frozen_lake"], "env_cfgs.env_name", "es_manager.train.env_configs.tags",
     "frozenlake"),
    ("aa_unmapped", ["train_cfgs.ptx_coeff=0.5"], "train_cfgs.ptx_coeff", "pretraining-mix", "frozenlake"),
    ("ragen_nnodes", ["trainer.nnodes=2"], "trainer.nnodes", "RAY_ADDRESS", "frozenlake"),
    ("aa_multi_turn_value", ["train_cfgs.multi_turn=maybe"], "train_cfgs.multi_turn", "'maybe'", "frozenlake"),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    """A folder without a model in it, and a malformed env-tags file."""
    path = tmp_path_factory.mktemp("cfg")
    (path / "bad_envs.yaml").write_text("custom_envs:\n  Broken:\n    env_type: no_such_env\n")
    (path / "bad.jsonl").write_text('{"prompt": "What is 1 + 1?"}\n{"prompt": \n')
    return path


@pytest.mark.parametrize("overrides, key, value, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_config_is_refused_in_one_line(overrides, key, value, name, tmp, tiny_model_path):
    overrides = [o.replace("{tmp}", str(tmp)) for o in overrides]
    if not any(o.startswith("model_path=") for o in overrides):
        overrides.append(f"model_path={tiny_model_path}")
    with pytest.raises(SystemExit) as exit_info:
        compose_and_prepare(overrides, config_name=name)
    line = exit_info.value.code
    assert isinstance(line, str) and line.startswith("agent-trainer: ")  # a string code exits with status 1
    assert "\n" not in line and "Traceback" not in line, line
    assert key in line and value.replace("{tmp}", str(tmp)) in line, line
    assert "sk-not-a-name" not in line  # a value that may be a key is never echoed
    assert not ray.is_initialized()


def test_case_table_is_large_and_distinct():
    assert len(CASES) >= 45 and len({c[0] for c in CASES}) == len(CASES)


def test_unknown_key_suggests_the_closest_known_key(tiny_model_path):
    for override, hint in (("+trainer.totl_steps=3", "did you mean trainer.total_training_steps?"),
                           ("+trainer.use_kl_loss=true", "did you mean actor_rollout_ref.actor.use_kl_loss?"),
                           ("+es_manager.train.group_sz=2", "did you mean es_manager.train.group_size?")):
        with pytest.raises(SystemExit, match=hint.replace("?", r"\?")):
            compose_and_prepare([override, f"model_path={tiny_model_path}"])


def test_a_valid_config_passes(tiny_model_path):
    cfg, tags = compose_and_prepare([f"model_path={tiny_model_path}"])
    assert cfg.trainer.total_training_steps == 40 and "FrozenLake3x3" in tags


def test_cuda_is_not_refused_because_the_driver_has_no_gpu(tiny_model_path, monkeypatch):
    """A `ray job submit` entrypoint may run on a head node without GPUs: the cluster decides, once joined
    (agent_trainer.workers.build.check_device, tests/workers/test_gpu_path_engine.py)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg, _ = compose_and_prepare(["trainer.device=cuda", f"model_path={tiny_model_path}"])
    assert cfg.trainer.device == "cuda"


# -- the real command line ----------------------------------------------------------------------------------


def _run_cli(args: list[str], tmp_path: Path, extra_env: dict | None = None) -> tuple[int, str, set[str]]:
    """Run ``python -m agent_trainer.main``; return the exit code, stderr, and every child process name seen."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HYDRA_FULL_ERROR")}
    env.update(RAY_TMPDIR=str(tmp_path / "ray"), **(extra_env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "agent_trainer.main", f"hydra.run.dir={tmp_path}/hydra", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.update(p.name() for p in psutil.Process(proc.pid).children(recursive=True))
        except psutil.Error:
            pass
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=10)
    return proc.returncode, stderr, seen


@pytest.mark.parametrize("args, env, key, value", [
    (["+trainer.totl_steps=3"], {}, "trainer.totl_steps", "did you mean trainer.total_training_steps?"),
    (["trainer.total_training_steps=abc"], {}, "trainer.total_training_steps", "'abc'"),
    (["algorithm.adv_estimator=grpo", "es_manager.train.group_size=1", "ppo_mini_batch_size=8"], {},
     "es_manager.train.group_size", "= 1"),
    # a hub id goes to the hub (offline here): the loader's failure becomes the one line
    (["model_path=no-such-org/no-such-model"], {"HF_HUB_OFFLINE": "1"}, "actor_rollout_ref.model.path",
     "'no-such-org/no-such-model'"),
], ids=["plus_typo", "wrong_type", "grpo_group_of_one", "hub_id_unreachable"])
def test_command_line_exits_with_one_line_and_no_ray(args, env, key, value, tmp_path, tiny_model_path):
    if not any(a.startswith("model_path=") for a in args):
        args = [*args, f"model_path={tiny_model_path}"]
    code, stderr, children = _run_cli(args, tmp_path, env)
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1, stderr
    assert lines[0].startswith("agent-trainer: ") and key in lines[0] and value in lines[0], lines[0]
    assert not {"raylet", "gcs_server"} & children, children
    assert not (tmp_path / "ray").exists()  # ray.init would have created its session folder here


def test_a_cached_hub_id_resolves_without_the_network(tmp_path, tiny_model_path):
    """org/name goes to the hub loader, which finds it in the local cache (offline here)."""
    snapshot = tmp_path / "models--fake-org--fake-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((Path(tiny_model_path) / "config.json").read_text())
    (tmp_path / "models--fake-org--fake-model" / "refs").mkdir()
    (tmp_path / "models--fake-org--fake-model" / "refs" / "main").write_text("abc123")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    code = ("from agent_trainer.checks.inputs import resolve_model; "
            "print(resolve_model('actor_rollout_ref.model.path', 'fake-org/fake-model').max_position_embeddings)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "2048", proc.stderr
