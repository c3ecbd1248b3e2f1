"""Config loading: typed schema, interpolation, clear errors naming the key and the fix."""

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer.config import load_config
from agent_trainer.main import CONFIG_DIR, prepare


def _compose(*overrides: str, name: str = "frozenlake"):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(name, overrides=list(overrides))


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


def test_grpo_multiturn_config_selects_condensed_per_turn_rows():
    cfg = load_config(_compose(name="frozenlake_grpo_multiturn"))
    assert cfg.algorithm.estimator() == "grpo_multiturn" and cfg.ctx_manager.mode == "condensed"
    assert cfg.ctx_manager.keep_last_n_turns == 2 and not cfg.critic_enabled
    # rows per step vary in condensed mode, so the mini-batch need not divide the episode count
    load_config(_compose("ppo_mini_batch_size=24", name="frozenlake_grpo_multiturn"))


@pytest.mark.parametrize(
    "name, overrides, expected",
    [
        # grpo_multiturn on one row per episode would silently be plain grpo
        ("frozenlake_grpo", ["algorithm.adv_estimator=grpo_multiturn"], "set ctx_manager.mode=condensed"),
        ("frozenlake", ["ctx_manager.mode=condensed"], "algorithm.adv_estimator = 'gae'"),
        ("frozenlake_grpo", ["ctx_manager.mode=condensed"], "set algorithm.adv_estimator=grpo_multiturn"),
        ("frozenlake_bilevel", ["ctx_manager.mode=condensed"], "value bootstrap"),
        ("frozenlake", ["ctx_manager.mode=compact"], "ctx_manager.mode = 'compact' is not one of ['full', 'condensed']"),
        ("frozenlake_grpo_multiturn", ["ctx_manager.keep_last_n_turns=-1"], "ctx_manager.keep_last_n_turns = -1"),
        ("frozenlake_grpo_multiturn", ["micro_batch_size_per_gpu=3"], "ppo_micro_batch_size_per_gpu (3) must divide"),
    ],
)
def test_context_mode_and_estimator_must_agree(name, overrides, expected):
    with pytest.raises(ValueError) as err:
        load_config(_compose(*overrides, name=name))
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("agent_proxy.reward_normalization.grouping=episode", "agent_proxy.reward_normalization.grouping = 'episode'"),
        ("agent_proxy.reward_normalization.method=zscore", "['identity', 'mean', 'mean_std', 'asym_clip']"),
        ("actor_rollout_ref.rollout.rollout_filter_strategy=std", "['top_k', 'top_p', 'min_p']"),
        ("actor_rollout_ref.rollout.rollout_filter_value=0", "must lie in (0, 1] for rollout_filter_strategy 'top_k'"),
        ("actor_rollout_ref.rollout.rollout_filter_value=1.5", "rollout_filter_value = 1.5"),
    ],
)
def test_shaping_choices_are_validated(override, expected):
    with pytest.raises(ValueError) as err:
        load_config(_compose(override))
    assert expected in str(err.value)


def test_shaping_values_that_load():
    cfg = load_config(_compose("actor_rollout_ref.rollout.rollout_filter_strategy=min_p",
                               "actor_rollout_ref.rollout.rollout_filter_value=0",
                               "agent_proxy.reward_normalization.grouping=inductive",
                               "agent_proxy.reward_normalization.method=asym_clip"))
    assert cfg.agent_proxy.reward_normalization.method == "asym_clip"
    # filtering ranks groups by their reward std: groups of one would be dropped arbitrarily
    with pytest.raises(ValueError, match="group_size >= 2"):
        load_config(_compose("es_manager.train.group_size=1", "actor_rollout_ref.rollout.rollout_filter_value=0.25",
                             "ppo_mini_batch_size=8"))
