"""The condensed context manager wired to condensers and trajectory rewards, over the real question environment.

A scripted turn loop (the rollout's, with scripted replies and a scripted summary writer
standing in for the engine) plays the shipped math and coding sets through a real
``EnvStateManager``; the context manager condenses every prompt through the configured
condenser and scores every finished trajectory with the configured reward computer.
"""

from __future__ import annotations

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.common import profiling
from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.checks.load import load_config
from agent_trainer.config.multiturn import ContextCondenserConfig
from agent_trainer.episode.prompt_data import dataset_env_tags
from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
from agent_trainer.config.rewards import TRAIN_TAG
from agent_trainer.trajectory_rewards import RewardComputationConfig
from tests.agent_trainer.conftest import reply_ids

MATH, CODING = "data/math/train.jsonl", "data/coding/train.jsonl"
STEP = "<answer>first I add the numbers</answer>"
SUMMARY = "SUMMARY: added the numbers."


def question_env(files: str, episodes: int = 2, max_turns: int = 4) -> EnvStateManager:
    """``episodes`` episodes of the question env over ``files``, one group."""
    cfg = load_config({"data": {"train_files": [files], "max_turns": max_turns},
                       "agent_proxy": {"max_turn": max_turns},
                       "es_manager": {"train": {"env_configs": {"tags": [TRAIN_TAG], "n_groups": [4]}},
                                      "val": {"env_configs": {"tags": [TRAIN_TAG], "n_groups": [4]}}}})
    specs = [EpisodeSpec(env_id=i, group_id=0, tag=TRAIN_TAG) for i in range(episodes)]
    return EnvStateManager(dataset_env_tags(cfg), specs, format_penalty=-0.1)


class ScriptedSummaries:
    """Stands in for the engines in ``write_summaries``: returns SUMMARY for every request, records the calls."""

    def __init__(self, tokenizer):
        self.ids = reply_ids(tokenizer, SUMMARY)
        self.calls: list[tuple[list[list[int]], list[int], float]] = []

    def __call__(self, prompts, budgets, temperature):
        self.calls.append((prompts, budgets, temperature))
        return [(self.ids[:b], [0.0] * min(b, len(self.ids))) for b in budgets]


def drive(tokenizer, ctx_mgr, manager, replies: dict[int, list[str]], max_turn: int, summaries=None):
    """The rollout's turn loop: summaries first (as ``TurnLoop.play`` does), then generate and step."""
    episodes = {o.env_id: ctx_mgr.start(o) for o in manager.reset({0: 0})}
    timings = profiling.TurnTimings()
    for turn in range(max_turn):
        if summaries is not None:
            ctx_mgr.write_summaries(episodes.values(), summaries)
        active = [e for e in episodes.values() if not e.done]
        if not active:
            break
        with timings.phase("generate", turn):
            inputs = [ctx_mgr.append_reply(e, ids, [0.0] * len(ids)) for e in active
                      for ids in [reply_ids(tokenizer, replies[e.env_id][min(turn, len(replies[e.env_id]) - 1)])]]
        with timings.phase("env_step", turn):
            outputs = manager.step(inputs)
        for out in outputs:
            ctx_mgr.append_env_output(episodes[out.env_id], out, response_length=32)
    return [episodes[k] for k in sorted(episodes)], timings


def truth_of(manager, env_id: int) -> str:
    """The ground truth of the row ``env_id`` serves (the group's seed 0 picks the same row in ``drive``)."""
    if manager.episodes[env_id].env.record is None:
        manager.reset({0: 0})
    return str(manager.episodes[env_id].env.record.ground_truth)


