import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.checks.rules import validate_algorithm_choices


def _batch():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    rewards = torch.zeros(4, 6)
    rewards[0, 2], rewards[0, 4], rewards[1, 3], rewards[2, 1] = 1.0, 0.5, 2.0, -1.0
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": torch.randn(4, 6, generator=g),
        "uid": torch.tensor([0, 0, 1, 1]),
        "traj_uid": torch.tensor([0, 1, 2, 3]),
        "anchor_obs_ids": torch.tensor([[7, 7, 7, 8, 8, 8]] * 4),
        "reward_baselines": torch.tensor([0.5, 0.5, 0.0, 0.0]),
    }


def test_registry_names_and_unknown_error():
    assert set(core_algos.ADV_ESTIMATOR_NAMES) == {
        "gae", "bi_level_gae", "grpo", "grpo_multiturn", "rloo", "reinforce_plus_plus",
        "reinforce_plus_plus_baseline", "remax", "gigpo"}  # in registration order (core_algos/__init__ imports)
    assert core_algos.get_adv_estimator_fn("gae") is core_algos.compute_gae_advantage_return
    with pytest.raises(ValueError) as err:
        core_algos.get_adv_estimator_fn("ppo")
    for name in core_algos.ADV_ESTIMATOR_NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", core_algos.ADV_ESTIMATOR_NAMES)
def test_compute_advantage_dispatches_every_estimator(name):
    batch = _batch()
    adv, ret = core_algos.compute_advantage(batch, name, gamma=0.9, lam=0.95, high_level_gamma=0.9)
    assert adv.shape == ret.shape == (4, 6)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    outside = ~batch["response_mask"].bool()
    assert (adv[outside] == 0).all() and (ret[outside] == 0).all()


def test_compute_advantage_passes_the_right_arguments():
    b = _batch()
    adv, ret = core_algos.compute_advantage(b, "gae", gamma=0.9, lam=0.95)
    ref = core_algos.compute_gae_advantage_return(b["token_level_rewards"], b["values"], b["response_mask"], 0.9, 0.95)
    torch.testing.assert_close(adv, ref[0])
    torch.testing.assert_close(ret, ref[1])
    adv, _ = core_algos.compute_advantage(b, "grpo", norm_adv_by_std_in_grpo=False, epsilon=1e-3)
    ref = core_algos.compute_grpo_outcome_advantage(b["token_level_rewards"], b["response_mask"], b["uid"],
                                                    1e-3, False)
    torch.testing.assert_close(adv, ref[0])


def test_compute_advantage_forwards_gigpo_options():
    b = _batch()
    adv, _ = core_algos.compute_advantage(b, "gigpo", gamma=0.9, step_advantage_w=0.0, mode="mean_std_norm")
    grpo, _ = core_algos.compute_advantage(b, "grpo")  # w = 0 and one row per trajectory: plain GRPO
    torch.testing.assert_close(adv, grpo)


def test_compute_advantage_missing_key_and_bad_kwarg():
    b = _batch()
    del b["values"]
    with pytest.raises(ValueError, match="values"):
        core_algos.compute_advantage(b, "gae")
    with pytest.raises(ValueError, match="does not take"):
        core_algos.compute_advantage(_batch(), "grpo", step_advantage_w=2.0)
    with pytest.raises(ValueError, match="known estimators"):
        core_algos.compute_advantage(_batch(), "vtrace")


def test_validate_algorithm_choices_messages_name_the_key():
    ok = dict(adv_estimator="gae", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
              policy_loss_mode="vanilla", kl_ctrl_type="fixed")
    validate_algorithm_choices(**ok)
    cases = {
        "adv_estimator": ("ppo", "algorithm.adv_estimator = 'ppo' is not one of"),
        "loss_agg_mode": ("mean", "actor_rollout_ref.actor.loss_agg_mode = 'mean' is not one of"),
        "kl_loss_type": ("full", "actor_rollout_ref.actor.kl_loss_type = 'full' is not one of"),
        "policy_loss_mode": ("cispo", "actor_rollout_ref.actor.policy_loss_mode = 'cispo' is not one of"),
        "kl_ctrl_type": ("pid", "algorithm.kl_ctrl.type = 'pid' is not one of"),
    }
    for key, (bad, message) in cases.items():
        with pytest.raises(ValueError) as err:
            validate_algorithm_choices(**{**ok, key: bad})
        assert message in str(err.value) and "set it to one of them" in str(err.value)
    with pytest.raises(ValueError, match="algorithm.bi_level_gae"):
        validate_algorithm_choices(**{**ok, "adv_estimator": "grpo"}, bi_level_gae=True)
    with pytest.raises(ValueError, match="algorithm.high_level_gamma"):
        validate_algorithm_choices(**ok, high_level_gamma=1.5)
    assert core_algos.resolve_adv_estimator("gae", bi_level_gae=True) == "bi_level_gae"
    assert core_algos.resolve_adv_estimator("grpo") == "grpo"


def test_constants_for_config_validation():
    assert core_algos.POLICY_LOSS_MODES == ("vanilla", "gspo")
    assert set(core_algos.KL_PENALTY_TYPES) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert core_algos.LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm")
    assert core_algos.REWARD_NORM_GROUPINGS == ("state", "batch", "inductive")
    assert core_algos.REWARD_NORM_METHODS == ("identity", "mean", "mean_std", "asym_clip")
    assert core_algos.ROLLOUT_FILTER_STRATEGIES == ("top_k", "top_p", "min_p")
