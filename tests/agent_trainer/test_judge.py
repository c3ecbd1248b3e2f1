"""The judge reward source (``agent_trainer.trajectory_rewards.judge``, ``agent_trainer.training.reward_model``):
replies parsed or refused, the ranking prompt, the client against a real OpenAI-compatible server on 127.0.0.1 (cache,
concurrency, timeouts, HTTP errors, garbage, the key), and the batch: weighted rewards, unscored episodes out of
their group's statistics, the unscored fraction that stops a run."""

from __future__ import annotations

import json

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.common.batch import TensorBatch
from agent_trainer.config.rewards import JudgeConfig
from agent_trainer.training.reward_model import add_judge_scores
from agent_trainer.trajectory_rewards.judge import (
    JUDGE_FORMATS,
    JudgeClient,
    JudgeFailure,
    JudgeItem,
    JudgeVerdict,
    PointwiseJudge,
    RankingJudge,
    UnparseableReply,
    json_objects,
    request_key,
)
from tests.agent_trainer.judge_server import BLOCK, JudgeServer, text_score

ITEMS = [JudgeItem(episode=10 + i, group=i // 3, text=f"episode {i}: went {'left' * (i + 1)}") for i in range(6)]


def pointwise(**kw) -> PointwiseJudge:
    return PointwiseJudge(JudgeConfig(**kw))


def test_pointwise_reply_parsing():
    judge = pointwise(max_score=10)
    assert judge.parse('{"explanation": "fine", "score": 7}', 1) == [7.0]
    assert judge.parse('Sure.\n```json\n{"score": "3.5"}\n```', 1) == [3.5]
    assert judge.parse('{"a": {"b": 1}} then {"score": 2} and {"score": 4}', 1) == [4.0]  # the last object
    assert judge.parse("Reasoning... Score: 6.25", 1) == [6.25]
    for garbage, why in [("no number at all", "no score"), ('{"score": 11}', r"outside \[0, 10\]"),
                         ('{"score": -1}', "outside"), ('{"score": true}', "not a number"),
                         ('{"score": "high"}', "not a number"), ('{"score": NaN}', "outside"),
                         ('{"score": null}', "not a number")]:
        with pytest.raises(UnparseableReply, match=why):
            judge.parse(garbage, 1)


def test_ranking_reply_parsing():
    judge = RankingJudge(JudgeConfig())
    ruler = {"scores": [{"trajectory_id": "2", "score": 0.1}, {"trajectory_id": 1, "score": 0.9},
                        {"trajectory_id": "3", "explanation": "x", "score": 0.5}]}
    assert judge.parse(json.dumps(ruler), 3) == [0.9, 0.1, 0.5]
    assert judge.parse('{"scores": {"1": 0.2, "2": 0.3}}', 2) == [0.2, 0.3]
    for reply, why in [('{"scores": [{"trajectory_id": "1", "score": 0.2}]}', "trajectory 2 of 2 is not scored"),
                       ('{"scores": {"1": 0.2, "1 ": 0.3}}', "scored twice"),
                       ('{"scores": {"1": 0.2, "3": 0.3}}', "'3' is not one of 1..2"),
                       ('{"scores": {"1": 0.2, "2": 1.3}}', "outside"),
                       ('{"scores": 0.5}', "not a list"), ("ranked them all, trust me", "no JSON object")]:
        with pytest.raises(UnparseableReply, match=why):
            judge.parse(reply, 2)


def test_json_objects_skip_what_is_not_json():
    assert json_objects('{oops} {"a": 1} [1] {"b": {"c": 2}}') == [{"a": 1}, {"b": {"c": 2}}]


def test_pointwise_calls_one_per_episode_with_the_rubric():
    calls = pointwise(rubric="Be strict.").calls(ITEMS)
    assert [c.episodes for c in calls] == [[item.episode] for item in ITEMS]
    for call, item in zip(calls, ITEMS):
        system, user = call.messages
        assert system["role"] == "system" and system["content"].startswith("Be strict.") and "from 0 to 1" in \
            system["content"]
        assert BLOCK.findall(user["content"]) == [("", item.text)]


def test_ranking_prompt_carries_every_episode_of_its_group_once():
    calls = RankingJudge(JudgeConfig(min_score=0, max_score=10)).calls(list(reversed(ITEMS)))
    assert [c.episodes for c in calls] == [[15, 14, 13], [12, 11, 10]]  # one call per group, in batch order
    for call in calls:
        system, user = call.messages
        assert "3 trajectories" in system["content"] and "from 0 to 10" in system["content"]
        blocks = BLOCK.findall(user["content"])
        texts = {item.episode: item.text for item in ITEMS}
        assert blocks == [(str(i), texts[e]) for i, e in enumerate(call.episodes, start=1)]


def test_formats_are_registered_and_unknown_names_refused():
    assert {"pointwise", "ranking"} <= set(JUDGE_FORMATS.names())
    with pytest.raises(ValueError, match="judge.mode = 'rank' is unknown"):
        JUDGE_FORMATS.get("rank")


def test_the_cache_key_is_the_whole_request():
    cfg, messages = JudgeConfig(model="a"), [{"role": "user", "content": "x"}]
    assert request_key(cfg, messages) == request_key(JudgeConfig(model="a"), [{"role": "user", "content": "x"}])
    assert request_key(cfg, messages) != request_key(JudgeConfig(model="b"), messages)
    assert request_key(cfg, messages) != request_key(cfg, [{"role": "user", "content": "y"}])


def client_config(server: JudgeServer, **kw) -> JudgeConfig:
    return JudgeConfig(enable=True, base_url=server.base_url, model="fixed", api_key_env="TEST_JUDGE_KEY", **kw)


def test_client_scores_caches_and_bounds_concurrency(monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-secret-1")
    with JudgeServer("sk-secret-1") as server:
        client = JudgeClient(client_config(server, max_concurrency=2))
        verdicts, stats = client.judge(ITEMS)
        assert {e: v.score for e, v in verdicts.items()} == {
            item.episode: text_score(item.text) for item in ITEMS}
        assert stats.calls == 6 and stats.cache_hits == 0 and server.max_in_flight == 2
        again, stats = client.judge(ITEMS[:2])  # the same requests: answered from the cache
        assert stats.calls == 0 and stats.cache_hits == 2 and len(server.requests) == 6
        assert all(v.cached and v.score == verdicts[e].score for e, v in again.items())
        ranked, stats = JudgeClient(client_config(server, mode="ranking")).judge(ITEMS)
        assert stats.calls == 2 and [len(r.trajectories) for r in server.requests[6:]] == [3, 3]
        assert {e: v.score for e, v in ranked.items()} == {item.episode: text_score(item.text) for item in ITEMS}
        assert [ranked[e].position for e in (10, 11, 12)] == [1, 2, 3]
        assert "sk-secret-1" not in repr(client)
        twins = [JudgeItem(1, 0, "same"), JudgeItem(2, 0, "same"), JudgeItem(3, 1, "other")]
        verdicts, stats = JudgeClient(client_config(server, cache_size=0)).judge(twins)  # no cache: still sent once
        assert stats.calls == 2 and stats.cache_hits == 1 and verdicts[1].score == verdicts[2].score
        assert [r.trajectories for r in server.requests[8:]] in ([[("", "same")], [("", "other")]],
                                                                 [[("", "other")], [("", "same")]])


def test_failures_leave_episodes_unscored_and_are_counted(monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-secret-2")
    plan = {ITEMS[0].text: "stall", ITEMS[1].text: "garbage", ITEMS[2].text: "error"}

    def behave(user: str) -> str:
        return next((what for text, what in plan.items() if text in user), "score")

    with JudgeServer("sk-secret-2", behave=behave, stall_s=3.0) as server:
        verdicts, stats = JudgeClient(client_config(server, timeout_s=0.5, max_retries=1)).judge(ITEMS[:4])
        assert verdicts[10].score is None and verdicts[10].error.startswith("timeout")
        assert verdicts[11].score is None and verdicts[11].error.startswith("unparseable reply: no score")
        assert verdicts[11].reply == "I would rather not put a number on this one."
        assert verdicts[12].score is None and verdicts[12].error.startswith("HTTP 500")
        assert verdicts[13].score == text_score(ITEMS[3].text)
        assert (stats.timeouts, stats.unparseable, stats.http_errors) == (1, 1, 1)
        sent = [r.messages[-1]["content"] for r in server.requests]
        assert sum(ITEMS[0].text in s for s in sent) == 2 and sum(ITEMS[2].text in s for s in sent) == 2  # retried
        _, stats = JudgeClient(client_config(server, timeout_s=0.5, max_retries=0)).judge(ITEMS[:2])
        assert stats.cache_hits == 0 and stats.timeouts == 1  # a failure is not cached (a new client's cache)
        monkeypatch.setenv("TEST_JUDGE_KEY", "sk-wrong")
        verdicts, stats = JudgeClient(client_config(server)).judge(ITEMS[3:4])
        assert verdicts[13].error.startswith("HTTP 401") and stats.http_errors == 1


def test_a_key_echoed_by_the_endpoint_is_masked(monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-echoed")
    with JudgeServer("sk-echoed") as server:
        client = JudgeClient(client_config(server))
        assert client.mask("your key sk-echoed is wrong") == "your key *** is wrong"


def batch_of(rewards: list[float], groups: list[int]) -> TensorBatch:
    """One row per episode (traj_uid 10, 11, ...), 3 tokens, the last 2 generated; env reward on the last one."""
    n = len(rewards)
    mask = torch.tensor([[0, 1, 1]] * n)
    token_rewards = torch.zeros(n, 3)
    token_rewards[:, 2] = torch.tensor(rewards)
    return TensorBatch({"traj_uid": torch.arange(10, 10 + n), "uid": torch.tensor(groups), "response_mask": mask,
                        "token_level_rewards": token_rewards, "attention_mask": torch.ones(n, 3, dtype=torch.long),
                        "input_ids": torch.zeros(n, 3, dtype=torch.long)})


def verdict(score: float | None) -> JudgeVerdict:
    return JudgeVerdict(mode="pointwise", score=score, error=None if score is not None else "timeout: ...")


def test_unscored_episodes_leave_their_group_statistics():
    batch = batch_of([1.0, 0.0, 1.0, 0.0, 1.0], groups=[0, 0, 0, 1, 1])
    verdicts = {10: verdict(0.5), 11: verdict(None), 12: verdict(0.1), 13: verdict(0.9), 14: verdict(0.2)}
    cfg = JudgeConfig(reward_weight=2.0, env_reward_weight=0.5)
    kept, metrics = add_judge_scores(batch, verdicts, cfg, "train")
    assert kept["traj_uid"].tolist() == [10, 12, 13, 14]
    totals = kept["token_level_rewards"].sum(-1)
    assert totals.tolist() == pytest.approx([0.5 + 1.0, 0.5 + 0.2, 0.0 + 1.8, 0.5 + 0.4])
    assert metrics["judge/unscored"] == 1 and metrics["judge/scored"] == 4
    assert metrics["judge/score_mean"] == pytest.approx((0.5 + 0.1 + 0.9 + 0.2) / 4)
    adv, _ = core_algos.compute_grpo_outcome_advantage(kept["token_level_rewards"], kept["response_mask"], kept["uid"])
    # group 0 is two episodes (10 and 12): the unscored 11 is in neither its mean nor its spread
    by_hand = (1.5 - (1.5 + 0.7) / 2) / (torch.tensor([1.5, 0.7]).std().item() + 1e-6)
    assert adv[0, 1].item() == pytest.approx(by_hand, rel=1e-5)


def test_too_many_unscored_stop_the_run_naming_the_first_failure():
    batch = batch_of([0.0] * 4, groups=[0, 0, 1, 1])
    verdicts = {10: verdict(None), 11: verdict(None), 12: verdict(0.3), 13: verdict(None)}
    with pytest.raises(JudgeFailure, match=r"3 of 4 episodes of the train split unscored .* = 0.5.*timeout"):
        add_judge_scores(batch, verdicts, JudgeConfig(), "train")
    kept, metrics = add_judge_scores(batch_of([0.0] * 4, [0, 0, 1, 1]), verdicts,
                                     JudgeConfig(max_unscored_fraction=0.75), "val")
    assert len(kept) == 1 and metrics["val/judge/unscored"] == 3
    with pytest.raises(JudgeFailure, match="4 of 4"):  # all of them: nothing left to train on, whatever the fraction
        add_judge_scores(batch_of([0.0] * 4, [0, 0, 1, 1]), {k: verdict(None) for k in range(10, 14)},
                         JudgeConfig(max_unscored_fraction=1.0), "train")


def test_the_example_config_runs_against_the_example_judge(tiny_model_path, monkeypatch):
    """config/arith_grpo_judge.yaml passes the start-up checks with its key set, and examples/judge/rule_judge.py
    answers its ranking calls (docs/rewards.md, "Judges")."""
    from agent_trainer.gateway.server import GatewayServer
    from agent_trainer.checks.prepare import compose_and_prepare
    from examples.judge.rule_judge import make_app

    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="JUDGE_API_KEY"):
        compose_and_prepare([f"model_path={tiny_model_path}"], "arith_grpo_judge")
    monkeypatch.setenv("JUDGE_API_KEY", "sk-example")
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}"], "arith_grpo_judge")
    assert cfg.judge.enable and cfg.judge.mode == "ranking"
    with GatewayServer(make_app("sk-example")) as server:
        cfg.judge.base_url = f"http://127.0.0.1:{server.port}/v1"
        replies = ["<answer>2</answer>", "it is 2", "no idea"]
        items = [JudgeItem(i, 0, f"user\nWhat is 1 + 1?\nassistant\n{r}") for i, r in enumerate(replies)]
        verdicts, stats = JudgeClient(cfg.judge).judge(items)
    assert [verdicts[i].score for i in range(3)] == [1.0, 0.5, 0.0] and stats.calls == 1
