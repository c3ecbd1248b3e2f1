"""Rollout shaping glue: group filtering and reward normalisation on real and hand-built batches."""

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.common.batch import TensorBatch
from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.episode.rollout_shaping import (
    attach_reward_baselines,
    episode_scores,
    filter_rollout,
    normalize_episode_rewards,
    shape_rollout,
)
from agent_trainer.training.trainer import pad_for_update

# One row per episode, two turns each: prompt (2), reply 1 (2), observation (1), reply 2 (2), padding (1).
MASK = [0, 0, 1, 1, 0, 1, 1, 0]
TURN1_LAST, TURN2_LAST = 3, 6
TURN_REWARDS = [(0.0, 1.0), (0.0, 0.0), (0.5, 0.0), (0.25, 0.25), (0.0, 1.0), (-0.1, 0.0)]
"""Episode totals 1, 0 | 0.5, 0.5 | 1, -0.1: in-group stds 0.71, 0, 0.78."""


def _full_batch(tag_ids=None) -> TensorBatch:
    n = len(TURN_REWARDS)
    rewards = torch.zeros(n, len(MASK))
    for row, (r1, r2) in enumerate(TURN_REWARDS):
        rewards[row, TURN1_LAST], rewards[row, TURN2_LAST] = r1, r2
    tensors = {
        "input_ids": torch.arange(n * len(MASK)).reshape(n, len(MASK)),
        "response_mask": torch.tensor([MASK] * n),
        "token_level_rewards": rewards,
        "uid": torch.tensor([0, 0, 1, 1, 2, 2]),
        "traj_uid": torch.arange(n),
    }
    if tag_ids is not None:
        tensors["tag_ids"] = torch.tensor(tag_ids)
    return TensorBatch(tensors)


@pytest.fixture()
def condensed_batch(tokenizer, play_mixed):
    ctx_mgr = CondensedContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    return ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)]), played


def _totals(batch: TensorBatch) -> torch.Tensor:
    return episode_scores(batch).scores


def test_identity_keeps_rewards_bit_for_bit_and_reports_scores():
    batch = _full_batch()
    before = batch["token_level_rewards"].clone()
    metrics = normalize_episode_rewards(batch, "state", "identity")
    assert torch.equal(batch["token_level_rewards"], before)
    expected = sum(a + b for a, b in TURN_REWARDS) / len(TURN_REWARDS)
    assert metrics["rollout/score_raw_mean"] == pytest.approx(expected)
    assert metrics["rollout/score_normalized_mean"] == pytest.approx(expected)


def test_normalised_score_replaces_the_episode_total_on_its_last_generated_token():
    batch = _full_batch()
    before = batch["token_level_rewards"].clone()
    raw = _totals(batch)
    metrics = normalize_episode_rewards(batch, "state", "mean_std")
    expected = core_algos.normalize_scores(raw, batch["uid"], torch.zeros(6, dtype=torch.long), "state", "mean_std")
    assert torch.allclose(_totals(batch), expected, atol=1e-6)
    changed = (batch["token_level_rewards"] != before).nonzero().tolist()
    assert all(col == TURN2_LAST for _, col in changed)  # only the episode's last generated token moves
    assert torch.equal(batch["token_level_rewards"][:, TURN1_LAST], before[:, TURN1_LAST])  # per-turn shaping stays
    assert metrics["rollout/score_normalized_mean"] == pytest.approx(float(expected.mean()))
    assert _totals(batch)[2:4].abs().max() == 0  # a constant group normalises to 0


def test_inductive_grouping_normalises_per_env_tag():
    batch = _full_batch(tag_ids=[0, 0, 0, 1, 1, 1])
    normalize_episode_rewards(batch, "inductive", "mean")
    totals = _totals(batch)
    assert totals[:3].sum() == pytest.approx(0.0, abs=1e-6) and totals[3:].sum() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="tag_ids"):
        normalize_episode_rewards(_full_batch(), "inductive", "mean")


def test_condensed_episode_gets_the_difference_on_its_last_rows_last_token(condensed_batch):
    batch, played = condensed_batch
    before = batch["token_level_rewards"].clone()
    raw = _totals(batch)
    normalize_episode_rewards(batch, "batch", "mean_std")
    ids = batch["traj_uid"]
    expected = core_algos.normalize_scores(raw, torch.zeros_like(raw, dtype=torch.long),
                                           torch.zeros_like(raw, dtype=torch.long), "batch", "mean_std")
    assert torch.allclose(_totals(batch), expected, atol=1e-5)
    for env_id, replies in played.generated.items():
        rows = (ids == env_id).nonzero().flatten().tolist()
        assert len(rows) == len(replies) > 0
        last_col = len(played.prompts[env_id][-1]) + len(replies[-1]) - 1
        changed = (batch["token_level_rewards"][rows] != before[rows]).nonzero().tolist()
        assert changed == [[len(rows) - 1, last_col]]  # the last turn's row, its last generated token


