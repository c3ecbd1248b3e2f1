"""Pluggable agents (agent_trainer/agents): selection, the framework's batch-contract check, the tool-calling agent."""

from __future__ import annotations

import copy
import json

import pytest

from agent_trainer.agents.base import Agent
from agent_trainer.agents.contract import BatchContractError, check_batch_contract
from agent_trainer.agents.registry import AGENTS, resolve_agent_cls
from agent_trainer.agents.tool_call import ToolCallAgent, env_tools, parse_tool_calls
from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.agents.ctx_manager import ContextManager
from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.rollout import make_context_manager
from envs import load_env_tags
from tests.agent_trainer.agents_example import (
    CountingAgent,
    NotAnAgent,
    ObservationMaskAgent,
    RetokenizingAgent,
)
from tests.agent_trainer.conftest import MIXED_REPLIES, play

EXAMPLE = "tests.agent_trainer.agents_example"


def _cfg(agent_cls: str | None = None, mode: str = "full") -> AgentTrainerConfig:
    cfg = AgentTrainerConfig()
    cfg.agent_proxy.agent_cls, cfg.ctx_manager.mode = agent_cls, mode
    return cfg


# -- selection -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, cls", [
    (None, ContextManager), ("full", ContextManager), ("tool_call", ToolCallAgent),
    (f"{EXAMPLE}.CountingAgent", CountingAgent), (f"{EXAMPLE}:CountingAgent", CountingAgent),
])
def test_agent_cls_names_a_registered_agent_or_an_import_path(name, cls):
    assert resolve_agent_cls(_cfg(name)) is cls
    assert resolve_agent_cls(_cfg(None, mode="condensed")) is CondensedContextManager
    assert set(AGENTS.names()) >= {"full", "condensed", "tool_call"}
    assert issubclass(cls, Agent)


@pytest.mark.parametrize("name, mode, words", [
    ("no_such_agent", "full", ["agent_proxy.agent_cls = 'no_such_agent' is unknown", "tool_call"]),
    (f"{EXAMPLE}.Missing", "full", ["agent_proxy.agent_cls", "could not be imported"]),
    ("nowhere.module.Agent", "full", ["agent_proxy.agent_cls", "could not be imported"]),
    (f"{EXAMPLE}.NotAnAgent", "full", ["agent_proxy.agent_cls", "is not a subclass of Agent"]),
    ("tool_call", "condensed", ["builds the full layout", "ctx_manager.mode = 'condensed'", "ctx_manager.mode=full"]),
    ("condensed", "full", ["builds the condensed layout", "set ctx_manager.mode=condensed"]),
])
def test_a_bad_agent_cls_is_refused_in_one_line_naming_the_key(name, mode, words):
    with pytest.raises(ValueError) as err:
        resolve_agent_cls(_cfg(name, mode))
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value), str(err.value)


def test_the_config_is_refused_before_ray_starts(tiny_model_path):
    with pytest.raises(SystemExit) as exit_info:
        compose_and_prepare([f"model_path={tiny_model_path}", f"agent_proxy.agent_cls={EXAMPLE}.NotAnAgent"])
    assert exit_info.value.code.startswith("agent-trainer: agent_proxy.agent_cls = ")
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", f"agent_proxy.agent_cls={EXAMPLE}.CountingAgent"])
    assert cfg.agent_proxy.agent_cls == f"{EXAMPLE}.CountingAgent"


def test_a_class_given_to_the_trainer_wins_and_must_be_an_agent(tokenizer):
    assert isinstance(make_context_manager(_cfg("tool_call"), tokenizer, CountingAgent), CountingAgent)
    with pytest.raises(ValueError, match="AgentTrainer.agent_cls='NotAnAgent'. is not a subclass"):
        resolve_agent_cls(_cfg(), NotAnAgent)


