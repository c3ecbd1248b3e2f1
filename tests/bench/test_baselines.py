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


def test_best_fixed_sequence_wins_at_least_what_each_expert_path_wins_blind():
    seeds = range(200)
    seq = bl.best_fixed_sequence("FrozenLakeDescribed", TAGS, seeds, max_turn=6, search_seeds=200)
    assert len(seq) == 6 and set(seq) <= {"Up", "Down", "Left", "Right"}
    env = bl.make_env("FrozenLakeDescribed", TAGS)
    try:
        won = bl.blind_outcome(env, seeds, tuple(seq))[0]
        paths = {bl.expert_sequence("FrozenLakeDescribed", TAGS, s, 6) for s in range(20)}
        rivals = [bl.blind_outcome(env, seeds, p + (p[-1],) * (6 - len(p)))[0] for p in paths]
    finally:
        env.close()
    assert won >= max(rivals) and won > 0
    policy = bl.fixed_sequence(seq)  # replayed whatever the observation; the last move repeats past the end
    assert [policy(None, None, t) for t in range(8)] == seq + [seq[-1]] * 2


def test_the_search_stops_at_its_budget_with_the_best_expert_path():
    seq = bl.best_fixed_sequence("FrozenLakeDescribed", TAGS, range(100), max_turn=6, search_seeds=50, max_plays=0)
    paths = {bl.expert_sequence("FrozenLakeDescribed", TAGS, s, 6) for s in range(100)}
    assert any(tuple(seq) == p + (p[-1],) * (6 - len(p)) for p in paths)


def test_best_fixed_sequence_of_a_guessing_game_is_four_distinct_guesses(tmp_path):
    """On 1..10 in 4 guesses a blind player wins at most 4 numbers in 10: the expert's paths (most of them 2-3
    guesses, the last one repeated) win fewer; the search must find four different numbers."""
    tags_file = Path(__file__).resolve().parents[2] / "examples" / "guess_number" / "guess10_envs.yaml"
    tags = {**TAGS, **load_env_tags(tags_file)}
    seq = bl.best_fixed_sequence("GuessNumber10", tags, range(300), max_turn=4)
    assert len(seq) == 4 and len(set(seq)) == 4 and all(1 <= int(a) <= 10 for a in seq)
    score = bl.play("GuessNumber10", tags, SEEDS, bl.fixed_sequence(seq), max_turn=4)
    assert 0.25 < score.success < 0.6  # about 0.4 on any 48 seeds


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


def write_run(folder: Path, points: list[tuple[int, float]], steps: int = 0) -> Path:
    """A run folder whose metrics.jsonl holds validations ``points`` and ``steps`` training steps."""
    folder.mkdir()
    records = [{"step": s, "rollout/success_rate": 0.5} for s in range(1, steps + 1)]
    records += [{"step": s, "val/success_rate": v} for s, v in points]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["step"])))
    return folder


def test_reached_counts_the_sampled_episodes_up_to_the_first_validation_at_the_target():
    records = [{"step": 0, "val/success_rate": 0.1}, *({"step": s, "rollout/success_rate": 0.2} for s in range(1, 21)),
               {"step": 10, "val/success_rate": 0.85}, {"step": 15, "val/success_rate": 0.9},
               {"step": 20, "val/success_rate": 0.8}]
    got = bl.reached(records, 0.9, per_step=64)
    assert got == {"start": 0.1, "end": 0.8, "best": 0.9, "steps": 20, "sampled_episodes": 1280,
                   "reached_at_step": 15, "episodes_to_reach": 960, "previous_validation_step": 10}
    never = bl.reached(records[:-2], 0.9, per_step=64)
    assert never["reached_at_step"] is None and never["episodes_to_reach"] is None and never["end"] == 0.85


def test_distill_summary_and_table_compare_the_episodes_each_run_needed(tmp_path, capsys):
    teacher = write_run(tmp_path / "teacher", [(58, 0.97), (116, 1.0)])
    distill = write_run(tmp_path / "distill", [(0, 0.1), (5, 0.6), (10, 0.95), (15, 1.0)], steps=15)
    rl = write_run(tmp_path / "rl", [(0, 0.1), (15, 0.4), (30, 0.5)], steps=30)
    overrides = ["es_manager.val.env_groups=16", "es_manager.val.env_configs.n_groups=[16]",
                 "es_manager.val.env_configs.tags=[FrozenLakeNoDeadEnds]", "es_manager.train.env_groups=8",
                 "es_manager.train.group_size=8"]
    bl.main(["--distill-dir", str(distill), "--teacher-dir", str(teacher), "--rl-dir", str(rl), "--repeats", "1",
             "--started-at", "0", *overrides])
    out = capsys.readouterr().out.splitlines()
    summary = json.loads((distill / "distill_summary.json").read_text())
    assert (summary["teacher"], summary["student_start"], summary["episodes_per_step"]) == (1.0, 0.1, 64)
    assert summary["distill"]["episodes_to_reach"] == 640 and summary["distill"]["end"] == 1.0
    assert summary["rl"]["episodes_to_reach"] is None and summary["rl"]["sampled_episodes"] == 1920
    assert summary["episode_ratio"] == pytest.approx(640 / 1920, abs=1e-4) and summary["meets"]
    assert not summary["rl_reached"] and summary["wall_s"] > 0
    assert len(summary["baselines"]) == 5 and not (rl / "learning_summary.json").exists()
    assert any(line.startswith("teacher") and "1.000" in line for line in out)
    assert any(line.startswith("student after distillation (step 15)") and "640 (step 10; not yet at step 5)" in line
               for line in out)
    assert any(line.startswith("RL on reward alone (step 30)") and "not within 1920 (30 steps)" in line for line in out)
    assert out[-2] == ("Distillation needed 0.33 of RL's whole budget (RL never reached it): meets the goal of at most "
                       "0.50 with the student ending at 0.9 or above.")


def test_check_teacher_refuses_a_teacher_below_the_target(tmp_path):
    good = write_run(tmp_path / "good", [(29, 0.5), (58, 0.92)])
    bad = write_run(tmp_path / "bad", [(29, 0.95), (58, 0.7)])
    assert bl.check_teacher(good) is None
    assert "0.700 at step 58, below 0.9" in bl.check_teacher(bad)
    assert "no evaluation" in bl.check_teacher(write_run(tmp_path / "none", []))
    with pytest.raises(SystemExit) as stop:
        bl.main(["--check-teacher", str(bad)])
    assert "below 0.9" in str(stop.value.code)
