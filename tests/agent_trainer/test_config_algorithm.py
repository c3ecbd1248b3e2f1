"""Config keys of the estimators' options: algorithm.gigpo.*, algorithm.nonfinite_reward, ReMax's rules."""

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer.config import load_config
from agent_trainer.main import CONFIG_DIR


def _load(*overrides: str, name: str = "frozenlake"):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose(name, overrides=list(overrides)))


def test_gigpo_options_reach_the_estimator():
    cfg = _load("algorithm.adv_estimator=gigpo", "algorithm.gigpo.step_advantage_w=0.5",
                "algorithm.gigpo.mode=mean_std_norm", "algorithm.gigpo.epsilon=1e-4")
    assert cfg.algorithm.estimator_options() == {"step_advantage_w": 0.5, "mode": "mean_std_norm", "epsilon": 1e-4}
    assert not cfg.critic_enabled
    assert _load("algorithm.adv_estimator=grpo").algorithm.estimator_options() == {"epsilon": 1e-6}  # advantage_epsilon


def test_the_shipped_gigpo_and_remax_configs_load():
    gigpo = _load(name="frozenlake_gigpo")
    assert gigpo.algorithm.estimator() == "gigpo" and gigpo.ctx_manager.mode == "full"
    remax = _load(name="frozenlake_remax")
    assert remax.algorithm.estimator() == "remax" and not remax.critic_enabled
    condensed = _load("algorithm.adv_estimator=gigpo", "ctx_manager.mode=condensed")  # one row per step
    assert condensed.ctx_manager.mode == "condensed"


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.nonfinite_reward=skip"], "algorithm.nonfinite_reward = 'skip' is not one of ['error', 'drop']"),
    (["algorithm.gigpo.mode=max_norm"], "algorithm.gigpo.mode = 'max_norm' is not one of"),
    (["algorithm.gigpo.epsilon=0"], "algorithm.gigpo.epsilon = 0.0 must be > 0"),
    (["algorithm.adv_estimator=remax", "agent_proxy.reward_normalization.method=mean_std"],
     "agent_proxy.reward_normalization.method=identity"),
    (["algorithm.adv_estimator=remax", "ctx_manager.mode=condensed"], "ctx_manager.mode = 'condensed'"),
])
def test_bad_algorithm_options_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as err:
        _load(*overrides)
    assert message in str(err.value)