# -- the batch contract ----------------------------------------------------------------------
def _checked(tokenizer, agent, replies=MIXED_REPLIES, manager=None, max_turn=4):
    """Play scripted replies with ``agent``; check its batch like the rollout does."""
    if manager is None:
        manager = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=i, group_id=i // 2, tag=t) for i, t in
                                                    enumerate(["FrozenLake3x3"] * 2 + ["Bandit"] * 2)])
    played = play(tokenizer, agent, manager, {0: 11, 1: 12}, replies, max_turn)
    batch = agent.build_update_batch(list(played.episodes.values()))
    check_batch_contract(batch, played.generated, type(agent).__qualname__, lambda uid: f"episode {uid}")
    return played, batch


def test_the_built_in_agents_keep_the_contract(tokenizer):
    _checked(tokenizer, ContextManager(tokenizer, max_model_len=4096))
    _checked(tokenizer, CondensedContextManager(tokenizer, keep_last_n_turns=1, max_model_len=4096))
    _checked(tokenizer, CountingAgent(tokenizer, max_model_len=4096))


def test_an_agent_whose_mask_covers_an_observation_token_is_rejected(tokenizer):
    with pytest.raises(BatchContractError) as err:
        _checked(tokenizer, ObservationMaskAgent(tokenizer, max_model_len=4096))
    text = str(err.value)
    assert "agent ObservationMaskAgent broke the batch contract in episode 0" in text, text
    assert "row 0 position" in text and "response_mask 1 on token id" in text, text


def test_an_agent_that_retokenizes_the_reply_is_rejected(tokenizer):
    """The engine may sample a non-canonical tokenization (here: one id per character); re-encoding the
    decoded text merges them, so the ids trained on would not be the ones sampled."""
    def char_ids(text):
        return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]

    canonical = tokenizer.encode(MIXED_REPLIES[0][0], add_special_tokens=False)
    assert char_ids(MIXED_REPLIES[0][0]) != canonical  # the premise: these ids differ from a re-encoding
    agent = RetokenizingAgent(tokenizer, max_model_len=4096)
    manager = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=0, group_id=0, tag="FrozenLake3x3")])
    played = play(tokenizer, agent, manager, {0: 11}, {0: [MIXED_REPLIES[0][0]]}, max_turn=1)
    played.generated[0] = [char_ids(MIXED_REPLIES[0][0]) + [tokenizer.eos_token_id]]  # what the engine sampled
    batch = agent.build_update_batch(list(played.episodes.values()))
    with pytest.raises(BatchContractError, match=r"agent RetokenizingAgent broke the batch contract in episode 0: "
                                                 r"row 0 position \d+ has response_mask 1 on token id \d+, but the "
                                                 r"engine generated id \d+ there \(turn 1, token \d+\)"):
        check_batch_contract(batch, played.generated, "RetokenizingAgent", lambda uid: f"episode {uid}")


def test_a_mask_that_leaves_generated_tokens_out_is_rejected(tokenizer):
    agent = ContextManager(tokenizer, max_model_len=4096)
    played, batch = _checked(tokenizer, agent)
    generated = copy.deepcopy(played.generated)
    generated[2].append([5, 6])  # a turn the batch does not hold
    with pytest.raises(BatchContractError, match=r"response_mask covers \d+ of the \d+ generated tokens; the first "
                                                 r"left out is turn 2, token 0 \(id 5\)"):
        check_batch_contract(batch, generated, "ContextManager", str)
    del batch.tensors["rollout_log_probs"]
    with pytest.raises(BatchContractError, match=r"without \['rollout_log_probs'\]; build it with"):
        check_batch_contract(batch, played.generated, "ContextManager", str)


# -- the tool-calling agent ------------------------------------------------------------------
def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_tools_come_from_the_env_action_list():
    move = env_tools("Go.\nValid actions: Left | Down | Right | Up\nGive exactly one action per turn.")
    assert [t["function"]["name"] for t in move] == ["move"]
    assert move[0]["function"]["parameters"]["properties"]["direction"]["enum"] == ["Left", "Down", "Right", "Up"]
    arms = env_tools("Valid actions: Dragon | Phoenix")[0]["function"]
    assert arms["name"] == "act" and arms["parameters"]["properties"]["action"]["enum"] == ["Dragon", "Phoenix"]
    free = env_tools("Valid actions: an arithmetic expression using each number once")[0]["function"]
    assert free["name"] == "act" and "enum" not in free["parameters"]["properties"]["action"]


