import math

import pytest
import torch

from agent_trainer import core_algos

NORM = core_algos.normalize_scores
FILTER = core_algos.filter_groups


def test_normalize_scores_state_grouping():
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    tags = torch.tensor([0, 0, 0, 1, 1, 1])
    torch.testing.assert_close(NORM(scores, groups, tags, "state", "identity"), scores)
    torch.testing.assert_close(NORM(scores, groups, tags, "state", "mean"),
                               torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    z = 1 / (1 + 1e-6)  # group 0 std = 1; group 1 is constant and group 2 a single episode -> 0
    torch.testing.assert_close(NORM(scores, groups, tags, "state", "mean_std"),
                               torch.tensor([-z, 0.0, z, 0.0, 0.0, 0.0]))


def test_normalize_scores_inductive_and_batch_grouping():
    scores = torch.tensor([1.0, 3.0, 10.0, 20.0])
    groups = torch.tensor([0, 1, 2, 3])
    tags = torch.tensor([7, 7, 8, 8])
    torch.testing.assert_close(NORM(scores, groups, tags, "inductive", "mean"), torch.tensor([-1.0, 1.0, -5.0, 5.0]))
    torch.testing.assert_close(NORM(scores, groups, tags, "batch", "mean"), torch.tensor([-7.5, -5.5, 1.5, 11.5]))


def test_normalize_scores_asym_clip():
    # 15 zeros and one 1: mean 1/16, unbiased std .25 -> z = -.25 and 3.75 (clipped to 3)
    scores = torch.tensor([0.0] * 15 + [1.0])
    ids = torch.zeros(16, dtype=torch.long)
    out = NORM(scores, ids, ids, "batch", "asym_clip")
    torch.testing.assert_close(out[:15], torch.full((15,), -0.25 / (1 + 4e-6)))
    assert out[15] == 3.0
    out = NORM(1 - scores, ids, ids, "batch", "asym_clip")
    assert out[15] == -1.0


def test_normalize_scores_bad_values():
    x = torch.zeros(2)
    ids = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="grouping"):
        NORM(x, ids, ids, "episode", "mean")
    with pytest.raises(ValueError, match="method"):
        NORM(x, ids, ids, "state", "rank")


def _four_groups():
    # group stds: g0 [0, 0] -> 0 ; g1 [0, 1] -> .7071 ; g2 [0, 2] -> 1.4142 ; g3 [0, .5] -> .3536
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    return scores, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


@pytest.mark.parametrize("strategy,value,kept_groups", [
    ("top_k", 0.5, [2, 1]), ("top_k", 0.25, [2]), ("top_k", 0.1, [2]), ("top_k", 1.0, [0, 1, 2, 3]),
    ("top_p", 0.5, [2]), ("top_p", 0.6, [2, 1]), ("top_p", 1.0, [2, 1, 3]),
    ("min_p", 0.4, [2, 1]), ("min_p", 0.2, [2, 1, 3]), ("min_p", 0.0, [0, 1, 2, 3]),
])
def test_filter_groups_hand_computed(strategy, value, kept_groups):
    scores, groups = _four_groups()
    keep, ratio = FILTER(scores, groups, strategy, value)
    expected = torch.tensor([int(g) in kept_groups for g in groups])
    assert torch.equal(keep, expected)
    assert math.isclose(ratio, len(kept_groups) / 4)


def test_filter_groups_all_constant_and_singletons():
    scores = torch.tensor([1.0, 1.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    keep, ratio = FILTER(scores, groups, "top_p", 0.9)
    assert keep.all() and ratio == 1.0
    keep, ratio = FILTER(scores, groups, "top_k", 0.34)  # floor(.34 * 3) = 1 group, ties -> smallest id
    assert keep.tolist() == [True, True, False, False, False] and math.isclose(ratio, 1 / 3)
    keep, ratio = FILTER(torch.zeros(0), torch.zeros(0, dtype=torch.long), "min_p", 0.5)
    assert keep.numel() == 0 and ratio == 1.0


def test_filter_groups_bad_values():
    scores, groups = _four_groups()
    with pytest.raises(ValueError, match="strategy"):
        FILTER(scores, groups, "std_rev", 0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        FILTER(scores, groups, "top_k", 0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        FILTER(scores, groups, "min_p", 1.5)
