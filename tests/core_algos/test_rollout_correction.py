"""Truncated IS between the rollout engine and the trainer: hand computations, a loop reference, the loss."""

import math

import pytest
import torch

from agent_trainer import core_algos


def _is_weights_ref(old, rollout, mask, level, threshold):
    """Plain loops: (weights [B][T], raw weights over the counted units)."""
    B, T = old.shape
    weights = [[1.0] * T for _ in range(B)]
    raws = []
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t]]
        if level == "token":
            for t in pos:
                raw = math.exp(max(-20.0, min(20.0, float(old[b, t]) - float(rollout[b, t]))))
                raws.append(raw)
                weights[b][t] = min(raw, threshold)
        elif pos:
            log_ratio = sum(float(old[b, t]) - float(rollout[b, t]) for t in pos)
            raw = math.exp(max(-20.0, min(20.0, log_ratio)))
            raws.append(raw)
            weights[b] = [min(raw, threshold)] * T
    return torch.tensor(weights), raws


def test_token_level_weights_by_hand():
    old = torch.tensor([[0.0, math.log(0.5), math.log(0.9), math.log(0.2)]])
    rollout = torch.tensor([[0.0, math.log(0.25), math.log(0.9), math.log(0.8)]])
    mask = torch.tensor([[0, 1, 1, 1]])
    weights, metrics = core_algos.compute_rollout_is_weights(old, rollout, mask, "token", 1.5)
    # ratios 2.0 (capped at 1.5), 1.0, 0.25; the prompt token keeps weight 1
    assert torch.allclose(weights, torch.tensor([[1.0, 1.5, 1.0, 0.25]]), atol=1e-6)
    assert math.isclose(float(metrics["rollout_is_mean"]), (1.5 + 1.0 + 0.25) / 3, rel_tol=1e-6)
    assert math.isclose(float(metrics["rollout_is_max"]), 2.0, rel_tol=1e-6)
    assert math.isclose(float(metrics["rollout_is_truncated_frac"]), 1 / 3, rel_tol=1e-6)


def test_sequence_level_weight_is_the_product_of_token_ratios_by_hand():
    old = torch.tensor([[0.0, math.log(0.5), math.log(0.6)], [0.0, math.log(0.9), 0.0]])
    rollout = torch.tensor([[0.0, math.log(0.25), math.log(0.3)], [0.0, math.log(0.9), 5.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    weights, metrics = core_algos.compute_rollout_is_weights(old, rollout, mask, "sequence", 3.0)
    # row 0: 2 * 2 = 4 -> capped at 3; row 1: 1 (its unmasked last column, 5.0 off, is ignored)
    assert torch.allclose(weights, torch.tensor([[3.0, 3.0, 3.0], [1.0, 1.0, 1.0]]), atol=1e-6)
    assert math.isclose(float(metrics["rollout_is_max"]), 4.0, rel_tol=1e-6)
    assert math.isclose(float(metrics["rollout_is_truncated_frac"]), 0.5)


@pytest.mark.parametrize("level", core_algos.ROLLOUT_IS_LEVELS)
def test_weights_match_the_loop_reference(level):
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 9, generator=gen) * 3
    rollout = old + torch.randn(5, 9, generator=gen) * 0.4
    mask = (torch.rand(5, 9, generator=gen) > 0.3).long()
    mask[4] = 0  # an empty (padding) row
    weights, metrics = core_algos.compute_rollout_is_weights(old, rollout, mask, level, 1.3)
    expected, raws = _is_weights_ref(old, rollout, mask, level, 1.3)
    assert torch.allclose(weights, expected, atol=1e-5)
    assert math.isclose(float(metrics["rollout_is_max"]), max(raws), rel_tol=1e-5)
    assert math.isclose(float(metrics["rollout_is_truncated_frac"]), sum(r > 1.3 for r in raws) / len(raws),
                        rel_tol=1e-6)
    assert not weights.requires_grad


def test_extreme_mismatch_stays_finite_and_empty_mask_gives_zeros():
    old, rollout, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -100.0]]), torch.tensor([[0, 1]])
    weights, metrics = core_algos.compute_rollout_is_weights(old, rollout, mask, "token", 2.0)
    assert float(weights[0, 1]) == 2.0 and math.isclose(float(metrics["rollout_is_max"]), math.exp(20), rel_tol=1e-5)
    _, empty = core_algos.compute_rollout_is_weights(old, rollout, torch.zeros(1, 2), "sequence", 2.0)
    assert all(float(v) == 0.0 for v in empty.values())


def test_bad_arguments_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="rollout_is"):
        core_algos.compute_rollout_is_weights(x, x, x, "batch", 2.0)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        core_algos.compute_rollout_is_weights(x, x, x, "token", 0.0)


