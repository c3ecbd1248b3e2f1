"""Context condensers over scripted FrozenLake / Bandit episodes, hand-made and random trajectories (tiny tokenizer)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_trainer.checks.plugins import check_condenser
from agent_trainer.agents.condensed_ctx import CondensedContextManager, TurnRow
from agent_trainer.condensers import (
    ContextCondenser,
    Draft,
    SummaryCondenser,
    TrajectorySoFar,
    get_condenser_cls,
    list_condensers,
    make_condenser,
)
from agent_trainer.config.multiturn import ContextCondenserConfig
from agent_trainer.agents.ctx_manager import ContextManager, FullConversation


class Recording:
    """A context manager wrapper that keeps each episode's reset output (instruction, first observation)."""

    def __init__(self, inner):
        self.inner, self.starts = inner, {}

    def start(self, out):
        self.starts[out.env_id] = out
        return self.inner.start(out)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def played_trajectory(rec: Recording, played, env_id: int, k: int) -> TrajectorySoFar:
    """The trajectory of ``env_id`` before its turn k+1, from what the scripted rollout recorded."""
    start = rec.starts[env_id]
    traj = TrajectorySoFar(instruction=start.instruction, first_observation=start.observation)
    for j in range(k):
        out = played.outputs[env_id][j]
        traj.add_step(played.prompts[env_id][j], played.generated[env_id][j], out.observation, out.reward)
    return traj


def condenser(tokenizer, kind: str, generate=None, **cfg) -> ContextCondenser:
    return make_condenser(ContextCondenserConfig(type=kind, **cfg), tokenizer, generate=generate,
                          conversation=FullConversation(tokenizer))


def hand_made(tokenizer, n_steps: int) -> TrajectorySoFar:
    """Steps whose observations and answers name their step (obs-3, ans-3)."""
    traj = TrajectorySoFar(instruction="Find the goal.", first_observation="obs-0")
    for k in range(1, n_steps + 1):
        reply = tokenizer.encode(f"<think>step {k}</think><answer>ans-{k}</answer>", add_special_tokens=False)
        traj.add_step([1] * (10 * k), reply + [tokenizer.eos_token_id], f"obs-{k}", reward=0.5)
    return traj


@pytest.mark.parametrize("n", [0, 1, 2])
def test_simple_renders_the_same_ids_as_the_condensed_context_manager(tokenizer, play_mixed, n):
    rec = Recording(CondensedContextManager(tokenizer, keep_last_n_turns=n, max_model_len=4096))
    played = play_mixed(rec)
    simple = condenser(tokenizer, "simple", keep_last_n_steps=n, max_condensed_tokens=4096)
    compared = 0
    for env_id, prompts_seen in played.prompts.items():
        for k, expected in enumerate(prompts_seen):
            got = simple.condense(played_trajectory(rec, played, env_id, k))
            assert got.token_ids == expected, (env_id, k)
            assert got.kept_steps == min(n, k) and not got.truncated
            compared += 1
    assert compared >= 8


def test_full_renders_the_same_ids_as_the_full_context_manager(tokenizer, play_mixed):
    rec = Recording(ContextManager(tokenizer, max_model_len=4096))
    played = play_mixed(rec)
    full = condenser(tokenizer, "full", max_condensed_tokens=4096)
    for env_id, prompts_seen in played.prompts.items():
        for k, expected in enumerate(prompts_seen):
            got = full.condense(played_trajectory(rec, played, env_id, k))
            assert got.token_ids == expected
            assert got.num_tokens_before == got.num_tokens_after == len(expected) and got.kept_steps == k


def test_simple_keeps_exactly_the_last_n_steps(tokenizer):
    traj = hand_made(tokenizer, 6)
    for n in (0, 1, 3, 6, 9):
        got = condenser(tokenizer, "simple", keep_last_n_steps=n, max_condensed_tokens=4096).condense(traj)
        text = tokenizer.decode(got.token_ids)
        shown = [k for k in range(1, 7) if f"Your answer: ans-{k}\n" in text]
        assert shown == list(range(7 - min(n, 6), 7)) and got.kept_steps == min(n, 6)
        assert "Current observation (turn 7):\nobs-6" in text and "step 6" not in text  # answer view drops reasoning
        assert got.num_tokens_after < got.num_tokens_before  # the full conversation is longer
    reply_view = condenser(tokenizer, "simple", keep_last_n_steps=2, step_view="reply", max_condensed_tokens=4096)
    text = tokenizer.decode(reply_view.condense(traj).token_ids)
    assert "<think>step 6</think><answer>ans-6</answer>" in text and "step 4" not in text


def test_over_budget_simple_drops_the_oldest_shown_steps_first(tokenizer):
    traj = hand_made(tokenizer, 4)
    roomy = condenser(tokenizer, "simple", keep_last_n_steps=3, max_condensed_tokens=4096).condense(traj)
    budget = roomy.num_tokens_after - 5
    tight = condenser(tokenizer, "simple", keep_last_n_steps=3, max_condensed_tokens=budget).condense(traj)
    text = tokenizer.decode(tight.token_ids)
    assert tight.truncated and tight.kept_steps == 2 and len(tight.token_ids) <= budget
    assert "ans-4" in text and "ans-3" in text and "ans-2" not in text


