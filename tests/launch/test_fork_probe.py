"""launch.fork_probe: the forks it finds are forks, and its linear probe tells a readable feature from noise."""

from __future__ import annotations

import torch

from launch import fork_probe


def test_the_linear_probe_finds_a_feature_that_is_there_and_none_that_is_not():
    gen = torch.Generator().manual_seed(0)
    labels = (torch.rand(200, generator=gen) < 0.5).double()
    noise = torch.randn(200, 16, generator=gen, dtype=torch.float64)
    readable = noise.clone()
    readable[:, 3] += 4 * (labels - 0.5)  # one direction carries the label
    assert fork_probe.probe_accuracy(readable, labels) > 0.9
    assert 0.3 < fork_probe.probe_accuracy(noise, labels) < 0.7


def test_fishers_ratio_grows_with_the_separation_of_the_two_sides():
    gen = torch.Generator().manual_seed(0)
    labels = (torch.rand(400, generator=gen) < 0.5).double()
    noise = torch.randn(400, 16, generator=gen, dtype=torch.float64)
    ratios = []
    for shift in (0.0, 1.0, 4.0):
        features = noise.clone()
        features[:, 3] += shift * (labels - 0.5)
        distance, ratio = fork_probe.fisher_ratio(features, labels)
        assert abs(distance - shift) < 0.5  # the class means differ by shift along one axis, plus sampling noise
        ratios.append(ratio)
    # about shift**2 over a unit within-class variance along that axis; noise alone gives a small ratio
    assert ratios[0] < 0.5 and 0.5 < ratios[1] < 2.0 and 10.0 < ratios[2] < 25.0


def test_the_probe_runs_on_a_model_at_the_forks_of_the_held_out_maps(tiny_model_path):
    result = fork_probe.probe(tiny_model_path, episodes=48)
    assert result["forks"] >= 10 and 0.0 <= result["note_copy"] <= 1.0
    assert 0.0 <= result["p_hole"] <= 1.0 and result["mean_abs_logit_diff"] >= 0.0
    assert -1.0 <= result["corr_logit_diff_hole_down"] <= 1.0 and 0.0 <= result["linear_probe_accuracy"] <= 1.0
    assert result["class_mean_distance"] >= 0.0 and result["fisher_ratio"] >= 0.0