@pytest.mark.parametrize("text, actions, error", [
    (call("move", direction="Up"), ["Up"], ""),
    ("<think>down is safe</think>" + call("move", direction="Down") + call("move", direction="Left"),
     ["Down", "Left"], ""),
    ('<tool_call>{"name": "move", "arguments": "{\\"direction\\": \\"Right\\"}"}</tool_call>', ["Right"], ""),
    ("<answer>Up</answer>", [], "no <tool_call> block"),
    ('<tool_call>{"name": "move", "arguments": {"direction": "Up"}</tool_call>', [], "invalid JSON"),
    (call("jump", direction="Up"), [], "unknown tool 'jump'"),
    (call("move", direction="North"), [], "arguments do not fit move(direction)"),
    (call("move", where="Up"), [], "arguments do not fit move(direction)"),
    ("<tool_call>[" * 5000 + "</tool_call>", [], "tool call too long"),
    (call("move", direction="Up") + "<tool_call>{oops}</tool_call>", [], "invalid JSON"),
])
def test_tool_calls_parse_into_actions_or_a_format_error(text, actions, error):
    parsed = parse_tool_calls(text, env_tools("Valid actions: Left | Down | Right | Up"))
    assert (parsed.actions, parsed.error) == (actions, error)


def test_the_tool_agent_prompts_with_the_template_tool_format_and_acts_by_tool_calls(tokenizer):
    agent = ToolCallAgent(tokenizer, max_model_len=4096)
    manager = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=0, group_id=0, tag="FrozenLake3x3"),
                                                EpisodeSpec(env_id=1, group_id=0, tag="FrozenLake3x3")],
                              format_penalty=-0.1)
    replies = {0: [call("move", direction="Left")], 1: ['<tool_call>{"name": "move", "arguments"</tool_call>']}
    played, batch = _checked(tokenizer, agent, replies, manager, max_turn=2)
    first_prompt = tokenizer.decode(played.prompts[0][0])
    assert "# Tools" in first_prompt and '"name": "move"' in first_prompt and '"enum": ["Left", "Down", "Right", ' \
        '"Up"]' in first_prompt and "<tool_call>" in first_prompt
    second_prompt = tokenizer.decode(played.prompts[0][1])
    assert second_prompt.startswith(first_prompt)
    assert "<|im_start|>user\n<tool_response>\nReward: " in second_prompt[len(first_prompt):]
    good, bad = played.episodes[0], played.episodes[1]
    assert good.format_errors == 0 and bad.format_errors == 2
    assert [o.info["action_is_valid"] for o in played.outputs[0]] == [True, True]
    assert all(o.reward == pytest.approx(-0.1) for o in played.outputs[1])  # the format penalty, every turn
    assert batch["token_level_rewards"][1].sum().item() == pytest.approx(-0.2)


def test_the_tool_agent_refuses_a_template_without_a_tool_format(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(ValueError, match="needs a chat template with a tool format"):
        ToolCallAgent(plain)


def test_the_trainer_takes_an_agent_class_and_refuses_a_bad_one_before_any_worker(tokenizer, tiny_model_path,
                                                                                 tmp_path):
    from agent_trainer.training.trainer import AgentTrainer
    from agent_trainer.workers.build import build_workers

    cfg, tags = compose_and_prepare([f"model_path={tiny_model_path}", f"trainer.default_local_dir={tmp_path}"])
    with pytest.raises(ValueError, match="is not a subclass of agent_trainer.agents.base.Agent"):
        AgentTrainer(cfg, tokenizer, tags, agent_cls=NotAnAgent, build_workers=build_workers)
    trainer = AgentTrainer(cfg, tokenizer, tags, agent_cls=CountingAgent, build_workers=build_workers)
    assert trainer.agent_cls is CountingAgent
