"""On-policy distillation's signal (``core_algos.distill``): the per-token reverse KL on the sampled token, computed
by hand on a few tokens, as the advantage (mode advantage) or added to the token rewards (mode reward)."""

from __future__ import annotations

import math

import pytest
import torch

from agent_trainer import core_algos

# Two rows of 5 positions: row 0 generated positions 2-3 (an observation at 4), row 1 generated 1-4.
MASK = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
STUDENT = torch.tensor([[0.0, 0.0, -1.0, -0.5, 0.0], [0.0, -2.0, -0.1, -3.0, -0.7]])
TEACHER = torch.tensor([[9.0, 9.0, -0.25, -2.5, 9.0], [9.0, -1.0, -0.1, -1.0, -0.2]])  # 9: never read (no mask)
# log p_teacher - log p_student on the generated tokens, by hand:
BY_HAND = [[0.0, 0.0, 0.75, -2.0, 0.0], [0.0, 1.0, 0.0, 2.0, 0.5]]


def tensors(rewards=None):
    return {"response_mask": MASK.clone(), "teacher_log_prob": TEACHER.clone(),
            "token_level_rewards": torch.zeros_like(MASK) if rewards is None else rewards}


def test_the_advantage_is_the_teacher_minus_the_student_on_generated_tokens_only():
    advantages, metrics = core_algos.apply_distillation(tensors(), STUDENT, "advantage", coef=1.0)
    assert advantages.tolist() == BY_HAND
    # reverse KL = log p_student - log p_teacher = -(the signal), mean over the 6 generated tokens
    assert metrics["distill/reverse_kl"] == pytest.approx(-(0.75 - 2.0 + 1.0 + 0.0 + 2.0 + 0.5) / 6)
    assert metrics["distill/reverse_kl_seq_mean"] == pytest.approx(-((0.75 - 2.0) + (1.0 + 2.0 + 0.5)) / 2)
    assert metrics["distill/teacher_log_prob"] == pytest.approx((-0.25 - 2.5 - 1.0 - 0.1 - 1.0 - 0.2) / 6)
    assert metrics["distill/student_log_prob"] == pytest.approx((-1.0 - 0.5 - 2.0 - 0.1 - 3.0 - 0.7) / 6)
    assert metrics["distill/signal_abs_mean"] == pytest.approx((0.75 + 2.0 + 1.0 + 0 + 2.0 + 0.5) / 6)


def test_the_coefficient_scales_the_signal_and_the_rewards_keep_theirs_in_advantage_mode():
    batch = tensors(torch.tensor([[0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0.0]]))
    advantages, _ = core_algos.apply_distillation(batch, STUDENT, "advantage", coef=0.5)
    assert advantages.tolist() == [[0.5 * v for v in row] for row in BY_HAND]
    assert batch["token_level_rewards"].tolist() == [[0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0.0]]


def test_reward_mode_adds_the_weighted_signal_to_the_token_rewards_and_leaves_the_advantage_to_the_estimator():
    task = torch.tensor([[0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0.0]])
    batch = tensors(task.clone())
    advantages, metrics = core_algos.apply_distillation(batch, STUDENT, "reward", coef=2.0)
    assert advantages is None and math.isfinite(metrics["distill/reverse_kl"])
    expected = task + 2.0 * torch.tensor(BY_HAND)
    assert torch.equal(batch["token_level_rewards"], expected)
    # GRPO then sees each episode's summed reward: task + 2 * the row's summed signal
    adv, _ = core_algos.compute_advantage(
        {**batch, "uid": torch.tensor([0, 0]), "traj_uid": torch.tensor([0, 1])}, "grpo",
        norm_adv_by_std_in_grpo=False)
    scores = [1.0 + 2 * (0.75 - 2.0), 2 * (1.0 + 2.0 + 0.5)]
    mean = sum(scores) / 2
    assert adv[0, 2].item() == pytest.approx(scores[0] - mean) and adv[1, 1].item() == pytest.approx(scores[1] - mean)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="algorithm.distill.mode"):
        core_algos.apply_distillation(tensors(), STUDENT, "forward", coef=1.0)
