"""Config loading: typed schema, interpolation, clear errors naming the key and the fix."""

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer.config import load_config
from agent_trainer.main import CONFIG_DIR, prepare


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("frozenlake", overrides=list(overrides))


def test_frozenlake_config_loads_and_interpolates():
    cfg = load_config(_compose("model_path=/some/model"))
    assert cfg.actor_rollout_ref.model.path == "/some/model" and cfg.critic.model.path == "/some/model"
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == cfg.ppo_mini_batch_size
    assert cfg.critic_enabled and not cfg.ref_enabled
    assert cfg.trainer.default_local_dir.endswith("agent_trainer/frozenlake_ppo")


def test_estimator_selection():
    cfg = load_config(_compose("algorithm.bi_level_gae=true"))
    assert cfg.algorithm.estimator() == "bi_level_gae" and cfg.critic_enabled
    cfg = load_config(_compose("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"))
    assert cfg.algorithm.estimator() == "grpo" and not cfg.critic_enabled and cfg.ref_enabled


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator"),
        ("actor_rollout_ref.actor.loss_agg_mode=mean", "actor_rollout_ref.actor.loss_agg_mode"),
        ("actor_rollout_ref.actor.kl_loss_type=k9", "actor_rollout_ref.actor.kl_loss_type"),
        ("ppo_mini_batch_size=7", "ppo_mini_batch_size (7) must divide the rows per step"),
        ("micro_batch_size_per_gpu=3", "ppo_micro_batch_size_per_gpu (3) must divide"),
        ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name"),
        ("trainer.totl_steps=3", "totl_steps"),
        ("trainer.total_training_steps=abc", "total_training_steps"),
        ("es_manager.train.env_configs.n_groups=[3]", "n_groups"),
        ("critic.enable=false", "critic.enable"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    # hydra rejects unknown keys and wrong types while composing; load_config the cross-field rules
    with pytest.raises(Exception) as err:
        load_config(_compose(override))
    assert isinstance(err.value, ValueError) or "ConfigCompositionException" in type(err.value).__name__
    assert expected in str(err.value)


def test_unknown_env_tag_is_reported_before_workers_start(tmp_path):
    with pytest.raises(ValueError, match="NoSuchEnv"):
        prepare(_compose("es_manager.train.env_configs.tags=[NoSuchEnv]", f"model_path={tmp_path}"))


def test_missing_model_names_the_fix():
    with pytest.raises(ValueError, match="make model"):
        prepare(_compose("model_path=models/definitely-missing"))


def test_configuration_doc_is_current():
    from launch.config_docs import OUT, render

    assert OUT.read_text() == render(), "docs/configuration.md is stale: run python -m launch.config_docs"