def test_filter_keeps_whole_groups_with_the_most_reward_spread():
    batch = _full_batch()
    kept, metrics = filter_rollout(batch, "top_k", 1 / 3)
    assert kept["traj_uid"].tolist() == [4, 5]  # group 2 has the largest std
    assert metrics["rollout/filter_kept_ratio"] == pytest.approx(1 / 3)
    assert metrics["rollout/filter_kept_episodes"] == 2
    everything, metrics = filter_rollout(batch, "top_k", 1.0)
    assert everything is batch and metrics["rollout/filter_kept_ratio"] == 1.0


def test_filter_keeps_every_row_of_a_kept_condensed_episode_and_padding_restores_the_invariant(condensed_batch):
    batch, played = condensed_batch
    kept, metrics = filter_rollout(batch, "top_k", 0.5)
    assert metrics["rollout/filter_kept_ratio"] == 0.5
    kept_groups = set(kept["uid"].tolist())
    assert len(kept_groups) == 1
    for env_id, replies in played.generated.items():
        n_rows = int((kept["traj_uid"] == env_id).sum())
        assert n_rows == (len(replies) if played.episodes[env_id].group_id in kept_groups else 0)
    padded, n_pad = pad_for_update(kept, 8)
    assert len(padded) % 8 == 0 and n_pad < 8 and padded["response_mask"][len(kept):].sum() == 0


def test_shape_filters_on_raw_scores_then_normalises_the_kept_episodes():
    batch = _full_batch()
    shaped, metrics = shape_rollout(batch, filter_strategy="top_k", filter_value=2 / 3, norm_grouping="batch",
                                    norm_method="mean")
    assert shaped["traj_uid"].tolist() == [0, 1, 4, 5]  # groups 0 and 2 by raw std
    assert _totals(shaped).sum() == pytest.approx(0.0, abs=1e-6)  # batch mean over the kept episodes only
    assert metrics["rollout/score_raw_mean"] == pytest.approx((1 + 0 + 1 - 0.1) / 4)
    assert metrics["rollout/score_normalized_mean"] == pytest.approx(0.0, abs=1e-6)


def _baseline_batch(group_rewards: dict[int, float]) -> TensorBatch:
    """A remax_baseline rollout's batch: one greedy episode per group, its reward on its last token."""
    groups = list(group_rewards)
    rewards = torch.zeros(len(groups), len(MASK))
    rewards[:, TURN2_LAST] = torch.tensor([group_rewards[g] for g in groups])
    return TensorBatch({"response_mask": torch.tensor([MASK] * len(groups)), "token_level_rewards": rewards,
                        "uid": torch.tensor(groups), "traj_uid": torch.tensor(groups)})


def test_remax_baseline_is_the_greedy_episode_reward_of_each_rows_group():
    batch, dropped = attach_reward_baselines(_full_batch(), _baseline_batch({2: 0.75, 0: 0.5, 1: -0.1}))
    assert dropped == 0
    torch.testing.assert_close(batch["reward_baselines"], torch.tensor([0.5, 0.5, -0.1, -0.1, 0.75, 0.75]))
    adv, returns = core_algos.compute_advantage(batch.tensors, "remax")
    mask = batch["response_mask"].bool()
    # advantage = reward-to-go - the group's greedy reward, on every generated token
    torch.testing.assert_close(adv[mask], (returns - batch["reward_baselines"][:, None])[mask])
    totals = torch.tensor([r1 + r2 for r1, r2 in TURN_REWARDS])
    torch.testing.assert_close(adv[:, 2], totals - batch["reward_baselines"])  # first generated token


def test_rows_of_a_group_without_baseline_are_dropped_and_duplicates_refused():
    batch, dropped = attach_reward_baselines(_full_batch(), _baseline_batch({0: 1.0, 2: 0.0}))
    assert dropped == 2 and batch["traj_uid"].tolist() == [0, 1, 4, 5]
    assert batch["reward_baselines"].tolist() == [1.0, 1.0, 0.0, 0.0]
    twice = TensorBatch.concat([_baseline_batch({0: 1.0}), _baseline_batch({0: 0.0})])
    twice["traj_uid"] = torch.tensor([0, 1])  # two greedy episodes of group 0
    with pytest.raises(ValueError, match="one episode per group"):
        attach_reward_baselines(_full_batch(), twice)
