"""Untrusted text from environments and the model: surrogates, NUL, megabytes, wrong types, huge replies.

No Ray here: the env-state manager and the context manager are plain classes.
"""

from __future__ import annotations

import math
import time

import pytest
from transformers import AutoTokenizer

from agent_trainer.agents.ctx_manager import ContextManager
from agent_trainer.episode.es_manager import EnvInput, EnvStateManager, EpisodeSpec, clean_text
from envs import EnvTagConfig


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _manager(fault: str, **config) -> EnvStateManager:
    tag = EnvTagConfig(env_type="envs.examples.faulty:FaultyEnv", max_actions_per_traj=3, env_instruction="Play.",
                       max_tokens=24, env_config={"fault": fault, **config})
    return EnvStateManager({"Faulty": tag}, [EpisodeSpec(env_id=0, group_id=0, tag="Faulty")],
                           max_observation_chars=1000)


def test_clean_text_replaces_surrogates_and_nul_and_caps_length():
    assert clean_text("a\ud800b\x00c", 100) == "a\ufffd\ufffd\ufffdbc"
    capped = clean_text("x" * 5000, 1000)
    assert capped.startswith("x" * 1000) and "4000 more characters cut" in capped and len(capped) < 1100


def test_surrogate_observation_reaches_the_prompt_safely(tokenizer):
    manager = _manager("surrogates")
    out = manager.reset({0: 7})[0]
    assert "\ud800" not in out.observation and "\x00" not in out.observation and "\ufffd" in out.observation
    ctx_manager = ContextManager(tokenizer)
    ctx = ctx_manager.start(out)
    assert ctx.token_ids
    step = manager.step([EnvInput(env_id=0, llm_response="<answer>go</answer>", actions=["go"])])[0]
    ctx_manager.append_reply(ctx, tokenizer.encode("<answer>go</answer>") + [tokenizer.eos_token_id], [0.0] * 99)
    ctx_manager.append_env_output(ctx, step, 24)
    assert not step.info.get("error") and ctx.token_ids[-1] != tokenizer.eos_token_id
    # the context manager is safe on its own too (a raw surrogate, as from a custom env manager)
    raw = ctx_manager.start(type(out)(**{**vars(out), "observation": "raw \udfff text \x00"}))
    assert raw.token_ids


def test_megabyte_observation_is_cut_with_a_marker(capfd):
    manager = _manager("megabytes", chars=300_000)
    out = manager.reset({0: 1})[0]
    assert len(out.observation) < 1100 and "299000 more characters cut" in out.observation
    step = manager.step([EnvInput(env_id=0, llm_response="", actions=["go"])])[0]
    assert len(step.observation) < 1100 and not step.info.get("error")
    assert len(capfd.readouterr().out) >= 600_000  # what it printed went to stdout, not into the prompt


@pytest.mark.parametrize("fault, message", [("wrong_types", "observation of type int"),
                                            ("raise_step", "injected step failure")])
def test_a_broken_step_ends_the_episode_with_its_error(fault, message):
    manager = _manager(fault)
    manager.reset({0: 3})
    out = manager.step([EnvInput(env_id=0, llm_response="", actions=["go"])])[0]
    assert out.done and message in out.info["error"]
    state = manager.get_rollout_states()[0]
    assert state.metrics["error"] == 1.0 and message in state.error


def test_a_str_reward_is_an_error_and_a_nan_reward_passes_to_the_rollout_screen():
    from agent_trainer.episode.es_manager import _reward

    with pytest.raises(TypeError, match="reward of type str"):
        _reward("high")
    assert _reward(True) == 1.0
    manager = _manager("nan_reward")
    manager.reset({0: 3})
    out = manager.step([EnvInput(env_id=0, llm_response="", actions=["go"])])[0]
    assert math.isnan(out.reward) and not out.done  # algorithm.nonfinite_reward decides (e2e: dropped)


def test_a_raising_reset_is_reported_not_raised():
    out = _manager("raise_reset").reset({0: 11})[0]
    assert out.done and "injected reset failure (seed 11)" in out.info["error"]


def test_a_100k_character_unclosed_answer_reply_is_parsed_in_under_a_second(tokenizer):
    ctx_manager = ContextManager(tokenizer)
    ctx = ctx_manager.start(_manager("none").reset({0: 0})[0])
    reply = tokenizer.encode("<answer>" * 12_500)  # 100,000 characters, never closed
    start = time.perf_counter()
    env_input = ctx_manager.append_reply(ctx, reply, [0.0] * len(reply))
    assert time.perf_counter() - start < 1.0
    assert env_input.actions == [] and ctx.format_errors == 1 and len(env_input.llm_response) >= 100_000
