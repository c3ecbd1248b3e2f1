"""The LLM judge end to end: real Ray, FSDP2 and vLLM train the tiny model for 2 GRPO steps on the shipped
arithmetic prompts, and every episode is scored by a real OpenAI-compatible judge served over HTTP on 127.0.0.1 by
the test (``tests/agent_trainer/judge_server.py``: FastAPI, a fixed score per text, told which texts to answer
with prose or to sit on past the client's timeout).

- pointwise: the recorded scores are the server's, and the advantages trained on are GRPO's over the scored
  episodes' env x weight + judge x weight alone; the episodes the judge timed out on or answered with garbage have
  none, and are counted (``judge/unscored``, ``judge/timeouts``, ``judge/unparseable``);
- ranking: one call per group carrying each of its episodes exactly once, labelled 1..n; a group whose reply is
  garbage is left out whole and counted;
- in both, the API key (from the environment variable ``judge.api_key_env`` names) reaches the server and no file
  of the run (logs, metrics, config, trajectories, checkpoint) nor any log record.
"""

from __future__ import annotations

import logging
import secrets
import statistics
import threading
from pathlib import Path

import pytest

from agent_trainer.observe.trajectories import read_records
from e2e_runs import metrics_records, train_here
from tests.agent_trainer.judge_server import BLOCK, JudgeServer, text_score

KEY_ENV = "AGENT_TRAINER_TEST_JUDGE_KEY"
TINY = ["trainer.test_freq=0", "ppo_mini_batch_size=8", "es_manager.train.env_groups=2",
        "es_manager.train.env_configs.n_groups=[2]", "actor_rollout_ref.rollout.response_length=16",
        "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.log_trajectories_freq=1",
        "trainer.log_trajectories_per_tag=8"]
ENV_WEIGHT, JUDGE_WEIGHT, EPSILON = 0.5, 2.0, 1e-6


def nth_distinct(plan: list[str]):
    """``behave`` for the server: the i-th distinct text it is sent gets ``plan[i % len(plan)]`` (a retry of the
    same text gets the same)."""
    seen: dict[str, str] = {}
    lock = threading.Lock()

    def behave(text: str) -> str:
        with lock:
            return seen.setdefault(text, plan[len(seen) % len(plan)])

    return behave


def judge_keys(server: JudgeServer, mode: str) -> list[str]:
    return ["judge.enable=true", f"judge.mode={mode}", f"judge.base_url={server.base_url}", "judge.model=fixed-judge",
            f"judge.api_key_env={KEY_ENV}", "judge.timeout_s=2", "judge.max_retries=1", "judge.max_concurrency=3",
            "judge.max_unscored_fraction=0.75", f"judge.reward_weight={JUDGE_WEIGHT}",
            f"judge.env_reward_weight={ENV_WEIGHT}"]


@pytest.fixture
def key(monkeypatch) -> str:
    value = "sk-judge-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_ENV, value)
    return value


def run(server: JudgeServer, mode: str, run_dir: Path, tiny_model_path: str) -> tuple[list[dict], dict]:
    """Train 2 steps judged by ``server``; returns the metrics records and the trajectory records by step."""
    train_here("arith_grpo", tiny_model_path, run_dir, *TINY, *judge_keys(server, mode))
    episodes: dict[int, list] = {}
    for record in read_records(run_dir / "trajectories"):
        episodes.setdefault(record.step, []).append(record)
    records = metrics_records(run_dir)
    assert [r["step"] for r in records] == [1, 2] and sorted(episodes) == [1, 2]
    assert all(len(eps) == 8 and all(e.judge is not None for e in eps) for eps in episodes.values())
    return records, episodes


def check_advantages(episodes: list) -> None:
    """Every scored episode's advantage is GRPO's over its group's scored episodes, with the reward env x weight
    + judge x weight; an unscored episode has none (it left the batch before the estimator)."""
    groups: dict[int, list] = {}
    for e in episodes:
        if e.judge.score is None:
            assert e.turns[0].advantage == [] and e.turns[0].tokens == [], "an unscored episode was trained on"
        else:
            groups.setdefault(e.group_id, []).append(e)
    assert groups, "no episode was scored"
    for members in groups.values():
        rewards = [ENV_WEIGHT * e.total_reward + JUDGE_WEIGHT * e.judge.score for e in members]
        mean = statistics.fmean(rewards) if len(rewards) > 1 else 0.0
        std = statistics.stdev(rewards) if len(rewards) > 1 else 1.0
        for e, reward in zip(members, rewards):
            generated = {round(a, 4) for a, m in zip(e.turns[0].advantage, e.turns[0].mask) if m}
            assert len(generated) == 1, generated
            assert generated.pop() == pytest.approx((reward - mean) / (std + EPSILON), abs=2e-4)