def test_full_drops_whole_steps_and_truncate_keeps_the_task_and_the_latest_tokens(tokenizer):
    traj = hand_made(tokenizer, 5)
    full = condenser(tokenizer, "full", max_condensed_tokens=4096)
    task, segments = full.conversation.segments(traj)
    whole = task + [t for s in segments for t in s]
    budget = len(task) + len(segments[-1]) + len(segments[-2]) + 3  # room for the last two steps only
    dropped = condenser(tokenizer, "full", max_condensed_tokens=budget).condense(traj)
    assert dropped.token_ids == task + segments[-2] + segments[-1]
    assert dropped.kept_steps == 2 and dropped.truncated and dropped.num_tokens_before == len(whole)

    cut = condenser(tokenizer, "truncate", max_condensed_tokens=budget).condense(traj)
    assert cut.token_ids == task + whole[len(whole) - (budget - len(task)):]
    assert len(cut.token_ids) == budget and cut.truncated and not cut.task_truncated and cut.kept_steps == 2


def test_a_task_longer_than_the_budget_is_cut_in_the_middle_and_reported(tokenizer):
    traj = TrajectorySoFar(instruction="word " * 400, first_observation="the board")
    for kind in ("full", "truncate", "simple"):
        got = condenser(tokenizer, kind, max_condensed_tokens=64, summary_max_tokens=8).condense(traj)
        draft = get_condenser_cls(kind).build(condenser(tokenizer, kind, max_condensed_tokens=4096), traj).token_ids
        assert len(got.token_ids) == 64 and got.truncated and got.task_truncated, kind
        assert got.token_ids[:32] == draft[:32] and got.token_ids[32:] == draft[-32:]  # head and the newest tokens


