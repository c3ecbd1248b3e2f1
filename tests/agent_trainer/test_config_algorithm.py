"""Config keys of the estimators' options: algorithm.gigpo.*, algorithm.nonfinite_reward, ReMax's rules."""

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer import core_algos
from agent_trainer.checks.load import load_config
from agent_trainer.checks.prepare import CONFIG_DIR


def _load(*overrides: str, name: str = "frozenlake"):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose(name, overrides=list(overrides)))


def test_gigpo_options_reach_the_estimator():
    cfg = _load("algorithm.adv_estimator=gigpo", "algorithm.gigpo.step_advantage_w=0.5",
                "algorithm.gigpo.mode=mean_std_norm", "algorithm.gigpo.epsilon=1e-4")
    assert core_algos.estimator_options(cfg.algorithm) == {"step_advantage_w": 0.5, "mode": "mean_std_norm",
                                                     "epsilon": 1e-4}
    assert not core_algos.critic_enabled(cfg)
    assert core_algos.estimator_options(_load("algorithm.adv_estimator=grpo").algorithm) == {"epsilon": 1e-6}  # advantage_epsilon


def test_the_shipped_gigpo_and_remax_configs_load():
    gigpo = _load(name="frozenlake_gigpo")
    assert core_algos.estimator(gigpo.algorithm) == "gigpo" and gigpo.ctx_manager.mode == "full"
    remax = _load(name="frozenlake_remax")
    assert core_algos.estimator(remax.algorithm) == "remax" and not core_algos.critic_enabled(remax)
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
