"""The shipped math and coding sets are what their seeded generators write, and their ground truths hold."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from agent_trainer.agents.condensed_ctx import ground_truth_of
from agent_trainer.trajectory_rewards import SandboxLimits, answers, load_ground_truth

DATA = Path(__file__).resolve().parents[2] / "data"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("split", ["train", "val"])
def test_the_shipped_files_are_what_the_generators_write(split):
    math, coding = _module(DATA / "math" / "make_math.py"), _module(DATA / "coding" / "make_coding.py")
    assert _rows(DATA / "math" / f"{split}.jsonl") == math.rows_for(split, *math.SPLITS[split])
    assert _rows(DATA / "coding" / f"{split}.jsonl") == coding.coding_rows(split, *coding.SPLITS[split])


def test_math_answers_check_against_their_own_ground_truth_and_the_file():
    truths = load_ground_truth(DATA / "math" / "ground_truth.json")
    for row in _rows(DATA / "math" / "val.jsonl"):
        gold = row["reward_model"]["ground_truth"]
        truth = ground_truth_of(gold, "test")
        assert answers.check_math(f"Final answer: {gold}", truth).ok
        assert not answers.check_math("Final answer: 99999", truth).ok
        assert truths[row["extra_info"]["id"]].answers == (gold,)


def test_every_coding_reference_passes_its_tests_in_the_sandbox():
    limits = SandboxLimits(wall_s=10.0)
    for row in _rows(DATA / "coding" / "val.jsonl"):
        truth = ground_truth_of(row["reward_model"]["ground_truth"], row["extra_info"]["id"])
        reference = row["extra_info"]["reference"]
        assert answers.check_coding(f"```python\n{reference}```", truth, limits).ok, row["extra_info"]["id"]
        assert not answers.check_coding("```python\nx = 1\n```", truth, limits).ok