def _random_trajectory(data, tokenizer) -> TrajectorySoFar:
    vocab = tokenizer.vocab_size
    words = st.text(alphabet="abcdefgh <>/0123456789\n", max_size=60)
    traj = TrajectorySoFar(instruction=data.draw(words), first_observation=data.draw(words))
    for _ in range(data.draw(st.integers(0, 6))):
        out = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
        ctx = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30))
        traj.add_step(ctx, out, data.draw(words), data.draw(st.floats(-1, 1)))
    return traj


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_condenser_ever_exceeds_its_budget(tokenizer, data):
    traj = _random_trajectory(data, tokenizer)
    budget = data.draw(st.integers(2, 400))
    vocab = tokenizer.vocab_size

    def generate(prompt_ids, max_tokens):
        return [(i * 7) % vocab for i in range(max_tokens + 5)]  # more than asked: the condenser must cut it

    for kind in ("full", "simple", "truncate", "summary"):
        c = condenser(tokenizer, kind, generate=generate, max_condensed_tokens=budget,
                      keep_last_n_steps=data.draw(st.integers(0, 4)), summary_max_tokens=max(1, budget // 4))
        got = c.condense(traj)
        assert len(got.token_ids) <= budget and got.num_tokens_after == len(got.token_ids), kind
        assert got.loss_mask == [0] * len(got.token_ids)
        draft = c.build(traj).token_ids if kind != "summary" else None
        if draft is not None:  # the newest tokens always survive (the next turn's assistant header)
            keep = min(len(draft), budget - budget // 2)
            assert got.token_ids[-keep:] == draft[-keep:], kind


class ScriptedPolicy:
    """Stands in for the rollout engine: returns the ids of a fixed summary and records each call."""

    def __init__(self, tokenizer, text="SUMMARY: went left twice, no goal yet."):
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.calls: list[tuple[list[int], int]] = []

    def __call__(self, prompt_ids, max_tokens):
        self.calls.append((list(prompt_ids), max_tokens))
        time.sleep(0.01)
        return self.ids[:max_tokens]


def test_summary_replaces_older_steps_and_its_tokens_are_never_trained_on(tokenizer):
    policy = ScriptedPolicy(tokenizer)
    summ = condenser(tokenizer, "summary", generate=policy, keep_last_n_steps=2, max_condensed_tokens=4096)
    traj = hand_made(tokenizer, 2)
    assert summ.condense(traj).summary is None and not policy.calls  # nothing older than the last 2 yet

    traj = hand_made(tokenizer, 5)
    got = summ.condense(traj)
    text = tokenizer.decode(got.token_ids)
    assert len(policy.calls) == 1 and got.summary is not None and got.summary.covers_steps == 3
    prompt_text = tokenizer.decode(policy.calls[0][0])
    assert all(f"ans-{k}" in prompt_text for k in (1, 2, 3)) and "ans-4" not in prompt_text
    assert "Summary of turns 1-3:\nSUMMARY: went left twice, no goal yet." in text
    assert [k for k in range(1, 6) if f"Your answer: ans-{k}\n" in text] == [4, 5]
    # timed: the call's own seconds, inside the condense call's seconds
    assert got.summary.seconds >= 0.01 and got.seconds >= got.summary.seconds
    # context, never loss: a training row built on this context has mask 1 only on the reply
    reply = tokenizer.encode("<answer>Up</answer>", add_special_tokens=False)
    row = TurnRow(turn=6, prompt_ids=got.token_ids, response_ids=reply, logprobs=[0.0] * len(reply))
    row = row.training_row(group_id=0, traj_id=0, tag="t")
    assert row.response_mask == [0] * len(got.token_ids) + [1] * len(reply)
    assert got.summary.loss_mask == [0] * len(got.summary.output_ids) and got.loss_mask == [0] * len(got.token_ids)

    # remembered: the next call reuses it while it covers every older step, then extends it incrementally
    traj.remember(got)
    again = summ.condense(traj)
    assert again.summary is None and len(policy.calls) == 1 and again.token_ids == got.token_ids
    traj.add_step([1] * 5, tokenizer.encode("<answer>ans-6</answer>", add_special_tokens=False), "obs-6")
    summ.condense(traj)
    second_prompt = tokenizer.decode(policy.calls[1][0])
    assert "Summary so far (turns 1-3)" in second_prompt and "ans-4" in second_prompt and "ans-2" not in second_prompt


def test_summary_with_the_tiny_policy_stays_in_budget(tokenizer, tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()

    def generate(prompt_ids, max_tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        return out[0, len(prompt_ids):].tolist()

    traj = hand_made(tokenizer, 4)
    got = condenser(tokenizer, "summary", generate=generate, keep_last_n_steps=1, max_condensed_tokens=300,
                    summary_max_tokens=16).condense(traj)
    assert got.summary is not None and 0 < len(got.summary.output_ids) <= 16 and len(got.token_ids) <= 300
    assert got.summary.text in tokenizer.decode(got.token_ids) or got.truncated


class TaskOnly(ContextCondenser):
    """A user condenser found by import path: the task prompt only."""

    def build(self, traj):
        ids = self.chat_prompt_ids(traj.instruction)
        return Draft(ids, head_len=len(ids), kept_steps=0)


def test_registry_finds_names_and_import_paths_and_names_the_key_on_errors(tokenizer):
    assert list_condensers() == ["full", "simple", "summary", "truncate"]
    path = f"{__name__}:TaskOnly"
    got = condenser(tokenizer, path, max_condensed_tokens=8).condense(hand_made(tokenizer, 1))
    assert len(got.token_ids) == 8 and got.truncated  # the budget holds for user condensers too
    with pytest.raises(ValueError, match=r"context_condenser.type = 'nope' is unknown; known: \['full'"):
        check_condenser(ContextCondenserConfig(type="nope"))  # the start-up check (agent_trainer.checks)
    with pytest.raises(ValueError, match="is not a subclass of ContextCondenser"):
        check_condenser(ContextCondenserConfig(type="agent_trainer.condensers.base:Draft"))
    with pytest.raises(ValueError, match="keep_last_n_steps = -1 must be an int >= 0"):
        ContextCondenserConfig(keep_last_n_steps=-1)
    with pytest.raises(ValueError, match="summary_max_tokens = 64 must be < .*max_condensed_tokens = 64"):
        ContextCondenserConfig(type="summary", max_condensed_tokens=64, summary_max_tokens=64)
    with pytest.raises(ValueError, match="step_view"):
        ContextCondenserConfig(step_view="all")
    with pytest.raises(RuntimeError, match="summary of turns 1-3 that was never generated"):
        SummaryCondenser(tokenizer, ContextCondenserConfig(type="summary")).condense(hand_made(tokenizer, 5))


def test_a_condenser_is_handed_its_conversation_layout(tokenizer):
    """The condensers sit below the agents: the whole conversation's layout is the full context manager's rendering,
    handed over by whoever builds the condenser; without it, a condenser that needs it says how to get one."""
    config = ContextCondenserConfig(type="full", keep_last_n_steps=2, max_condensed_tokens=4096)
    with pytest.raises(RuntimeError, match="has no conversation layout: build it with make_condenser"):
        make_condenser(config, tokenizer).condense(hand_made(tokenizer, 2))
    ctx_mgr = CondensedContextManager(tokenizer, condenser=config)
    assert isinstance(ctx_mgr.condenser.conversation, FullConversation)


def test_every_module_of_a_registry_package_is_imported_with_it():
    """Adding an estimator, a condenser or a reward computer is one new file: its package imports it."""
    import importlib
    import pkgutil
    import sys

    for package in ("agent_trainer.core_algos", "agent_trainer.condensers", "agent_trainer.trajectory_rewards"):
        path = importlib.import_module(package).__path__
        modules = [f"{package}.{m.name}" for m in pkgutil.iter_modules(path) if not m.name.startswith("_")]
        assert modules and all(name in sys.modules for name in modules), package