def check_key_kept(key: str, run_dir: Path, caplog) -> None:
    """The key is in no file of the run (binary ones included) and in no log record of this process."""
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any("global_step_2" in str(p) for p in files) and any(p.name == "config.yaml" for p in files)
    for path in files:
        assert key.encode() not in path.read_bytes(), path
    assert key not in caplog.text


@pytest.mark.e2e
@pytest.mark.shared_cluster
def test_pointwise_judge_scores_and_leaves_out_what_it_could_not_score(tiny_model_path, tmp_path, key, caplog):
    caplog.set_level(logging.DEBUG)  # the openai and httpx clients' request logs included
    run_dir = tmp_path / "run"
    behave = nth_distinct(["stall", "garbage", "score", "score"])
    with JudgeServer(key, behave=behave, stall_s=6.0) as server:
        records, episodes = run(server, "pointwise", run_dir, tiny_model_path)
    by_text = {}
    for request in server.requests:
        by_text.setdefault(request.messages[-1]["content"], []).append(request)
    assert 1 < server.max_in_flight <= 3  # judge.max_concurrency
    behaviours = set()
    for record, step in zip(records, (1, 2)):
        unscored = timeouts = unparseable = 0
        for e in episodes[step]:
            user = e.judge.messages[-1]["content"]
            sent = by_text[user]
            [(_, text)] = BLOCK.findall(user)
            behaviour = sent[0].behaviour
            behaviours.add(behaviour)
            if behaviour == "score":
                assert e.judge.score == text_score(text) and e.judge.error is None
                continue
            unscored += 1
            assert e.judge.score is None
            if behaviour == "stall":  # sent once, retried once (judge.max_retries); a twin in the step is a hit
                assert e.judge.error.startswith("timeout")
                timeouts += not e.judge.cached
            else:
                assert e.judge.error.startswith("unparseable reply")
                unparseable += not e.judge.cached
        assert record["judge/unscored"] == unscored and record["judge/scored"] == 8 - unscored
        assert record["judge/timeouts"] == timeouts and record["judge/unparseable"] == unparseable
        scores = [e.judge.score for e in episodes[step] if e.judge.score is not None]
        assert record["judge/score_mean"] == pytest.approx(statistics.fmean(scores), abs=1e-6)
        check_advantages(episodes[step])
    assert behaviours == {"stall", "garbage", "score"}
    assert all(len(sent) == 2 for sent in by_text.values() if sent[0].behaviour == "stall")
    assert all(len(sent) == 1 for sent in by_text.values() if sent[0].behaviour != "stall")  # the cache
    check_key_kept(key, run_dir, caplog)


@pytest.mark.e2e
@pytest.mark.shared_cluster
def test_ranking_judge_sees_each_group_once_per_call(tiny_model_path, tmp_path, key, caplog):
    caplog.set_level(logging.DEBUG)
    run_dir = tmp_path / "run"
    with JudgeServer(key, behave=nth_distinct(["garbage", "score"])) as server:
        records, episodes = run(server, "ranking", run_dir, tiny_model_path)
    sent = {request.call_id: request for request in server.requests}
    for record, step in zip(records, (1, 2)):
        groups: dict[int, list] = {}
        for e in episodes[step]:
            groups.setdefault(e.group_id, []).append(e)
        assert len(groups) == 2 and all(len(members) == 4 for members in groups.values())
        unscored = 0
        for members in groups.values():
            [call_id] = {e.judge.call_id for e in members}  # one call per group ...
            request = sent[call_id]
            assert [tid for tid, _ in request.trajectories] == ["1", "2", "3", "4"]  # ... with each episode once
            assert sorted(e.judge.position for e in members) == [1, 2, 3, 4]
            assert sum(1 for e in episodes[step] if e.judge.call_id == call_id) == 4
            for e in members:
                text = dict(request.trajectories)[str(e.judge.position)]
                assert e.turns[-1].reply.strip() in text
                if request.behaviour == "score":
                    assert e.judge.score == text_score(text)
                else:
                    assert e.judge.score is None and e.judge.error.startswith("unparseable reply")
            unscored += 4 * (request.behaviour != "score")
        assert record["judge/unscored"] == unscored and record["judge/calls"] + record["judge/cache_hits"] == 2
        check_advantages(episodes[step])
    assert {r.behaviour for r in server.requests} == {"garbage", "score"}
    check_key_kept(key, run_dir, caplog)