def test_summary_tokens_are_context_never_a_trained_token(tokenizer):
    manager = question_env(MATH, episodes=2, max_turns=4)
    cfg = ContextCondenserConfig(type="summary", keep_last_n_steps=1, max_condensed_tokens=1024,
                                 summary_max_tokens=16)
    ctx_mgr = CondensedContextManager(tokenizer, enable_think=False, condenser=cfg, max_model_len=2048)
    writer = ScriptedSummaries(tokenizer)
    episodes, _ = drive(tokenizer, ctx_mgr, manager, {0: [STEP], 1: [STEP]}, max_turn=4, summaries=writer)
    # after turn 2 the steps older than the last one are summarised: turns 3 and 4 each need one (1-1, 1-2)
    assert [len(p) for p, _, _ in writer.calls] == [2, 2] and all(b == [16, 16] for _, b, _ in writer.calls)
    assert all(t == 0.0 for _, _, t in writer.calls)  # greedy by default
    for ep in episodes:
        assert ep.num_turns == 4 and [s.covers_steps for s in ep.summaries] == [1, 2]
        assert "Summary of turns 1-2:\n" + SUMMARY in tokenizer.decode(ep.rows[3].prompt_ids)
    batch = ctx_mgr.build_update_batch(episodes)
    shown = 0
    for row in range(len(batch)):
        ids, mask = batch["input_ids"][row].tolist(), batch["response_mask"][row].tolist()
        assert [t for t, m in zip(ids, mask) if m] == reply_ids(tokenizer, STEP)  # mask 1: exactly the reply
        context = tokenizer.decode([t for t, m, a in zip(ids, mask, batch["attention_mask"][row]) if a and not m])
        shown += SUMMARY in context
    assert shown == 4  # turns 3 and 4 of both episodes show the summary, in their mask-0 context only
    assert len(batch) == 8  # and no row was made of a summary


def test_simple_through_the_manager_reproduces_the_keep_last_n_turns_prompts(tokenizer, play_mixed):
    legacy = play_mixed(CondensedContextManager(tokenizer, keep_last_n_turns=1, max_model_len=4096))
    cfg = ContextCondenserConfig(type="simple", keep_last_n_steps=1, max_condensed_tokens=4096)
    wired = play_mixed(CondensedContextManager(tokenizer, condenser=cfg, max_model_len=4096))
    assert dict(wired.prompts) == dict(legacy.prompts) and len(wired.prompts[1]) == 4


def _rewards(**kw) -> RewardComputationConfig:
    return RewardComputationConfig(enable=True, **kw)


def test_math_trajectory_reward_is_scale_over_the_longest_row_when_right_and_zero_otherwise(tokenizer):
    manager = question_env(MATH, episodes=3, max_turns=3)
    truth = truth_of(manager, 0)
    replies = {0: [STEP, f"<answer>Final answer: {truth}</answer>"],
               1: [STEP, "<answer>Final answer: 123456</answer>"],
               2: [STEP, "Final answer: " + truth]}  # no <answer> block: bad format
    ctx_mgr = CondensedContextManager(tokenizer, enable_think=False, max_model_len=2048,
                                      rewards=_rewards(domain="math", env_reward_weight=0.0))
    episodes, _ = drive(tokenizer, ctx_mgr, manager, replies, max_turn=3)
    assert all(truth_of(manager, e) == truth for e in (1, 2))  # one group: every episode serves the same row
    batch = ctx_mgr.build_update_batch(episodes)
    got = [e.trajectory_reward for e in episodes]
    assert [g.correct for g in got] == [True, False, False] and got[2].reason.startswith("format")
    assert got[0].max_context_length == episodes[0].longest_row
    assert got[0].reward == pytest.approx(1000.0 / episodes[0].longest_row)
    # env rewards weighted 0: every trajectory's token rewards sum to its R alone, on its last row's last token
    for env_id, ep in enumerate(episodes):
        rows = (batch["traj_uid"] == env_id).nonzero().flatten().tolist()
        assert batch["token_level_rewards"][rows].sum().item() == pytest.approx(got[env_id].reward)
        last = int(batch["attention_mask"][rows[-1]].sum()) - 1
        assert batch["token_level_rewards"][rows[-1], last].item() == pytest.approx(got[env_id].reward)
    # grpo_multiturn: the trajectory's advantage on every output token of all its rows
    adv, _ = core_algos.compute_advantage(batch.tensors, "grpo_multiturn")
    for env_id in range(3):
        rows = batch["traj_uid"] == env_id
        mask = batch["response_mask"][rows].bool()
        values = adv[rows][mask]
        assert torch.allclose(values, values[0].expand_as(values)) and adv[rows][~mask].abs().sum() == 0
    assert ctx_mgr.last_rewards is not None and len(ctx_mgr.last_rewards.rewards) == 3


def test_env_and_trajectory_rewards_combine_by_their_weights(tokenizer):
    manager = question_env(MATH, episodes=1, max_turns=2)
    right = f"<answer>Final answer: {truth_of(manager, 0)}</answer>"
    ctx_mgr = CondensedContextManager(tokenizer, enable_think=False, max_model_len=2048,
                                      rewards=_rewards(domain="math", env_reward_weight=0.5,
                                                       trajectory_reward_weight=2.0))
    episodes, _ = drive(tokenizer, ctx_mgr, manager, {0: ["no answer block", right]}, max_turn=2)
    ctx_mgr.build_update_batch(episodes)
    ep = episodes[0]
    # turn 1: format penalty -0.1; turn 2: the env's score 1.0; R on top
    assert ep.total_reward == pytest.approx(0.5 * (-0.1 + 1.0) + 2.0 * ep.trajectory_reward.reward)


