"""Trainer-side performance keys: the on-policy skip of old log-probs, rollout correction, token budgets."""

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer.config import load_config
from agent_trainer.main import CONFIG_DIR
from agent_trainer.trainer import needs_old_log_probs


def _load(*overrides: str, name: str = "frozenlake_grpo"):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose(name, overrides=list(overrides)))


def test_dynamic_bsz_switch_reaches_ref_and_critic():
    cfg = _load("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                name="frozenlake")
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz and cfg.critic.use_dynamic_bsz
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 4096


@pytest.mark.parametrize("overrides, rows, expected", [
    ([], 32, True),  # frozenlake_grpo: 32 rows in mini-batches of 16 -> two optimizer steps
    (["ppo_mini_batch_size=32"], 32, False),  # one mini-batch, one epoch: exactly on-policy
    (["ppo_mini_batch_size=32"], 20, False),  # fewer rows (filtering) still fit the one mini-batch
    (["ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_epochs=2"], 32, True),
    (["ppo_mini_batch_size=32", "actor_rollout_ref.actor.recompute_old_log_prob=always"], 32, True),
    (["ppo_mini_batch_size=32", "algorithm.rollout_correction.rollout_is=token"], 32, True),
    (["ppo_mini_batch_size=32", "algorithm.use_kl_in_reward=true"], 32, False),  # temperature 1: engine log-probs
    (["ppo_mini_batch_size=32", "algorithm.use_kl_in_reward=true", "actor_rollout_ref.rollout.temperature=0.7"],
     32, True),
])
def test_old_log_probs_are_recomputed_exactly_when_needed(overrides, rows, expected):
    assert needs_old_log_probs(_load(*overrides), rows) is expected


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.recompute_old_log_prob=never"],
     "actor_rollout_ref.actor.recompute_old_log_prob = 'never' is not one of ['auto', 'always']"),
    (["algorithm.rollout_correction.rollout_is=batch"], "algorithm.rollout_correction.rollout_is = 'batch'"),
    (["algorithm.rollout_correction.rollout_is_threshold=0"], "algorithm.rollout_correction.rollout_is_threshold = 0"),
    (["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.temperature=0.7"],
     "actor_rollout_ref.rollout.temperature=1.0"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512"],
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 512 is smaller than actor_rollout_ref.rollout.max_model_len"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=100"],
     "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu = 100"),
    (["critic.forward_max_token_len_per_gpu=0"], "critic.forward_max_token_len_per_gpu = 0"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=None) as err:
        _load(*overrides)
    assert message in str(err.value)
