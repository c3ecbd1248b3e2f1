"""The tool-calling agent's MCP tools (agent_trainer/agents/mcp_tools.py) against real MCP servers written with the
``mcp`` SDK's server: the example calculator (examples/mcp/calculator_server.py) over stdio and over streamable HTTP
on 127.0.0.1 with a key, and the tests' lookup server (mcp_test_server.py) that hangs or dies. No mocks: each server
is a process of its own, started by the test (stdio: by the toolbox).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agent_trainer.agents.mcp_tools import McpToolbox, tool_schema
from agent_trainer.agents.tool_call import ToolCallAgent, env_tools, parse_tool_calls
from agent_trainer.agents.contract import check_batch_contract
from agent_trainer.checks.services import check_tool_servers
from agent_trainer.config import McpServerConfig
from agent_trainer.config.splits import Split
from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
from agent_trainer.rollout.results import leave_out_service_failures, tool_call_metrics
from agent_trainer.observe.trajectories import episode_record
from envs import load_env_tags
from mcp_calculator import free_port, http_calculator as served_calculator
from tests.agent_trainer.conftest import play

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = McpServerConfig(name="calc", command=["python", str(REPO / "examples/mcp/calculator_server.py")])


def lookup_server(tmp_path, crash_at: int = 0, call_timeout_s: float = 30.0) -> McpServerConfig:
    """The tests' lookup server over stdio; with ``crash_at`` it kills itself during that lookup call."""
    os.environ["MCP_TEST_CALLS_FILE"] = str(tmp_path / "calls.txt")
    os.environ["MCP_TEST_CRASH_AT"] = str(crash_at)
    return McpServerConfig(name="lookup", command=["python", str(REPO / "tests/agent_trainer/mcp_test_server.py")],
                           env_vars=["MCP_TEST_CALLS_FILE", "MCP_TEST_CRASH_AT"], call_timeout_s=call_timeout_s)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def calculator():
    box = McpToolbox([CALCULATOR]).connect()
    yield box
    box.close()


def test_the_servers_tools_are_listed_in_the_chat_templates_tool_format(calculator, tokenizer):
    assert [t["function"]["name"] for t in calculator.tools] == ["add", "subtract", "multiply", "divide"]
    add = calculator.tools[0]
    assert add["type"] == "function" and add["function"]["description"] == "a + b."
    assert add["function"]["parameters"]["properties"] == {"a": {"title": "A", "type": "number"},
                                                           "b": {"title": "B", "type": "number"}}
    assert add["function"]["parameters"]["required"] == ["a", "b"]
    assert tool_schema("t", None, None) == {"type": "function", "function": {
        "name": "t", "description": "", "parameters": {"type": "object", "properties": {}}}}
    agent = ToolCallAgent(tokenizer, toolbox=calculator, max_model_len=4096)
    manager = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=0, group_id=0, tag="FrozenLake3x3")])
    prompt = tokenizer.decode(agent.prompt_ids(agent.start(manager.reset({0: 3})[0])))
    assert '"name": "move"' in prompt and '"name": "add"' in prompt and '"name": "divide"' in prompt
    assert "their answers come back before your next turn" in prompt


def test_a_call_is_recorded_with_its_result_or_error_and_latency(calculator):
    ok = calculator.call("add", {"a": 2, "b": 3})
    assert (ok.server, ok.name, ok.arguments, ok.result, ok.error) == ("calc", "add", {"a": 2, "b": 3}, "5.0", "")
    assert ok.latency_s > 0 and not ok.service_failure
    assert ok.message() == {"role": "tool", "content": "add: 5.0"}
    zero = calculator.call("divide", {"a": 1, "b": 0})
    assert zero.result == "" and "division by zero" in zero.error and not zero.service_failure
    bad = calculator.call("add", {"a": "x"})  # the server checks the arguments against its schema
    assert "validation error" in bad.error and bad.message()["content"].startswith("add error: ")


def test_replies_name_env_actions_and_mcp_calls(calculator):
    tools = env_tools("Valid actions: Left | Down | Right | Up") + calculator.tools
    both = parse_tool_calls(call("add", a=1, b=2) + call("move", direction="Up"), tools, calculator.names)
    assert both.actions == ["Up"] and both.calls == [("add", {"a": 1, "b": 2})] and not both.error
    as_string = parse_tool_calls('<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 2, \\"b\\": 4}"}</tool_call>',
                                 tools, calculator.names)
    assert as_string.calls == [("multiply", {"a": 2, "b": 4})]
    assert parse_tool_calls(call("add").replace("{}", "[1, 2]"), tools, calculator.names).error == \
        "the arguments of add are not a JSON object"
    assert parse_tool_calls(call("add", a=1, b=2), tools[:1]).error == "unknown tool 'add'"  # not offered
    assert parse_tool_calls(call("add", a=1, b=2), tools).error == "unknown tool 'add'"  # no server: never raises


