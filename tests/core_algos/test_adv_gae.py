import math

import pytest
import torch

from agent_trainer import core_algos
from core_algos_refs import gae_ref, whiten_ref


def test_gae_hand_computed_with_observation_gap():
    # tokens: gen, gen, observation (value is garbage, must be skipped), gen
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 0.7]])
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # t3: delta = 2 - .7 = 1.3                     A3 = 1.3
    # t1: delta = 1 + .9*.7 - .6 = 1.03            A1 = 1.03 + .72*1.3 = 1.966
    # t0: delta = 0 + .9*.6 - .5 = .04             A0 = .04 + .72*1.966 = 1.45552
    raw = torch.tensor([1.45552, 1.966, 1.3])
    torch.testing.assert_close(ret, torch.tensor([[1.95552, 2.566, 0.0, 2.0]]))
    whitened = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)
    torch.testing.assert_close(adv[0, [0, 1, 3]], whitened, atol=1e-5, rtol=1e-5)
    assert adv[0, 2] == 0


def test_gae_observation_tokens_do_not_change_result():
    mask_gap = torch.tensor([[0.0, 1, 1, 0, 0, 1, 1, 0]])
    mask_flat = torch.tensor([[0.0, 1, 1, 1, 1, 0, 0, 0]])
    r_gap = torch.tensor([[0.0, 0, 1, 0, 0, 0, 3, 0]])
    r_flat = torch.tensor([[0.0, 0, 1, 0, 3, 0, 0, 0]])
    v_gap = torch.tensor([[0.0, 0.1, 0.2, 5, 5, 0.3, 0.4, 0]])
    v_flat = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 0, 0, 0]])
    a1, r1 = core_algos.compute_gae_advantage_return(r_gap, v_gap, mask_gap, 0.95, 0.9)
    a2, r2 = core_algos.compute_gae_advantage_return(r_flat, v_flat, mask_flat, 0.95, 0.9)
    torch.testing.assert_close(a1[mask_gap.bool()], a2[mask_flat.bool()])
    torch.testing.assert_close(r1[mask_gap.bool()], r2[mask_flat.bool()])


def test_gae_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 15, generator=g) > 0.35).float()
    mask[2] = 0  # padding row
    rewards = torch.randn(6, 15, generator=g) * mask
    values = torch.randn(6, 15, generator=g)
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, mask, 0.97, 0.93)
    raw_ref, ret_ref = gae_ref(rewards, values, mask, 0.97, 0.93)
    torch.testing.assert_close(ret.double(), ret_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv.double(), whiten_ref(raw_ref, mask), atol=1e-4, rtol=1e-4)


def test_gae_padding_rows_and_single_token_no_nan():
    mask = torch.zeros(3, 5)
    nan_values = torch.full((3, 5), float("nan"))  # values outside the mask must never be read
    adv, ret = core_algos.compute_gae_advantage_return(torch.zeros(3, 5), nan_values, mask, 1.0, 1.0)
    assert not adv.isnan().any() and not ret.isnan().any()
    assert (adv == 0).all() and (ret == 0).all()
    mask[1, 2] = 1
    rewards = torch.zeros(3, 5)
    rewards[1, 2] = 4.0
    adv, ret = core_algos.compute_gae_advantage_return(rewards, torch.ones(3, 5), mask, 1.0, 1.0)
    assert torch.isfinite(adv).all() and adv[1, 2] == 0  # one token: x - mean = 0
    assert ret[1, 2] == 4.0


def test_gae_shape_mismatch_raises_value_error():
    with pytest.raises(ValueError, match="same"):
        core_algos.compute_gae_advantage_return(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


def test_masked_whiten_zero_variance_and_empty():
    x = torch.full((2, 3), 0.3)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    out = core_algos.masked_whiten(x, mask)
    assert out.abs().max() < 1e-6
    assert (core_algos.masked_whiten(x, torch.zeros(2, 3)) == 0).all()
    assert math.isclose(float(core_algos.masked_mean(torch.tensor([1.0, float("inf")]), torch.tensor([1, 0]))), 1.0)