def test_coding_trajectories_run_the_rows_tests_in_the_sandbox(tokenizer):
    manager = question_env(CODING, episodes=3, max_turns=2)
    truth_of(manager, 0)
    reference = manager.episodes[0].env.record.extra_info["reference"]
    replies = {0: [f"<answer>Final answer: ```python\n{reference}```</answer>"],
               1: ["<answer>Final answer: ```python\nwhile True:\n    pass\n```</answer>"],
               2: ["<answer>Final answer: ```python\ndef nothing():\n    return None\n```</answer>"]}
    limits = {"wall_s": 3.0, "cpu_s": 2}
    ctx_mgr = CondensedContextManager(tokenizer, enable_think=False, max_model_len=2048,
                                      rewards=_rewards(domain="coding", env_reward_weight=0.0, sandbox=limits))
    episodes, _ = drive(tokenizer, ctx_mgr, manager, replies, max_turn=2)
    ctx_mgr.build_update_batch(episodes)
    got = [e.trajectory_reward for e in episodes]
    assert got[0].correct and got[0].reward > 0
    assert not got[1].correct and got[1].reward == 0 and "timed out" in got[1].reason \
        and got[1].seconds >= limits["cpu_s"]  # stopped by a limit, after its CPU seconds (load only delays that)
    assert not got[2].correct and got[2].reward == 0


def test_profile_metrics_measure_time_and_context_before_and_after_condensation(tokenizer):
    manager = question_env(MATH, episodes=2, max_turns=4)
    cfg = ContextCondenserConfig(type="summary", keep_last_n_steps=1, max_condensed_tokens=1024,
                                 summary_max_tokens=16)
    ctx_mgr = CondensedContextManager(tokenizer, enable_think=False, condenser=cfg, max_model_len=2048,
                                      rewards=_rewards(domain="math"))
    episodes, timings = drive(tokenizer, ctx_mgr, manager, {0: [STEP], 1: [STEP]}, max_turn=4,
                              summaries=ScriptedSummaries(tokenizer))
    ctx_mgr.build_update_batch(episodes)
    run = load_config({"trajectory_profiling": {"enable": True}})
    m = profiling.rollout_profile(run, ctx_mgr, timings, episodes, prefix="rollout")
    for turn in range(1, 5):
        rows = [e.rows[turn - 1] for e in episodes]
        assert m[f"profile/context_tokens_after_turn_{turn}"] == pytest.approx(
            sum(len(r.prompt_ids) for r in rows) / 2)
        assert m[f"profile/context_tokens_before_turn_{turn}"] == pytest.approx(
            sum(r.uncondensed_tokens for r in rows) / 2)
        assert m[f"timing_s/generate_turn_{turn}"] >= 0 and m[f"timing_s/env_step_turn_{turn}"] > 0
    assert m["timing_s/env_step"] == pytest.approx(sum(m[f"timing_s/env_step_turn_{k}"] for k in range(1, 5)))
    all_rows = [r for e in episodes for r in e.rows]
    assert m["profile/tokens_saved"] == sum(r.uncondensed_tokens - len(r.prompt_ids) for r in all_rows)
    assert m["profile/context_tokens_before_turn_4"] > m["profile/context_tokens_before_turn_2"]  # full grows
    assert m["profile/summaries"] == 4 and m["profile/summary_tokens"] > 0
    assert m["timing_s/condensation"] >= m["timing_s/summary_generate"] > 0
    assert m["timing_s/reward_computation"] > 0 and m["rollout/correct_rate"] == 0.0
    # off: only the reward rates remain; the groups follow their switches
    assert set(profiling.rollout_profile(load_config({}), ctx_mgr, timings, episodes, "rollout")) == {
        "rollout/trajectory_reward_mean", "rollout/correct_rate", "rollout/format_ok_rate"}
    no_condense = load_config({"trajectory_profiling": {"enable": True, "profile_context_condensation": False}})
    val = profiling.rollout_profile(no_condense, ctx_mgr, timings, episodes, prefix="val")
    assert "val/timing_s/generate" in val and not any("context_tokens" in k for k in val)