def test_weights_multiply_each_token_loss_before_aggregation():
    """vanilla: loss(weights) == agg(w * L) by hand, with finite gradients and no gradient into w."""
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(2, 5, generator=gen)
    log_prob = (old + 0.05 * torch.randn(2, 5, generator=gen)).requires_grad_()
    adv = torch.randn(2, 5, generator=gen)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    w = torch.tensor([[1.0, 0.5, 2.0, 1.0, 1.0], [1.0, 1.0, 0.25, 1.5, 1.0]])
    kwargs = dict(cliprange_low=0.2, cliprange_high=0.28, loss_agg_mode="token-mean")
    weighted, *_ = core_algos.compute_policy_loss(old, log_prob, adv, mask, rollout_is_weights=w, **kwargs)
    # the unweighted per-token losses, recovered one token at a time from a one-hot mask
    per_token = torch.zeros(2, 5)
    for b, t in mask.nonzero().tolist():
        one = torch.zeros_like(mask)
        one[b, t] = 1
        per_token[b, t] = core_algos.compute_policy_loss(old, log_prob.detach(), adv, one, **kwargs)[0]
    expected = (per_token * w * mask).sum() / mask.sum()
    assert torch.isclose(weighted, expected, atol=1e-6)
    weighted.backward()
    assert torch.isfinite(log_prob.grad).all()


def test_gspo_takes_the_weights_too():
    """gspo: a constant weight c scales the loss by c (its sequence ratio couples a row's tokens)."""
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(2, 5, generator=gen)
    log_prob = old + 1e-4 * torch.randn(2, 5, generator=gen)
    adv, mask = torch.randn(2, 5, generator=gen), torch.ones(2, 5)
    plain, *_ = core_algos.compute_policy_loss_gspo(old, log_prob, adv, mask, cliprange=3e-4)
    scaled, *_ = core_algos.compute_policy_loss_gspo(old, log_prob, adv, mask, cliprange=3e-4,
                                                      rollout_is_weights=torch.full((2, 5), 0.5))
    assert torch.isclose(scaled, 0.5 * plain, atol=1e-7)


def test_mismatch_kl_is_the_k3_estimate_over_the_generated_tokens():
    """rollout/mismatch_kl: a plain loop over the masked tokens against the vectorised estimate."""
    torch.manual_seed(0)
    old, rollout = torch.randn(3, 5) - 1, torch.randn(3, 5) - 1
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    values = [math.exp(float(old[i, t] - rollout[i, t])) - 1 - float(old[i, t] - rollout[i, t])
              for i in range(3) for t in range(5) if mask[i, t]]
    assert float(core_algos.mismatch_kl(old, rollout, mask)) == pytest.approx(sum(values) / len(values), rel=1e-5)
    assert float(core_algos.mismatch_kl(old, old, mask)) == 0.0  # the same policy: no mismatch
    assert float(core_algos.mismatch_kl(old, rollout, torch.zeros_like(mask))) == 0.0


def test_icepop_mask_keeps_only_tokens_whose_ratio_is_in_the_band_by_hand():
    """rollout_rs=token: ratio pi_old / pi_rollout outside [lower, upper] -> 0, inside -> 1, outside the mask -> 1."""
    ratios = torch.tensor([[1.0, 0.4, 0.5, 5.0, 6.0, 100.0]])
    old = torch.log(ratios)
    rollout = torch.zeros_like(old)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    keep, metrics = core_algos.compute_rollout_rs_mask(old, rollout, mask, lower=0.5, upper=5.0)
    assert keep.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0, 1.0]]  # the bounds are kept; the unmasked 100 is not judged
    assert float(metrics["rollout_rs_masked_frac"]) == pytest.approx(2 / 5)
    assert not keep.requires_grad
    with pytest.raises(ValueError, match="0 < lower <= 1 <= upper"):
        core_algos.compute_rollout_rs_mask(old, rollout, mask, lower=1.5, upper=5.0)


def test_a_masked_token_gives_no_gradient_and_the_others_keep_theirs():
    torch.manual_seed(0)
    old = torch.randn(2, 5)
    rollout = old.clone()
    rollout[0, 2] -= 3.0  # ratio e^3 > 5: masked
    mask = torch.ones(2, 5)
    keep, _ = core_algos.compute_rollout_rs_mask(old, rollout, mask)
    log_prob = old.clone().requires_grad_(True)
    advantages = torch.randn(2, 5)
    loss, *_ = core_algos.compute_policy_loss(old, log_prob, advantages, mask, cliprange=0.2, rollout_is_weights=keep)
    loss.backward()
    assert log_prob.grad[0, 2] == 0 and bool((log_prob.grad.flatten()[torch.arange(10) != 2] != 0).all())
