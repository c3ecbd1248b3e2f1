import math

import numpy as np
import pytest
import torch

from agent_trainer import core_algos
from core_algos_refs import group_norm_ref


def _rows(scores, mask_rows=None, T=4):
    """One reward per row on its last generated token; mask = tokens 1..2 unless given."""
    b = len(scores)
    mask = torch.zeros(b, T)
    mask[:, 1:3] = 1
    if mask_rows is not None:
        for i, m in mask_rows.items():
            mask[i] = torch.tensor(m, dtype=torch.float32)
    rewards = torch.zeros(b, T)
    for i, s in enumerate(scores):
        gen = mask[i].nonzero()
        if len(gen):
            rewards[i, gen[-1]] = s
    return rewards, mask


def test_grpo_hand_computed_groups_singleton_and_equal():
    rewards, mask = _rows([1.0, 2.0, 3.0, 5.0, 4.0, 4.0])
    index = torch.tensor([0, 0, 0, 1, 2, 2])
    adv, ret = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    # group 0: mean 2, std 1 -> -1, 0, 1 ; group 1 (one row): mean 0, std 1 -> 5 ; group 2 equal -> 0
    expected = torch.tensor([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 5 / (1 + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(adv[:, 1], expected)
    torch.testing.assert_close(adv, expected.unsqueeze(-1) * mask)
    assert adv is ret or torch.equal(adv, ret)
    dr, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(dr[:, 1], torch.tensor([-1.0, 0.0, 1.0, 5.0, 0.0, 0.0]))


def test_grpo_matches_loop_reference():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(12, 5, generator=g)
    mask = (torch.rand(12, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    index = torch.randint(0, 4, (12,), generator=g)
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-6)
    scores = (rewards * mask).sum(-1)
    expected = torch.tensor(group_norm_ref(scores, index, 1e-6, True))
    torch.testing.assert_close(adv, expected.float().unsqueeze(-1) * mask, atol=1e-5, rtol=1e-5)


def test_grpo_padding_row_gets_zero_and_does_not_count():
    rewards, mask = _rows([1.0, 3.0, 0.0], mask_rows={2: [0, 0, 0, 0]})
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, torch.tensor([0, 0, 0]))
    s = 1 / (math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv[:, 2], torch.tensor([-s, s, 0.0]))
    assert not adv.isnan().any()


def test_grpo_rejects_float_and_misshaped_ids():
    rewards, mask = _rows([1.0, 2.0])
    for bad in (torch.tensor([0.0, 1.0]), [0.5, 1.5], np.array([0.0, 1.0]), ["a"], "ab", [["a"], ["b"]]):
        with pytest.raises(ValueError, match="index"):
            core_algos.compute_grpo_outcome_advantage(rewards, mask, bad)


def test_rloo_hand_computed():
    rewards, mask = _rows([1.0, 2.0, 6.0, 5.0, 0.0], mask_rows={4: [0, 0, 0, 0]})
    adv, ret = core_algos.compute_rloo_outcome_advantage(rewards, mask, torch.tensor([0, 0, 0, 1, 0]))
    # group 0 (padding row 4 excluded): 1 - (2+6)/2 = -3 ; 2 - 3.5 = -1.5 ; 6 - 1.5 = 4.5 ; group 1 alone: 5
    torch.testing.assert_close(adv[:, 1], torch.tensor([-3.0, -1.5, 4.5, 5.0, 0.0]))
    torch.testing.assert_close(adv, ret)


def test_reinforce_plus_plus_discounted_returns_skip_observations():
    mask = torch.tensor([[1.0, 1, 0, 1], [1, 0, 0, 0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0], [3.0, 0, 0, 0]])
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0: G3 = 2, G1 = 1 + .5*2 = 2, G0 = .5*2 = 1 ; row 1: G0 = 3
    torch.testing.assert_close(ret, torch.tensor([[1.0, 2.0, 0.0, 2.0], [3.0, 0, 0, 0]]))
    g = torch.tensor([1.0, 2.0, 2.0, 3.0])
    torch.testing.assert_close(adv[mask.bool()], (g - g.mean()) / torch.sqrt(g.var() + 1e-8))


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards, mask = _rows([1.0, 3.0, 4.0])
    adv, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, torch.tensor([0, 0, 1]))
    # centred: -1, 1, 4 (group of one keeps its score); each on 2 tokens; whiten over the 6 tokens
    x = torch.tensor([-1.0, -1, 1, 1, 4, 4])
    torch.testing.assert_close(adv[mask.bool()], (x - x.mean()) / torch.sqrt(x.var() + 1e-8))


def test_remax_hand_computed():
    mask = torch.tensor([[1.0, 1, 0, 1]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    adv, ret = core_algos.compute_remax_outcome_advantage(rewards, torch.tensor([1.5]), mask)
    torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 0.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.5, 0.0, 0.5]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        core_algos.compute_remax_outcome_advantage(rewards, torch.tensor([1.0, 2.0]), mask)


def test_grpo_multiturn_trajectories_weigh_equally():
    # question 0: trajectory 10 has three turn rows (reward 1 on its last turn), trajectory 11 one row (reward 0)
    # question 1: trajectory 20 alone (two rows, rewards .5 + 1.5); row 6 is a padding row of trajectory 11
    T = 6
    mask = torch.zeros(7, T)
    mask[:, 3:5] = 1  # tokens 0-2: condensed context (not trained), 3-4: output, 5: padding
    mask[6] = 0
    rewards = torch.zeros(7, T)
    rewards[2, 4], rewards[4, 4], rewards[5, 4] = 1.0, 0.5, 1.5
    index = torch.tensor([0, 0, 0, 0, 1, 1, 0])
    traj = torch.tensor([10, 10, 10, 11, 20, 20, 11])
    adv, ret = core_algos.compute_grpo_multiturn_advantage(rewards, mask, index, traj)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # scores 1 and 0: mean .5, std sqrt(.5)
    expected_row = torch.tensor([a, a, a, -a, 2.0 / (1 + 1e-6), 2.0 / (1 + 1e-6), 0.0])
    torch.testing.assert_close(adv, expected_row.unsqueeze(-1) * mask)
    assert (adv[:, :3] == 0).all()  # context tokens masked
    torch.testing.assert_close(adv, ret)
    with pytest.raises(ValueError, match="traj_index"):
        core_algos.compute_grpo_multiturn_advantage(rewards, mask, index, torch.tensor([10, 10, 10, 11, 10, 20, 11]))


def test_gigpo_per_step_rows_and_per_episode_rows_agree():
    # one group, two trajectories of two steps; anchors: traj0 = (10, 11), traj1 = (10, 12); gamma .5
    # step returns: traj0 (.5, 1), traj1 (0, 0); episode scores 1, 0 -> mean_norm A^E = .5, -.5
    # step group anchor 10: (.5, 0) -> (.25, -.25); anchors 11 and 12 are alone -> 0
    expected = torch.tensor([0.75, 0.5, -0.75, -0.5])
    mask = torch.tensor([[0.0, 1, 1, 0]] * 4)
    rewards = torch.zeros(4, 4)
    rewards[1, 2] = 1.0
    adv, ret = core_algos.compute_gigpo_outcome_advantage(
        rewards, None, mask, torch.tensor([10, 11, 10, 12]), torch.tensor([0, 0, 0, 0]),
        torch.tensor([0, 0, 1, 1]), gamma=0.5)
    torch.testing.assert_close(adv, expected.unsqueeze(-1) * mask)
    torch.testing.assert_close(adv, ret)
    # same episodes as one row each: prompt, turn 1, observation, turn 2
    mask2 = torch.tensor([[0.0, 1, 1, 0, 1, 1]] * 2)
    rewards2 = torch.zeros(2, 6)
    rewards2[0, 5] = 1.0
    anchors = torch.tensor([[0, 10, 10, 0, 11, 11], [0, 10, 10, 0, 12, 12]])
    adv2, _ = core_algos.compute_gigpo_outcome_advantage(rewards2, None, mask2, anchors, torch.tensor([0, 0]),
                                                         None, gamma=0.5)
    torch.testing.assert_close(adv2[:, [1, 4]], expected.view(2, 2))
    torch.testing.assert_close(adv2[:, [2, 5]], expected.view(2, 2))
    assert (adv2[mask2 == 0] == 0).all()


def test_gigpo_mean_std_norm_and_step_weight():
    mask = torch.ones(4, 2)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 0.0], [0.0, 0.0]])
    step_returns = torch.tensor([1.0, 3.0, 5.0, 5.0])
    anchors = torch.tensor([1, 1, 2, 2])
    adv, _ = core_algos.compute_gigpo_outcome_advantage(
        rewards, step_returns, mask, anchors, torch.tensor([0, 0, 0, 0]), torch.tensor([0, 1, 2, 3]),
        step_advantage_w=0.5, mode="mean_std_norm")
    ep = torch.tensor(group_norm_ref([1.0, 3.0, 0.0, 0.0], [0, 0, 0, 0], 1e-6, True))
    step = torch.tensor([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(adv[:, 0], (ep + 0.5 * step).float())
    with pytest.raises(ValueError, match="mode"):
        core_algos.compute_gigpo_outcome_advantage(rewards, None, mask, anchors, torch.zeros(4, dtype=torch.long),
                                                   torch.arange(4), mode="std")
    with pytest.raises(ValueError, match="traj_index"):
        core_algos.compute_gigpo_outcome_advantage(rewards, None, mask, anchors, torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("value", [0.3, 0.1, -7.7, 1e-3])
def test_grpo_all_equal_rewards_give_zero_not_rounding_noise(value):
    rewards, mask = _rows([value] * 5)
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, torch.zeros(5, dtype=torch.long))
    assert adv.abs().max() < 1e-8
