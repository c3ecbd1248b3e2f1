"""Prompt datasets: every format through load_prompts, malformed files, lengths, order, reward functions."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from envs.datasets import check_prompt_lengths, load_prompts, row_for_position
from envs.reward_fns import default_compute_score, load_reward_fn, score

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"data_source": "arith", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
     "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 0}},
    {"data_source": "arith", "prompt": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "What is 4 * 4?"}],
     "reward_model": {"ground_truth": "16"}, "extra_info": {"index": 1}},
]


def write(tmp_path: Path, fmt: str) -> Path:
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        pd.DataFrame(ROWS).to_parquet(path)
    else:
        path.write_text("What is 2 + 3?\n\nWhat is 4 * 4?\n")
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "txt"])
def test_every_format_loads_through_one_entry(tmp_path, fmt):
    records = load_prompts(write(tmp_path, fmt))
    assert len(records) == 2
    if fmt == "txt":  # one prompt a line, no ground truth
        assert [r.prompt for r in records] == ["What is 2 + 3?", "What is 4 * 4?"]
        assert records[0].ground_truth is None and records[1].where.endswith(":3")
        return
    assert records[0].prompt == (("user", "What is 2 + 3?"),) and records[0].prompt_text() == "What is 2 + 3?"
    assert records[1].prompt_text() == "system: Be brief.\n\nuser: What is 4 * 4?"
    assert [r.ground_truth for r in records] == ["5", "16"]
    assert records[1].data_source == "arith" and records[1].extra_info == {"index": 1}


def test_plain_text_prompts_custom_keys_and_ragen_layout(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": 4}) + "\n")
    (rec,) = load_prompts([path], prompt_key="question", ground_truth_key="answer")
    assert rec.prompt == "2+2?" and rec.ground_truth == 4
    split = tmp_path / "task" / "train"  # RAGEN: data/<task>/train/prompts.json
    split.mkdir(parents=True)
    (split / "prompts.json").write_text(json.dumps(["first prompt", {"prompt": "second"}]))
    assert [r.prompt for r in load_prompts(split)] == ["first prompt", "second"]


def test_shipped_arith_files_load():
    records = load_prompts([REPO / "data/arith/train.jsonl", REPO / "data/arith/val.jsonl"])
    assert len(records) == 256 + 32
    assert all(r.ground_truth is not None and r.prompt_text().startswith("What is") for r in records)


@pytest.mark.parametrize("content, where, problem", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', ":2", "not valid JSON"),
    ('{"prompt": "ok"}\n\n{"question": "x"}\n', ":3", "no prompt field 'prompt'"),
    ('{"prompt": "ok"}\n[1, 2]\n', ":2", "must be an object"),
    ('{"prompt": ""}\n', ":1", "is empty"),
    ('{"prompt": [{"role": "user"}]}\n', ":1", "chat messages"),
])
def test_malformed_jsonl_names_file_line_and_problem(tmp_path, content, where, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    assert f"{path}{where}" in str(err.value) and problem in str(err.value)


def test_malformed_json_parquet_and_unknown_files(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[\n  {"prompt": "a"},\n  {"prompt": }\n]')
    with pytest.raises(ValueError, match=rf"{bad_json}:3: not valid JSON"):
        load_prompts(bad_json)
    bad_pq = tmp_path / "bad.parquet"
    bad_pq.write_text("not parquet")
    with pytest.raises(ValueError, match=rf"{bad_pq}: not a readable parquet file"):
        load_prompts(bad_pq)
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        (tmp_path / "x.csv").write_text("a")
        load_prompts(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


def test_overlong_prompt_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("short\n" + "word " * 50 + "\n")
    records = load_prompts(path)
    check_prompt_lengths(records, lambda t: len(t.split()), 50)
    with pytest.raises(ValueError, match=rf"{path}:2: the prompt is 50 tokens, more than data.max_prompt_length = 49"):
        check_prompt_lengths(records, lambda t: len(t.split()), 49)


def test_positions_walk_every_row_once_per_epoch_in_a_seeded_order():
    n = 7
    epoch0 = [row_for_position(p, n, True, seed=3) for p in range(n)]
    epoch1 = [row_for_position(p, n, True, seed=3) for p in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n)) and epoch0 != epoch1
    assert epoch0 == [row_for_position(p, n, True, seed=3) for p in range(n)]  # a resume replays the same rows
    assert epoch0 != [row_for_position(p, n, True, seed=4) for p in range(n)]
    assert [row_for_position(p, n, False, seed=3) for p in range(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_reward_functions_load_by_path_and_default_scores_math(tmp_path):
    assert load_reward_fn("") is default_compute_score
    assert default_compute_score("x", "\\frac{1}{2}", "0.5", {}) == 1.0
    assert default_compute_score("x", "3", "4", {}) == 0.0 and default_compute_score("x", "3", None, {}) == 0.0
    fn = load_reward_fn(str(REPO / "data/arith/reward.py"), "compute_score")
    assert [fn("arith", s, "12", {}) for s in ("12", "13", "twelve")] == [1.0, 0.1, 0.0]
    dict_fn = tmp_path / "dict_fn.py"
    dict_fn.write_text("def f(data_source, solution_str, ground_truth, extra_info):\n"
                       "    return {'score': len(solution_str) / 10, 'acc': True}\n"
                       "def g(a, b, c, d):\n    return 'yes'\n")
    assert score(load_reward_fn(str(dict_fn), "f"), "", "abcd", None, {}) == 0.4
    with pytest.raises(ValueError, match="must return a number"):
        score(load_reward_fn(str(dict_fn), "g"), "", "abcd", None, {})


@pytest.mark.parametrize("path, name, problem", [
    ("missing.py", "f", "is not a .py file"),
    ("{tmp}/fn.py", "nope", "reward.custom_reward_function.name = 'nope' is not a function"),
    ("{tmp}/fn.py", "two_args", "must take verl's arguments"),
    ("{tmp}/broken.py", "f", "failed to import"),
])
def test_bad_reward_function_is_refused_naming_the_key(tmp_path, path, name, problem):
    (tmp_path / "fn.py").write_text("def two_args(a, b):\n    return 0.0\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=problem):
        load_reward_fn(path.format(tmp=tmp_path), name)