def test_a_tool_turn_does_not_step_the_env_and_the_calls_reach_the_trajectory(calculator, tokenizer):
    agent = ToolCallAgent(tokenizer, toolbox=calculator, max_model_len=4096)
    manager = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=0, group_id=0, tag="FrozenLake3x3")],
                              format_penalty=-0.1)
    replies = {0: [call("add", a=2, b=3), call("multiply", a=2, b=4) + call("move", direction="Left")]}
    played = play(tokenizer, agent, manager, {0: 11}, replies, max_turn=2)
    first, second = played.outputs[0]
    assert first.reward == 0.0 and first.info["tool_turn"] and not first.done  # no step, no penalty
    assert second.info["action_is_valid"] and second.info["num_actions"] == 1
    prompts = [tokenizer.decode(p) for p in played.prompts[0]]
    after_first = prompts[1][len(prompts[0]):]
    assert "<tool_response>\nadd: 5.0\n</tool_response>" in after_first and "Reward:" not in after_first
    state = manager.get_rollout_states()[0]
    assert [len(t.tool_calls) for t in state.history] == [1, 1] and state.history[0].actions == []
    assert state.history[1].tool_calls[0]["result"] == "8.0" and state.history[1].actions == ["Left"]
    assert state.metrics["num_actions"] == 1 and state.penalty == 0.0
    batch = agent.build_update_batch(list(played.episodes.values()))
    check_batch_contract(batch, played.generated, "ToolCallAgent", str)
    rows = [{"ids": batch["input_ids"][0].tolist(), "mask": batch["response_mask"][0].tolist(), "adv": [],
             "turn": batch["turn_ids"][0].tolist()}]
    record = episode_record(state, rows, tokenizer, step=1, split="train")
    assert [c["name"] for t in record.turns for c in t.tool_calls] == ["add", "multiply"]
    metrics = tool_call_metrics([state], "rollout")
    assert metrics["rollout/tool_calls_per_episode"] == 2 and metrics["rollout/tool_turns_per_episode"] == 1
    assert metrics["rollout/tool_call_error_rate"] == 0 and metrics["rollout/tool_call_latency_s_mean"] > 0


def test_a_server_that_dies_or_hangs_ends_the_episode_as_a_service_failure_and_is_reconnected(tokenizer, tmp_path):
    box = McpToolbox([lookup_server(tmp_path, crash_at=2, call_timeout_s=3.0)]).connect()
    try:
        agent = ToolCallAgent(tokenizer, toolbox=box, max_model_len=4096)
        manager = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=i, group_id=0, tag="FrozenLake3x3")
                                                    for i in range(4)])
        # env 0 looks up (call 1), env 1's lookup kills the server (call 2), env 2's call finds it started again,
        # env 3 calls the tool that never answers
        replies = {0: [call("lookup", key="ice")], 1: [call("lookup", key="hole")], 2: [call("lookup", key="goal")],
                   3: [call("hang")]}
        played = play(tokenizer, agent, manager, {0: 11}, replies, max_turn=1)
        outs = {e: o[0] for e, o in played.outputs.items()}
        assert not outs[0].done and not outs[2].done and outs[1].done and outs[3].done
        states = {s.env_id: s for s in manager.get_rollout_states()}
        assert [states[e].service_failure for e in range(4)] == [False, True, False, True]
        assert "MCP server 'lookup'" in states[1].error and "did not answer within call_timeout_s = 3" in \
            states[3].error
        dead = states[1].history[0].tool_calls[0]
        assert dead["service_failure"] and dead["name"] == "lookup" and dead["error"]
        assert states[2].history[0].tool_calls[0]["result"] == "where the present is"
        kept, lost = leave_out_service_failures(list(played.episodes.values()), list(states.values()), Split.TRAIN,
                                                 str)
        assert lost == 2 and sorted(e.env_id for e in kept) == [0, 2]
        assert tool_call_metrics(list(states.values()), "rollout")["rollout/tool_call_failures"] == 2
    finally:
        box.close()


@pytest.fixture()
def http_calculator(tmp_path):
    """The example calculator over streamable HTTP on 127.0.0.1, checking the key in CALCULATOR_KEY."""
    key, log = "unit-test-calculator-key-8d1f", tmp_path / "calculator.log"
    with served_calculator(log, key) as url:
        yield url, key, log


