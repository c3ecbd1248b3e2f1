"""Batch building: token-in/token-out sequences, loss masks and reward placement over real episodes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from agent_trainer import core_algos
from agent_trainer.common import prompts
from agent_trainer.agents.ctx_manager import ContextManager, as_ids, anchor_id
from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
from envs import load_env_tags

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture()
def manager():
    tags = load_env_tags()
    episodes = [EpisodeSpec(env_id=0, group_id=0, tag="FrozenLake"), EpisodeSpec(env_id=1, group_id=0, tag="FrozenLake")]
    return EnvStateManager(tags, episodes, format_penalty=-0.1)


def _reply(tokenizer, text: str, eos: bool = True) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + ([tokenizer.eos_token_id] if eos else [])


def test_multi_turn_masks_and_rewards(tokenizer, manager):
    ctx_mgr = ContextManager(tokenizer, max_model_len=4096)
    ctxs = {o.env_id: ctx_mgr.start(o) for o in manager.reset({0: 123})}
    prompt_len = len(ctxs[0].token_ids)
    assert ctxs[0].token_ids == ctxs[1].token_ids  # same group, same seed, same prompt
    assert sum(ctxs[0].response_mask) == 0

    replies = {
        0: [_reply(tokenizer, "<think>a</think><answer>Left</answer>"), _reply(tokenizer, "garbage")],
        1: [_reply(tokenizer, "no format here", eos=False), _reply(tokenizer, "<think>b</think><answer>Up</answer>")],
    }
    generated_positions = {0: [], 1: []}
    for turn in range(2):
        inputs = []
        for env_id, ctx in ctxs.items():
            ids = replies[env_id][turn]
            start = len(ctx.token_ids)
            inputs.append(ctx_mgr.append_reply(ctx, ids, [-0.5] * len(ids)))
            generated_positions[env_id].append(list(range(start, start + len(ids))))
        for out in manager.step(inputs):
            ctx_mgr.append_env_output(ctxs[out.env_id], out, response_length=32)

    batch = ctx_mgr.build_update_batch([ctxs[0], ctxs[1]])
    T = batch["input_ids"].shape[1]
    for row, env_id in enumerate((0, 1)):
        ctx = ctxs[env_id]
        expected_mask = torch.zeros(T, dtype=torch.long)
        for positions in generated_positions[env_id]:
            expected_mask[positions] = 1
        # the mask covers exactly the ids the "engine" produced, nothing else
        assert torch.equal(batch["response_mask"][row], expected_mask)
        assert batch["response_mask"][row, :prompt_len].sum() == 0
        # the sequence holds the generated ids verbatim (token-in/token-out)
        for positions, ids in zip(generated_positions[env_id], replies[env_id]):
            assert batch["input_ids"][row, positions].tolist() == ids
            assert torch.allclose(batch["rollout_log_probs"][row, positions], torch.full((len(ids),), -0.5))
        # one reward per turn, on that turn's last generated token
        nonzero = batch["token_level_rewards"][row].nonzero().flatten().tolist()
        last_tokens = [p[-1] for p in generated_positions[env_id]]
        assert set(nonzero) <= set(last_tokens)
        assert batch["attention_mask"][row].sum() == len(ctx.token_ids)
    # env 0: valid first turn (no penalty), garbage second turn -> format penalty on turn 2's last token
    assert batch["token_level_rewards"][0, generated_positions[0][1][-1]] == pytest.approx(-0.1)
    # env 1: the cut-off reply got an eos appended with mask 0, and a penalty
    cut = generated_positions[1][0][-1]
    assert batch["input_ids"][1, cut + 1] == tokenizer.eos_token_id and batch["response_mask"][1, cut + 1] == 0
    assert batch["token_level_rewards"][1, cut] == pytest.approx(-0.1)
    assert batch["uid"].tolist() == [0, 0] and batch["traj_uid"].tolist() == [0, 1]
    # positions count real tokens only; padding sits on the right
    assert torch.equal(batch["position_ids"][0, : len(ctxs[0].token_ids)], torch.arange(len(ctxs[0].token_ids)))


def test_observation_tokens_follow_the_chat_template(tokenizer, manager):
    """Sequence built turn by turn decodes to exactly the chat template's rendering of the conversation."""
    ctx_mgr = ContextManager(tokenizer, max_model_len=4096)
    out = manager.reset({0: 7})[0]
    ctx = ctx_mgr.start(out)
    reply = "<think>x</think><answer>Down</answer>"
    env_in = ctx_mgr.append_reply(ctx, _reply(tokenizer, reply), [0.0] * 20)
    step_out = [o for o in manager.step([env_in]) if o.env_id == 0][0]
    ctx_mgr.append_env_output(ctx, step_out, response_length=32)
    text = tokenizer.decode(ctx.token_ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert f"{reply}<|im_end|>\n<|im_start|>user\n" in text


def test_episode_truncates_when_the_next_turn_would_not_fit(tokenizer, manager):
    ctx_mgr = ContextManager(tokenizer, max_model_len=1)  # nothing fits after the first reply
    out = manager.reset({0: 1})[0]
    ctx = ctx_mgr.start(out)
    env_in = ctx_mgr.append_reply(ctx, _reply(tokenizer, "<think>x</think><answer>Down</answer>"), [0.0] * 20)
    step_out = [o for o in manager.step([env_in]) if o.env_id == 0][0]
    ctx_mgr.append_env_output(ctx, step_out, response_length=32)
    assert ctx.done and (ctx.truncated or step_out.done)


def test_anchor_ids_are_stable_across_processes_and_tell_texts_apart():
    texts = ["_ P _\n_ O G", "_ P _\n_ O G ", "P _ _\n_ O G", "grille ☃ ü", ""]
    ids = [anchor_id(t) for t in texts]
    assert len(set(ids)) == len(texts) and all(0 <= i < 2**63 for i in ids)
    assert [anchor_id(t) for t in texts] == ids
    code = ("import json, sys; from agent_trainer.agents.ctx_manager import anchor_id; "
            "print(json.dumps([anchor_id(t) for t in json.loads(sys.argv[1])]))")
    for hash_seed in ("1", "2"):  # python's own str hash differs between these two processes
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(texts)], cwd=REPO, capture_output=True,
                              text=True, check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert json.loads(proc.stdout) == ids


