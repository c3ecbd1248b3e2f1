import pytest
import torch

from agent_trainer import core_algos
from core_algos_refs import bi_level_ref, whiten_ref

BL = core_algos.compute_bi_level_gae_advantage_return


def test_bi_level_two_turns_with_observation_hand_computed():
    # prompt, turn 1, observation, turn 2, padding
    mask = torch.tensor([[0.0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]])
    rewards = torch.zeros(1, 12)
    rewards[0, 5], rewards[0, 9] = 1.0, 2.0
    values = torch.arange(12.0).unsqueeze(0) / 10
    adv, ret = BL(rewards, values, mask, gamma=0.9, lam=0.8, high_level_gamma=0.95)
    # turn level: V1 = .5, V2 = .9
    #   A2 = 2 - .9 = 1.1, R2 = 2
    #   A1 = (1 + .95*.9 - .5) + .95*.8*1.1 = 1.355 + .836 = 2.191, R1 = 2.691
    # token level, turn 2: t9: 2 - .9 = 1.1 ; t8: (.9*.9 - .8) + .72*1.1 = .802
    # token level, turn 1: t5: 2.691 - .5 = 2.191 ; t4: (.9*.5 - .4) + .72*2.191 = 1.62752
    #                      t3: (.9*.4 - .3) + .72*1.62752 = 1.2318144
    raw = torch.tensor([1.2318144, 1.62752, 2.191, 0.802, 1.1])
    expected_ret = torch.zeros(1, 12)
    expected_ret[0, [3, 4, 5, 8, 9]] = raw + torch.tensor([0.3, 0.4, 0.5, 0.8, 0.9])
    torch.testing.assert_close(ret, expected_ret)
    torch.testing.assert_close(adv[0, [3, 4, 5, 8, 9]], (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8),
                               atol=1e-5, rtol=1e-5)
    assert (adv[mask == 0] == 0).all()


def test_bi_level_zero_reward_middle_turn_is_still_a_turn():
    mask = torch.tensor([[1.0, 0, 1, 0, 1]])
    rewards = torch.tensor([[1.0, 0, 0, 0, 2.0]])
    values = torch.tensor([[0.5, 7.0, 0.4, 7.0, 0.3]])
    _, ret = BL(rewards, values, mask, 0.9, 0.8, 0.95)
    # A3 = 2 - .3 = 1.7, R3 = 2 ; A2 = (0 + .95*.3 - .4) + .76*1.7 = 1.177, R2 = 1.577
    # A1 = (1 + .95*.4 - .5) + .76*1.177 = 1.77452, R1 = 2.27452 (one-token turns: token return = R_i)
    torch.testing.assert_close(ret, torch.tensor([[2.27452, 0.0, 1.577, 0.0, 2.0]]))


def test_bi_level_all_zero_rewards_is_valid():
    mask = torch.tensor([[1.0, 1, 0, 1, 1]])
    values = torch.tensor([[0.1, 0.2, 3.0, 0.3, 0.4]])
    adv, ret = BL(torch.zeros(1, 5), values, mask, 1.0, 1.0, 1.0)
    # gamma = lam = 1: every return is the sum of future rewards = 0; raw A_t = -V_t
    assert (ret == 0).all()
    raw = -torch.tensor([0.1, 0.2, 0.3, 0.4])
    torch.testing.assert_close(adv[0, [0, 1, 3, 4]], (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8))


@pytest.mark.parametrize("high_level_gamma", [1.0, 0.5])
def test_bi_level_single_turn_equals_plain_gae(high_level_gamma):
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(5, 10)
    mask[0, 2:7] = 1
    mask[1, 0:10] = 1
    mask[2, 4:5] = 1
    mask[3, 1:9] = 1  # row 4 stays a padding row
    rewards = torch.randn(5, 10, generator=g) * mask  # rewards spread inside the turn too
    values = torch.randn(5, 10, generator=g)
    a1, r1 = BL(rewards, values, mask, 0.97, 0.9, high_level_gamma)
    a2, r2 = core_algos.compute_gae_advantage_return(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(a1, a2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r1, r2, atol=1e-5, rtol=1e-5)


def test_bi_level_matches_loop_reference_on_random_multi_turn_rows():
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(8, 20, generator=g) > 0.4).float()
    mask[3] = 0
    rewards = torch.randn(8, 20, generator=g) * mask * (torch.rand(8, 20, generator=g) > 0.6)
    values = torch.randn(8, 20, generator=g)
    adv, ret = BL(rewards, values, mask, 0.95, 0.9, 0.8)
    raw, ret_ref = bi_level_ref(rewards, values, mask, 0.95, 0.9, 0.8)
    torch.testing.assert_close(ret.double(), ret_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv.double(), whiten_ref(raw, mask), atol=1e-4, rtol=1e-4)


def test_bi_level_explicit_turn_ids_split_touching_turns():
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    turn_ids = torch.tensor([[0, 0, 1, 1, 1]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]])
    _, ret = BL(rewards, values, mask, 0.9, 0.8, 0.7, turn_ids=turn_ids)
    _, ret_ref = bi_level_ref(rewards, values, mask, 0.9, 0.8, 0.7, turn_ids=turn_ids)
    torch.testing.assert_close(ret.double(), ret_ref)
    # same data with an observation token between the turns (no turn_ids) gives the same numbers
    mask_gap = torch.tensor([[1.0, 1, 0, 1, 1]])
    _, ret_gap = BL(torch.tensor([[0.0, 1, 0, 0, 2]]), torch.tensor([[0.1, 0.2, 9, 0.3, 0.4]]),
                    mask_gap, 0.9, 0.8, 0.7)
    torch.testing.assert_close(ret_gap[0, [0, 1, 3, 4]], ret[0, :4])
    # without turn_ids the four tokens would be one turn: different result
    _, ret_one = BL(rewards, values, mask, 0.9, 0.8, 0.7)
    assert not torch.allclose(ret_one, ret)


def test_bi_level_padding_rows_no_nan():
    adv, ret = BL(torch.zeros(2, 4), torch.full((2, 4), float("nan")), torch.zeros(2, 4), 1.0, 1.0, 1.0)
    assert (adv == 0).all() and (ret == 0).all()


def test_turn_segments():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]])
    assert core_algos.turn_segments(mask).tolist() == [[0, 0, 0, 1, 1, 1, 0, 0, 2, 2, 0, 0]]
    ids = torch.tensor([[0, 0, 0, 5, 5, 6, 6, 6, 6, 6, 0, 0]])
    assert core_algos.turn_segments(mask, ids).tolist() == [[0, 0, 0, 1, 1, 2, 0, 0, 2, 2, 0, 0]]
    with pytest.raises(ValueError, match="turn_ids"):
        core_algos.turn_segments(mask, ids[:, :5])
