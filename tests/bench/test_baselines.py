"""bench/baselines.py: the policies no model is needed for, played on held-out seeds, and make train's table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import baselines as bl  # noqa: E402
from envs import load_env_tags  # noqa: E402

TAGS = load_env_tags()
SEEDS = [2**30 + g for g in range(48)]


def test_frozenlake_baselines_order_from_blind_to_expert():
    scores = bl.baselines("FrozenLakeDescribed", TAGS, SEEDS, max_turn=6, repeats=4, train_seeds=range(300))
    assert list(scores) == ["random valid", "random Down/Right", "best fixed sequence",
                            "safe Down/Right (reads the neighbours)", "expert"]
    assert scores["expert"].success == 1.0 and scores["expert"].reward == 1.0
    assert scores["random valid"].success < 0.05 < scores["random Down/Right"].success
    assert scores["random Down/Right"].success < scores["best fixed sequence"].success < 0.6
    assert scores["safe Down/Right (reads the neighbours)"].success > 0.6
    assert scores["random valid"].episodes == 4 * len(SEEDS) and scores["expert"].episodes == len(SEEDS)


def test_best_fixed_sequence_is_the_most_common_expert_path_and_replays_blindly():
    seq = bl.best_fixed_sequence("FrozenLakeDescribed", TAGS, range(200), max_turn=6)
    assert len(seq) == 6 and set(seq) <= {"Down", "Right"} and seq.count("Down") == 3
    policy = bl.fixed_sequence(seq)
    assert [policy(None, None, t) for t in range(8)] == seq + [seq[-1]] * 2


def test_sokoban_gets_the_generic_baselines_only():
    scores = bl.baselines("SimpleSokoban", TAGS, SEEDS[:8], max_turn=10, repeats=2, train_seeds=range(20))
    assert list(scores) == ["random valid", "best fixed sequence", "expert"]
    assert scores["expert"].success >= scores["random valid"].success


def test_report_puts_the_runs_beside_the_baselines(tmp_path):
    from agent_trainer.checks.prepare import compose_and_prepare

    sft, rl = tmp_path / "sft", tmp_path / "rl"
    for folder, points in ((sft, [(0, 0.0), (58, 0.2)]), (rl, [(0, 0.25), (20, 0.4), (40, 0.6)])):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "val/success_rate": v, "val/episode_reward_mean": v}) + "\n" for s, v in points))
    with (rl / "metrics.jsonl").open("a") as f:  # training steps: sampled success 0.1 ... 1.0
        f.writelines(json.dumps({"step": s, "rollout/success_rate": s / 10}) + "\n" for s in range(1, 11))
    cfg, tags = compose_and_prepare(["es_manager.val.env_groups=16", "es_manager.val.env_configs.n_groups=[16]"])
    text = bl.report(cfg, tags, sft, bl.read_metrics(rl), repeats=1)
    lines = text.splitlines()
    assert lines[0].startswith("Held-out greedy success on 16 validation seeds (FrozenLakeDescribed, 6 turns)")
    assert any("SFT (its own evaluation after step 58)" in line and "0.200" in line for line in lines)
    assert any("RL start (step 0)" in line and "0.250" in line for line in lines)
    assert any("RL end (step 40)" in line and "0.600" in line for line in lines)
    assert any(line.startswith("expert [FrozenLakeDescribed]") and "1.000" in line for line in lines)
    assert lines[-2] == ("Sampled training success (the episodes RL trains on): 0.300 over steps 1-5 -> 0.800 over "
                         "the last 5 steps.")
    assert lines[-1] == ("RL gain over its start: +0.350 (meets the goal of +0.200); RL end +0.162 against the best "
                         "policy that ignores the observation (best fixed sequence [FrozenLakeDescribed], 0.438): "
                         "meets the goal of +0.100."), lines[-1]


def test_learning_summary_is_the_runs_and_the_baselines_as_data(tmp_path):
    from agent_trainer.checks.prepare import compose_and_prepare

    rl = tmp_path / "rl"
    rl.mkdir()
    records = [{"step": 0, "val/success_rate": 0.25}, *({"step": s, "rollout/success_rate": s / 10} for s in
                                                         range(1, 11)), {"step": 10, "val/success_rate": 0.75}]
    (rl / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = ["es_manager.val.env_groups=16", "es_manager.val.env_configs.n_groups=[16]",
                 "es_manager.val.env_configs.tags=[FrozenLakeNoDeadEnds]"]
    bl.main(["--rl-dir", str(rl), "--repeats", "1", "--started-at", "0", *overrides])
    summary = json.loads((rl / "learning_summary.json").read_text())
    assert summary["task"] == "FrozenLakeNoDeadEnds" and summary["held_out_episodes"] == 16
    assert (summary["rl_start"], summary["rl_end"]) == (0.25, 0.75)
    assert summary["sampled_first5"] == pytest.approx(0.3) and summary["sampled_last5"] == pytest.approx(0.8)
    assert summary["wall_s"] > 0
    reads = {b["name"].split(" [")[0]: (b["reads_observation"], b["success"]) for b in summary["baselines"]}
    assert list(reads) == ["random valid", "random Down/Right", "best fixed sequence",
                           "safe Down/Right (reads the neighbours)", "expert"]
    assert [r for r, _ in reads.values()] == [False, False, False, True, True]
    assert reads["safe Down/Right (reads the neighbours)"][1] == reads["expert"][1] == 1.0  # no dead ends
    assert bl.verdict(summary).startswith("RL gain over its start: +0.500 (meets the goal of +0.200)")