def test_full_rows_carry_each_turns_anchor_on_all_its_tokens(tokenizer, play_mixed, mixed_manager):
    ctx_mgr = ContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    history = {s.env_id: s.history for s in mixed_manager.get_rollout_states()}
    assert batch["anchor_obs_ids"].shape == batch["input_ids"].shape
    for row, env_id in enumerate(sorted(played.episodes)):
        turns, anchors = batch["turn_ids"][row], batch["anchor_obs_ids"][row]
        n = int(batch["attention_mask"][row].sum())
        assert (anchors[:n][turns[:n] == 0] == 0).all() and (anchors[n:] == 0).all()  # prompt, padding
        assert len(history[env_id]) == int(turns.max()) >= 1
        for k, turn in enumerate(history[env_id], start=1):  # turn k: the observation it answered
            assert set(anchors[:n][turns[:n] == k].tolist()) == {anchor_id(turn.observation)}
    # episodes 0 and 1 share their group's seed, so their first turns answered the same state
    first = [int(batch["anchor_obs_ids"][row][batch["turn_ids"][row] == 1][0]) for row in (0, 1)]
    assert first[0] == first[1]
    # GiGPO reads these anchors: the step-level term changes the advantages
    adv, _ = core_algos.compute_advantage(batch.tensors, "gigpo", gamma=0.9, step_advantage_w=1.0)
    episode_only, _ = core_algos.compute_advantage(batch.tensors, "gigpo", gamma=0.9, step_advantage_w=0.0)
    assert torch.isfinite(adv).all() and not torch.equal(adv, episode_only)


def test_observation_ids_are_rendered_once_per_distinct_message(tokenizer, monkeypatch):
    """The observation cache returns what rendering returns, renders each distinct message once, and a
    caller that changes its copy changes nothing in the cache."""
    import agent_trainer.agents.ctx_manager as ctx_module

    ctx_mgr = ContextManager(tokenizer)
    messages = [{"role": "user", "content": "Reward: 0\nYou are at (1, 2)."},
                {"role": "tool", "content": "Reward: 0\nYou are at (1, 2)."}, "Reward: 1\nGoal reached."]
    expected = [ctx_mgr._render_observation(m if isinstance(m, dict) else {"role": "user", "content": m})
                for m in messages]
    rendered = []
    render = ctx_mgr._render_observation
    monkeypatch.setattr(ctx_mgr, "_render_observation", lambda m: rendered.append(m) or render(m))
    for _ in range(3):
        got = [ctx_mgr._observation_ids(m) for m in messages]
        assert got == expected
        got[0].append(-1)
    assert len(rendered) == 3  # the role is part of the key: a tool message renders differently
    assert expected[0] != expected[1]
    monkeypatch.setattr(ctx_module, "OBSERVATION_CACHE_SIZE", 3)
    assert ctx_mgr._observation_ids("a fourth text") == render({"role": "user", "content": "a fourth text"})
    assert len(ctx_mgr._observation_cache) == 1  # full: cleared before the new entry


def test_first_prompts_are_rendered_once_per_distinct_text_and_tools(tokenizer, manager, monkeypatch):
    """A group's episodes start from one observation: the template renders it once; each episode gets its own ids,
    the template's own, and different tools render apart."""
    ctx_mgr = ContextManager(tokenizer, max_model_len=4096)
    calls = []
    apply = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **kw: calls.append(kw.get("tools")) or apply(
        *a, **kw))
    outs = manager.reset({0: 123})
    first, second = ctx_mgr.start(outs[0]), ctx_mgr.start(outs[1])
    assert len(calls) == 1 and first.token_ids == second.token_ids and first.token_ids is not second.token_ids
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert ctx_mgr._chat_prompt_ids("x", tools=tool) == as_ids(apply(
        [{"role": "system", "content": prompts.SYSTEM_PROMPT}, {"role": "user", "content": "x"}], tools=tool,
        add_generation_prompt=True, tokenize=True))
    ctx_mgr._chat_prompt_ids("x")
    assert calls == [None, tool, None]  # cached ids never served across different tools
