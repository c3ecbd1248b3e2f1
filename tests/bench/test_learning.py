"""bench/learning.py's report: the table from finished runs' metrics, and a doc whose hand-written reading survives."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import learning  # noqa: E402
from bench.baselines import Score  # noqa: E402


def fake_run(folder: Path, val: list[float], sampled: list[float], seconds: float | None) -> Path:
    """A run folder as agent_trainer.main leaves it: val every 10 steps from step 0, one record per step."""
    folder.mkdir(parents=True)
    records = [{"step": 0, "val/success_rate": val[0], "val/episode_reward_mean": val[0]}]
    for step, s in enumerate(sampled, start=1):
        record = {"step": step, "rollout/success_rate": s}
        if step % 10 == 0:
            record.update({"val/success_rate": val[step // 10], "val/episode_reward_mean": val[step // 10]})
        records.append(record)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if seconds is not None:
        learning.seconds_file(learning.log_file(folder)).write_text(f"{seconds}\n")
    return folder


def test_table_rows_sampled_trend_and_what_did_not_learn(tmp_path):
    learned = [fake_run(tmp_path / f"ppo{s}", [0.3, 0.6, 0.9], [0.1] * 5 + [0.5] * 10 + [0.9] * 5, 60.0)
               for s in range(2)]
    flat = [fake_run(tmp_path / "grpo0", [0.3, 0.3, 0.3], [0.2] * 20, None)]
    base = {"random valid": Score(0.0, 0.0, 64), "safe Down/Right (reads the neighbours)": Score(0.8, 0.8, 64),
            "expert": Score(1.0, 1.0, 8)}
    rows, notes = learning.env_section("frozenlake", {"ppo_gae": learned, "grpo": flat}, base)
    assert rows[0] == "| FrozenLake 4x4, p 0.8 | SFT start (RL step 0) | 0.300 ± 0.000 | | | | 3 |"
    assert rows[1] == ("| FrozenLake 4x4, p 0.8 | PPO + GAE | 0.900 ± 0.000 | 0.900 ± 0.000 | 0.600 ± 0.000 | "
                       "0.100 -> 0.900 | 2 |")
    assert rows[2] == "| FrozenLake 4x4, p 0.8 | GRPO | 0.300 | 0.300 | 0.000 | 0.200 -> 0.200 | 1 |"
    assert rows[-1] == "| FrozenLake 4x4, p 0.8 | expert | 1.000 | 1.000 | | | 8 episodes |"
    # PPO gained 60 points and ended above every blind baseline; GRPO did neither. The map-reading heuristic (0.8)
    # and the expert are not blind: a policy below them but above the blind ones has learned
    assert notes == ["GRPO on FrozenLake 4x4, p 0.8: 0.300 -> 0.300 (best policy blind to the observation 0.000)"]
    middling = [fake_run(tmp_path / "gigpo0", [0.0, 0.5, 0.7], [0.1] * 20, None)]
    _, notes = learning.env_section("frozenlake", {"gigpo": middling}, base)
    assert notes == []  # 0.7: under safe Down/Right's 0.8, but it gained 70 points over a blind best of 0.0
    assert learning.recorded_seconds([learning.log_file(d) for d in learned + flat]) == (120.0, 1)


def test_the_doc_block_is_rewritten_and_the_reading_around_it_kept(tmp_path, monkeypatch):
    doc = tmp_path / "results.md"
    doc.write_text(f"# Learning results\n\n{learning.BEGIN}\nold table\n{learning.END}\n\n## Reading\nby hand\n")
    monkeypatch.setattr(learning, "DOC", doc)
    args = Namespace(envs=["frozenlake"], algos=["grpo"], seeds=1, steps=20, val_groups=128, test_freq=5)
    learning.write_doc(["--seeds", "1"], args, {"frozenlake": (["| row |"], [])}, [tmp_path / "frozenlake.png"],
                       wall_s=600.0, unrecorded=2)
    text = doc.read_text()
    assert text.startswith(f"# Learning results\n\n{learning.BEGIN}\n- Command: `python bench/learning.py --seeds 1`")
    assert text.endswith(f"{learning.END}\n\n## Reading\nby hand\n") and "old table" not in text
    assert "- Wall time: 10.0 min for the training processes (SFT and RL, summed from each run's `.log.seconds`); " \
           "2 of them without a recorded time" in text
    assert "**A reduced run**" in text and "| row |" in text and "![frozenlake](results/frozenlake.png)" in text


def _summary(start: float, end: float, blind: float) -> dict:
    return {"task": "FrozenLakeNoDeadEnds", "held_out_episodes": 128, "rl_start": start, "rl_end": end,
            "wall_s": 540.0, "baselines": [{"name": "best fixed sequence", "success": blind, "reads_observation": False},
                                           {"name": "expert", "success": 1.0, "reads_observation": True}]}


def test_pipeline_seeds_each_seed_against_the_bar_and_the_rate(tmp_path):
    """--pipeline-seeds: a row per make train SEED=s, the bar judged per seed, the rate and the spread of the end."""
    runs = [learning.PipelineRun(0, _summary(0.0, 0.9, 0.46), [(0, 0.0), (30, 0.7), (60, 0.9)],
                                 {"chose_hole": 0.5, "success": 0.12}, "d815fd00", 540.0),
            learning.PipelineRun(1, _summary(0.1, 0.55, 0.46), [(0, 0.1), (30, 0.3), (60, 0.55)], {}, "8088211a", None),
            learning.PipelineRun(2, _summary(0.4, 0.62, 0.46), [(0, 0.4), (30, 0.5), (60, 0.62)], {}, "817359c6", None)]
    # seed 1 ends 0.09 above the blind policy (short of 0.10); seed 2 gains 0.22 and ends 0.16 above: met
    assert [r.passes for r in runs] == [True, False, True]
    block = learning.pipeline_block(["--pipeline-seeds", "3"], runs, tmp_path / "pipeline_seeds.png")
    assert "is met by 2 of 3 pipeline seeds.** RL end: min 0.550, median 0.620, max 0.900." in block
    assert "| 0 | d815fd00 | 0.50 / 0.120 | 0.000 | 0.700 | 0.900 | +0.900 | 0.460 | met | 9.0 min |" in block
    assert "| 1 | 8088211a |  | 0.100 | 0.300 | 0.550 | +0.450 | 0.460 | short |  |" in block
    assert [learning.make_train_dirs(s)[0].name for s in (0, 3)] == ["tiny-qwen2-train-seed0", "tiny-qwen2-train-seed3"]
    assert learning.make_train_dirs(3)[1].name == "frozenlake_nodeadends_seed3"


def test_the_grids_warm_start_keeps_the_sft_configs_own_rl_overrides(tmp_path):
    """A command line's rl_overrides replaces the config's list: the grid passes the config's own keys again."""
    lora = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.target_modules=[down_proj,o_proj]"]
    (tmp_path / "sft_lora.yaml").write_text("defaults:\n  - sft_schema\n  - _self_\n\nrl_overrides:\n"
                                            + "".join(f"  - {o}\n" for o in lora))
    assert learning.own_rl_overrides("sft_lora", tmp_path) == lora
    assert learning.own_rl_overrides("sft_frozenlake_nodeadends") == []