def test_an_http_server_is_called_with_the_key_from_an_environment_variable(http_calculator, monkeypatch):
    url, key, log = http_calculator
    assert httpx.post(url, json={}).status_code == 401  # the server checks the key
    monkeypatch.setenv("UNIT_CALC_KEY", key)
    box = McpToolbox([McpServerConfig(name="calc", url=url, api_key_env="UNIT_CALC_KEY")]).connect()
    try:
        assert box.call("subtract", {"a": 7, "b": 9}).result == "-2.0"
    finally:
        box.close()
    monkeypatch.setenv("UNIT_CALC_KEY", "a-wrong-key")
    with pytest.raises(ValueError) as refused:
        McpToolbox([McpServerConfig(name="calc", url=url, api_key_env="UNIT_CALC_KEY")]).connect()
    assert "agent_proxy.mcp_servers[0] ('calc', url " in str(refused.value) and "\n" not in str(refused.value)
    assert key not in str(refused.value) and key not in log.read_text()


@pytest.mark.parametrize("servers, agent_cls, message", [
    ([McpServerConfig(name="calc", url="http://127.0.0.1:{port}/mcp", connect_timeout_s=3)], "tool_call",
     "agent_proxy.mcp_servers[0] ('calc', url http://127.0.0.1:{port}/mcp): "),
    ([McpServerConfig(name="calc", command=["python", "-c", "pass"], connect_timeout_s=5)], "tool_call",
     "agent_proxy.mcp_servers[0] ('calc', stdio command 'python -c pass'): "),
    ([CALCULATOR], None, "agent_proxy.mcp_servers is set but agent_proxy.agent_cls = None does not call tools"),
    ([McpServerConfig(name="calc", command=["python"], url="http://127.0.0.1:1/mcp")], "tool_call",
     "agent_proxy.mcp_servers[0] ('calc') sets both of command and url"),
    ([CALCULATOR, CALCULATOR], "tool_call", "agent_proxy.mcp_servers[0].name = 'calc': every MCP server needs a name"),
])
def test_a_server_down_at_start_up_or_a_wrong_key_is_refused_in_one_line(tiny_model_path, servers, agent_cls, message):
    from agent_trainer.config import AgentTrainerConfig

    port = free_port()  # nothing listens there
    cfg = AgentTrainerConfig()
    cfg.agent_proxy.agent_cls = agent_cls
    cfg.agent_proxy.mcp_servers = [McpServerConfig(**{**s.__dict__, "url": s.url.format(port=port) if s.url else None})
                                   for s in servers]
    with pytest.raises(ValueError) as refused:
        check_tool_servers(cfg)
    text = str(refused.value)
    assert text.startswith(message.format(port=port)) and "\n" not in text, text


def test_the_run_refuses_a_server_down_at_start_up_before_ray(tiny_model_path, tmp_path):
    """The command line's own check (``prepare``, before ``ray.init``): one line naming the server."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "agent_trainer.main", "--config-name", "countdown_mcp_tools",
                          f"model_path={tiny_model_path}", f"trainer.default_local_dir={tmp_path}",
                          "agent_proxy.mcp_servers=[{name: calc, url: 'http://127.0.0.1:" + str(port) + "/mcp', "
                          "connect_timeout_s: 3}]"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if "agent_proxy.mcp_servers[0]" in ln]
    assert len(lines) == 1 and f"url http://127.0.0.1:{port}/mcp" in lines[0], out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == lines[0]  # the run's last word: before any worker or Ray


def test_the_viewer_shows_each_call_under_its_reply(calculator, tokenizer, tmp_path):
    from agent_trainer.observe.trajectories import read_records, write_step
    from tests.agent_trainer.test_viewer import headless

    agent = ToolCallAgent(tokenizer, toolbox=calculator, max_model_len=4096)
    manager = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=0, group_id=0, tag="FrozenLake3x3")])
    played = play(tokenizer, agent, manager, {0: 11}, {0: [call("divide", a=1, b=0), call("add", a=2, b=3)]}, 2)
    batch = agent.build_update_batch(list(played.episodes.values()))
    path = write_step(tmp_path, 1, "train", manager.get_rollout_states(), batch, tokenizer, per_tag=1)
    (record,) = read_records(path.parent)
    assert [t.tool_calls[0]["name"] for t in record.turns] == ["divide", "add"]
    dom = headless("--dump-dom", (path.parent / "viewer.html").as_uri()).replace("&quot;", '"')
    assert 'tool calc.divide({"a":1,"b":0})' in dom and "error: Error executing tool divide: division by zero" in dom
    assert 'tool calc.add({"a":2,"b":3})' in dom and "result: 5.0" in dom
