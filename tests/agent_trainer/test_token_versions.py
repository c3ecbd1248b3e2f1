"""Per-token policy versions (trainer.async_mode=continuous): each generated token carries the version of the
engine call that produced it, whatever the agent's row layout; a group is as old as its oldest token."""

import pytest
import torch

from agent_trainer.common.batch import TensorBatch
from agent_trainer.rollout.results import token_versions
from agent_trainer.rollout.overlap import (group_oldest_versions, has_fresh_groups, row_oldest_versions,
                                           split_stale_groups, version_metrics)


def _batch(rows: list[list[int]], traj: list[int], uid: list[int]) -> TensorBatch:
    """rows: the response mask per row (the ids do not matter here)."""
    mask = torch.tensor(rows)
    return TensorBatch({"input_ids": torch.zeros_like(mask), "response_mask": mask,
                        "traj_uid": torch.tensor(traj), "uid": torch.tensor(uid)})


def test_each_turns_tokens_carry_its_version_in_one_row_per_episode():
    batch = _batch([[0, 1, 1, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0, 0]], traj=[7, 8], uid=[0, 0])
    generations = {7: [[11, 12], [13, 14, 15]], 8: [[21]]}
    out = token_versions(batch, generations, {7: [3, 4], 8: [4]})
    assert out.tolist() == [[-1, 3, 3, -1, 4, 4, 4, -1], [-1, 4, -1, -1, -1, -1, -1, -1]]
    batch["token_versions"] = out
    assert row_oldest_versions(batch, default=9).tolist() == [3, 4]
    assert group_oldest_versions(batch).tolist() == [3, 3]
    assert version_metrics(batch) == {"rollout/versions_in_batch": 2.0, "rollout/mixed_version_episodes": 1.0}


def test_one_row_per_turn_takes_the_turns_in_row_order():
    batch = _batch([[0, 1, 1], [0, 0, 1], [1, 0, 0]], traj=[5, 5, 6], uid=[0, 0, 1])
    out = token_versions(batch, {5: [[1, 2], [3]], 6: [[4]]}, {5: [0, 2], 6: [1]})
    assert out.tolist() == [[-1, 0, 0], [-1, -1, 2], [1, -1, -1]]
    batch["token_versions"] = out
    assert group_oldest_versions(batch).tolist() == [0, 0, 1]


def test_a_row_without_generated_tokens_takes_the_default():
    batch = _batch([[0, 0], [1, 1]], traj=[1, 2], uid=[0, 1])
    batch["token_versions"] = token_versions(batch, {1: [], 2: [[1, 2]]}, {1: [], 2: [6]})
    assert row_oldest_versions(batch, default=5).tolist() == [5, 6]


def test_groups_with_a_token_older_than_the_bound_leave_the_batch_whole():
    """Groups 10 and 20 (uids need not be small); group 10's second episode began under version 1."""
    batch = _batch([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]], traj=[1, 2, 3, 4], uid=[10, 10, 20, 20])
    batch["token_versions"] = torch.tensor([[3, 3, 4], [1, 2, 2], [3, 3, -1], [4, -1, -1]])
    assert group_oldest_versions(batch).tolist() == [1, 1, 3, 3]
    assert has_fresh_groups(batch, oldest=2, policy="drop") and not has_fresh_groups(batch, 2, "replace")
    assert not has_fresh_groups(batch, oldest=4, policy="drop")
    kept, stale = split_stale_groups(batch, oldest=2, default=0)
    assert kept["traj_uid"].tolist() == [3, 4] and stale["traj_uid"].tolist() == [1, 2]
    assert kept["policy_version"].tolist() == [3, 4] and stale["policy_version"].tolist() == [3, 1]
    assert split_stale_groups(kept, oldest=2, default=0)[1] is None
