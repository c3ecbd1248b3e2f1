"""Bandit, Countdown (safe parser) and MetaMathQA (answer matching, retries)."""

import json

import pandas as pd
import pytest

import envs
from envs.countdown import parse_expression
from envs.data.make_metamathqa_sample import make_records
from envs.experts import countdown_solve
from envs.metamathqa import answers_match, extract_gold

# ---------------------------------------------------------------- Bandit


def test_bandit_payouts_and_names():
    env = envs.make_env("bandit", lo_arm_name="Safe", hi_arm_name="Risky")
    assert env.action_description() == "Safe | Risky" and env.expert_action() == "Risky"
    env.reset(seed=0)
    assert env.step("safe")[1:3] == (0.1, True)
    hits = []
    for seed in range(400):
        env.reset(seed=seed)
        _, r, done, info = env.step("RISKY")
        hits.append(r)
        assert done and info["success"] and r in (0.0, 1.0)
    assert 0.18 < sum(hits) / len(hits) < 0.32  # hi arm pays 1 with probability 0.25
    env.reset(seed=1)
    _, r, done, info = env.step("neither")
    assert (r, done, info["action_is_valid"]) == (0.0, False, False)


def test_bandit_same_seed_same_payout():
    env = envs.make_env("bandit")
    payouts = set()
    for _ in range(3):
        env.reset(seed=42)
        payouts.add(env.step("Dragon")[1])
    assert len(payouts) == 1


# ---------------------------------------------------------------- Countdown


@pytest.mark.parametrize("text, value", [
    ("(3 + 5) * 2", 16), ("10 / 4", 2.5), ("7 - 9", -2), ("1 + 2 = 3", 3), ("  ((4))  ", 4),
])
def test_parser_accepts_arithmetic(text, value):
    assert float(parse_expression(text)[0]) == value


@pytest.mark.parametrize("text", [
    "__import__('os').system('echo hi')", "2 ** 100", "abs(-3)", "x + 1", "1.5 + 2", "[1, 2]",
    "-3 + 4", "3 // 2", "1 if 1 else 2", "lambda: 0", "(" * 300 + "1" + ")" * 300, "", "1 +", "True + 1",
])
def test_parser_rejects_everything_else(text):
    assert parse_expression(text) is None


def test_countdown_rewards():
    env = envs.make_env("countdown", num_operands=3)
    env.reset(seed=5)
    good = countdown_solve(env.nums, env.target, use_all=True)
    assert env.step(good)[1] == 1.0
    env.reset(seed=5)
    _, r, done, info = env.step(" + ".join(map(str, env.nums)) + " + 1")  # well-formed, wrong numbers
    assert (r, done, info["action_is_valid"], info["success"]) == (0.1, True, True, False)
    env.reset(seed=5)
    _, r, done, info = env.step("I think the answer is 42")
    assert (r, done, info["action_is_valid"]) == (0.0, False, False)
    env.reset(seed=5)
    assert env.step(f"{env.nums[0]} / 0")[1] == 0.1  # division by zero: well-formed, no value


def test_countdown_generated_targets_are_in_range_and_solvable():
    env = envs.make_env("countdown", num_operands=4, max_target=100)
    for seed in range(30):
        env.reset(seed=seed)
        assert 1 <= env.target <= 100 and len(env.nums) == 4
        assert countdown_solve(env.nums, env.target, use_all=True) is not None


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_countdown_loads_files(tmp_path, suffix):
    rows = [{"target": 24, "nums": [4, 6, 1]}, {"target": 10, "nums": [2, 5]}]
    path = tmp_path / f"cd{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pd.DataFrame(rows).to_parquet(path)
    env = envs.make_env("countdown", data_path=str(path))
    seen = set()
    for seed in range(20):
        env.reset(seed=seed)
        seen.add(env.target)
        assert env.step(env.expert_action())[3]["success"]
    assert seen == {24, 10}


def test_countdown_bad_file_and_path():
    with pytest.raises(ValueError, match="does not exist"):
        envs.make_env("countdown", data_path="/nope.jsonl")


# ---------------------------------------------------------------- MetaMathQA


@pytest.mark.parametrize("pred, gold, same", [
    ("0.5", "\\frac{1}{2}", True), ("1/2", "\\dfrac{1}{2}", True), ("1,000", "1000", True),
    ("\\boxed{42}", "42", True), ("$-\\frac{3}{4}$", "-0.75", True), ("The answer is: 7", "7", True),
    ("\\frac12", "0.5", True), ("50\\%", "50", True), ("x + 1", "x+1", True),
    ("7", "8", False), ("", "0", False), ("1/0", "0", False), ("\\frac{1}{3}", "0.33", False),
])
def test_answer_matching(pred, gold, same):
    assert answers_match(pred, gold) is same


def test_shipped_sample_is_consistent():
    from envs.metamathqa import DEFAULT_DATA, load_records

    recs = load_records(DEFAULT_DATA)
    assert len(recs) >= 200 and recs == make_records(len(recs))  # regenerable bit for bit
    for rec in recs:
        assert extract_gold(rec["response"])


def test_metamathqa_retries_halve_the_reward():
    env = envs.make_env("metamathqa", max_attempts=3)
    env.reset(seed=3)
    assert env.step("")[3]["action_is_valid"] is False  # empty answer costs no attempt
    assert env.step("definitely wrong")[1:3] == (0.0, False)
    _, r, done, info = env.step(env.expert_action())
    assert (r, done, info["success"]) == (0.5, True, True)
    env.reset(seed=4)
    outs = [env.step("no") for _ in range(3)]
    assert [o[2] for o in outs] == [False, False, True] and not outs[-1][3]["success"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_metamathqa_reads_formats(tmp_path, suffix):
    rows = [{"query": "What is 1+1?", "response": "1+1=2.\nThe answer is: 2", "type": "x"}]
    path = tmp_path / f"m{suffix}"
    if suffix == ".jsonl":
        path.write_text(json.dumps(rows[0]) + "\n")
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pd.DataFrame(rows).to_parquet(path)
    env = envs.make_env("metamathqa", data_path=str(path))
    assert env.reset(seed=0) == "What is 1+1?"
    assert env.step("2")[1] == 1.0
