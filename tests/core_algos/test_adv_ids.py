"""verl-style ids: ``uid`` / ``traj_uid`` (and per-step anchors) as numpy string arrays or lists."""

import numpy as np
import pytest
import torch

from agent_trainer import core_algos

GROUP_ESTIMATORS = ("grpo", "grpo_multiturn", "rloo", "reinforce_plus_plus_baseline", "gigpo")


def _int_batch(per_step_anchors: bool):
    """6 rows, 2 groups, 4 trajectories (two of them two rows long), unequal rewards."""
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(6, 5)
    mask[:, 1:4] = 1
    mask[5, 3] = 0
    rewards = torch.zeros(6, 5)
    rewards[:, 3] = torch.randn(6, generator=g)
    rewards[5, 2] = 0.7
    batch = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "uid": torch.tensor([5, 5, 5, 9, 9, 9]),
        "traj_uid": torch.tensor([0, 0, 1, 2, 3, 3]),
    }
    if per_step_anchors:
        batch["anchor_obs_ids"] = torch.tensor([11, 12, 11, 13, 13, 14])
    else:  # one row per episode (traj_uid must not repeat): per-token anchors
        batch["traj_uid"] = torch.arange(6)
        batch["anchor_obs_ids"] = torch.tensor([[0, 7, 7, 8, 8]] * 3 + [[0, 7, 8, 8, 8]] * 3)
    return batch


def _as_strings(batch):
    """The same batch with verl-style ids: numpy object arrays of strings, lists for anchors."""
    out = dict(batch)
    out["uid"] = np.array([f"question-{int(u)}" for u in batch["uid"]], dtype=object)
    out["traj_uid"] = np.array([f"traj-{int(t)}" for t in batch["traj_uid"]])  # a numpy '<U' array
    if batch["anchor_obs_ids"].dim() == 1:
        out["anchor_obs_ids"] = [f"grid {int(a)}" for a in batch["anchor_obs_ids"]]
    return out


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("per_step", [True, False])
def test_string_ids_give_the_same_advantages_as_int_ids(name, per_step):
    ints = _int_batch(per_step)
    adv_int, ret_int = core_algos.compute_advantage(ints, name, gamma=0.9)
    adv_str, ret_str = core_algos.compute_advantage(_as_strings(ints), name, gamma=0.9)
    assert torch.equal(adv_int, adv_str) and torch.equal(ret_int, ret_str)
    assert adv_int.abs().sum() > 0  # a real signal, not two zero tensors


def test_as_group_index_numbers_by_first_appearance():
    to_index = core_algos.as_group_index
    assert to_index("uid", np.array(["b", "a", "b", "c"], dtype=object), 4).tolist() == [0, 1, 0, 2]
    assert to_index("uid", ["b", "a", "b"], 3).tolist() == [0, 1, 0]
    assert to_index("uid", [("s", 1), ("s", 2), ("s", 1)], 3).tolist() == [0, 1, 0]
    assert to_index("uid", np.array([7, 3, 7]), 3).tolist() == [7, 3, 7]  # integer ids keep their values
    ids = torch.tensor([4, 4, 2], dtype=torch.int32)
    assert to_index("uid", ids, 3).dtype == torch.long
    with pytest.raises(ValueError, match=r"uid must hold one id per row, shape \[4\]"):
        to_index("uid", ["a", "b"], 4)
    with pytest.raises(ValueError, match="uid ids must be hashable"):
        to_index("uid", [["a"], ["b"]], 2)
    with pytest.raises(ValueError, match="float"):
        to_index("uid", [float("nan"), float("nan")], 2)
