import math

import pytest
import torch

from agent_trainer import core_algos


def test_policy_loss_decoupled_clip_and_dual_clip_hand_computed():
    ratios = torch.tensor([[1.5, 0.5, 5.0, 1.0, 7.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0, 100.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    old = torch.zeros(1, 5)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(
        old, ratios.log(), adv, mask, cliprange=0.2, cliprange_low=0.2, cliprange_high=0.28, clip_ratio_c=3.0)
    # a: max(-1.5, -1.28) = -1.28 (clipped high)   b: max(.5, .8) = .8 (clipped low)
    # c: max(5, 1.28) = 5 -> dual clip min(5, 3) = 3   d: -2 (no clip)
    assert math.isclose(float(pg_loss), (-1.28 + 0.8 + 3.0 - 2.0) / 4, rel_tol=1e-5)
    assert math.isclose(float(clipfrac), 0.5)
    assert math.isclose(float(clipfrac_lower), 0.25)
    expected_kl = -(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 4
    assert math.isclose(float(ppo_kl), expected_kl, rel_tol=1e-5)


def test_policy_loss_gradient_flows_only_through_unclipped_tokens():
    log_prob = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, *_ = core_algos.compute_policy_loss(torch.zeros(1, 2), log_prob, torch.ones(1, 2), torch.ones(1, 2),
                                              cliprange=0.2)
    loss.backward()
    assert log_prob.grad[0, 0] == 0  # clipped at 1.2
    assert math.isclose(float(log_prob.grad[0, 1]), -1.1 / 2, rel_tol=1e-5)


def test_policy_loss_bad_arguments_raise_value_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        core_algos.compute_policy_loss(x, x, x, x + 1, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="cliprange"):
        core_algos.compute_policy_loss(x, x, x, x + 1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        core_algos.compute_policy_loss(x, x, x, x + 1, cliprange=0.2, loss_agg_mode="token-sum")


def test_gspo_sequence_ratio_and_per_token_gradient():
    log_prob = torch.tensor([[0.1, 0.3, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    fn = core_algos.get_policy_loss_fn("gspo")
    loss, clipfrac, ppo_kl, lower = fn(torch.zeros(1, 3), log_prob, torch.ones(1, 3), mask,
                                       cliprange_low=0.2, cliprange_high=0.28)
    s = math.exp(0.2)  # geometric mean of the token ratios
    assert math.isclose(float(loss.detach()), -s, rel_tol=1e-5)
    assert float(clipfrac.detach()) == 0 and float(lower.detach()) == 0
    assert math.isclose(float(ppo_kl.detach()), -0.2, rel_tol=1e-5)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))


def test_get_policy_loss_fn_unknown_mode_lists_known():
    assert core_algos.get_policy_loss_fn("vanilla") is core_algos.compute_policy_loss
    with pytest.raises(ValueError, match="vanilla.*gspo"):
        core_algos.get_policy_loss_fn("clip-cov")


def test_value_loss_hand_computed():
    vpreds = torch.tensor([[1.0, 3.5, 0.0]])
    values = torch.tensor([[0.0, 2.9, 0.0]])
    returns = torch.tensor([[0.5, 4.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(vpreds, returns, values, mask, 0.2, "token-mean")
    # tok0: clipped pred .2 -> max(.25, .09) = .25 ; tok1: clipped pred 3.1 -> max(.25, .81) = .81
    assert math.isclose(float(vf_loss), 0.5 * (0.25 + 0.81) / 2, rel_tol=1e-5)
    assert math.isclose(float(vf_clipfrac), 0.5)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 2.5), ("seq-mean-token-sum", 5.0), ("seq-mean-token-mean", 3.0),
    ("seq-mean-token-sum-norm", 1.25)])
def test_agg_loss_modes_skip_padding_rows(mode, expected):
    loss = torch.tensor([[1.0, 2, 3, float("nan")], [4, 0, 0, 0], [7, 7, 7, 7]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert math.isclose(float(core_algos.agg_loss(loss, mask, mode)), expected, rel_tol=1e-6)


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_agg_loss_all_empty_is_zero(mode):
    assert float(core_algos.agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode)) == 0.0


def test_entropy_loss_uniform_logits():
    logits = torch.zeros(2, 3, 4)
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0]])
    assert math.isclose(float(core_algos.compute_entropy_loss(logits, mask)), math.log(4), rel_tol=1e-6)


def test_kl_penalty_estimators_hand_computed():
    lp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-1.0, 0.0])
    torch.testing.assert_close(core_algos.kl_penalty(lp, ref, "kl"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(core_algos.kl_penalty(lp, ref, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(core_algos.kl_penalty(lp, ref, "abs"), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(core_algos.kl_penalty(lp, ref, "mse"), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(core_algos.kl_penalty(lp, ref, "k2"), torch.tensor([0.5, 0.5]))
    k3 = torch.tensor([math.exp(-1.0), math.exp(1.0) - 2.0])
    torch.testing.assert_close(core_algos.kl_penalty(lp, ref, "low_var_kl"), k3)
    torch.testing.assert_close(core_algos.kl_penalty(lp, ref, "k3"), k3)
    big = core_algos.kl_penalty(torch.tensor([-30.0, 30.0]), torch.tensor([0.0, 0.0]), "k3")
    assert big[0] == 10.0 and 0 < big[1] <= 10.0
    with pytest.raises(ValueError, match="low_var_kl"):
        core_algos.kl_penalty(lp, ref, "full")


def test_kl_controllers():
    fixed = core_algos.FixedKLController(0.3)
    fixed.update(5.0, 10)
    assert fixed.value == 0.3
    ctl = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.01, horizon=100)
    ctl.update(current_kl=0.02, n_steps=10)  # error clipped to .2 -> x1.02
    assert math.isclose(ctl.value, 0.102)
    ctl.update(current_kl=0.009, n_steps=10)  # error -.1 -> x0.99
    assert math.isclose(ctl.value, 0.102 * 0.99)
    assert isinstance(core_algos.get_kl_controller("adaptive", 0.1, 0.01, 100), core_algos.AdaptiveKLController)
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type"):
        core_algos.get_kl_controller("pid", 0.1)


def test_apply_kl_penalty_in_reward_ignores_padding_rows():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    ref = torch.tensor([[-1.0, 0.0, -2.0], [5.0, 5.0, 5.0]])
    ctl = core_algos.FixedKLController(0.1)
    rewards, metrics = core_algos.apply_kl_penalty(scores, old, ref, mask, ctl, "kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.0, 0.8], [0.0, 0.0, 0.0]]))
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(1.0), "actor/reward_kl_penalty_coeff": 0.1}
