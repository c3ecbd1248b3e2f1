"""The prompt-dataset environment: single-turn scoring, the question environment, the env contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import envs
from envs.dataset_env import PromptDatasetEnv

REPO = Path(__file__).resolve().parents[2]
ARITH = str(REPO / "data/arith/train.jsonl")
REWARD = str(REPO / "data/arith/reward.py")


def make(**overrides) -> PromptDatasetEnv:
    return envs.make_env("prompt_dataset", **{"files": [ARITH], **overrides})


def test_single_turn_scores_the_answer_with_the_reward_function():
    env = make(reward_fn_path=REWARD)
    obs = env.reset(seed=5)
    assert obs == env.record.prompt_text() and obs.startswith("What is")
    truth = env.record.ground_truth
    _, reward, done, info = env.step(str(int(truth) + 1))
    assert (reward, done, info["success"], info["score"]) == (0.1, True, True, 0.1)  # the file's 0.1 for a number
    env.reset(seed=5)
    assert env.step(truth)[1:3] == (1.0, True)
    env.reset(seed=5)
    assert env.step("no idea")[1] == 0.0


def test_default_scorer_without_a_reward_file():
    env = make()
    env.reset(seed=1)
    assert env.step(f"\\boxed{{{env.record.ground_truth}}}")[1] == 1.0


def test_question_environment_steps_until_a_final_answer():
    env = make(max_turns=3)
    q = env.reset(seed=2)
    truth = env.record.ground_truth
    obs, reward, done, info = env.step("first I read the numbers")
    assert (reward, done, info["action_is_valid"]) == (0.0, False, True)
    assert obs == q + "\nStep 1: first I read the numbers"
    obs, reward, done, _ = env.step(f"so the final answer: {truth}")  # the marker is case-insensitive
    assert (reward, done) == (1.0, True)


def test_question_environment_scores_the_last_turn_whatever_it_says():
    env = make(max_turns=2)
    env.reset(seed=2)
    truth = env.record.ground_truth
    assert env.step("thinking")[1:3] == (0.0, False)
    assert env.step(truth)[1:3] == (1.0, True)


def test_same_seed_same_row_and_seeds_walk_the_dataset():
    a, b = make(), make()
    assert [a.reset(seed=s) for s in range(5)] == [b.reset(seed=s) for s in range(5)]
    rows = len(a.records)
    served = set()
    for s in range(rows):
        a.reset(seed=s)
        served.add(a.record.where)
    assert len(served) == rows  # one epoch of positions serves every row once


def test_garbage_never_raises_and_expert_succeeds(garbage_actions, fuzz):
    env = make(reward_fn_path=REWARD, max_turns=2)
    fuzz(env, garbage_actions)
    for seed in range(5):
        env.reset(seed=seed)
        assert env.step(env.expert_action())[3]["success"]
    env.close()
    env.close()


def test_bad_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="files is empty"):
        envs.make_env("prompt_dataset")
    with pytest.raises(ValueError, match="max_turns must be a positive int"):
        make(max_turns=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{oops\n")
    with pytest.raises(ValueError, match=rf"{bad}:2: not valid JSON"):
        make(files=[str(bad)])
