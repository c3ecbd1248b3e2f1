"""The tool-calling agent with tools from MCP servers (real Ray, FSDP2 over gloo, vLLM CPU, and real MCP servers
written with the ``mcp`` SDK's ``MCPServer``), 2 GRPO steps each on FrozenLake3x3, the calls written by the policy:

- the example calculator (examples/mcp/calculator_server.py) over streamable HTTP on 127.0.0.1, started by the test
  and checking a key the run reads from an environment variable: the calls the policy wrote are in the trajectories,
  with the server's answers;
- the tests' lookup server over stdio, which kills itself during its 2nd call: that episode ends as a service failure
  (counted, left out of training), the next call starts the server again, and the run completes.

The tiny model was warmed up on ``<answer>`` replies and never writes a tool call, so the module first teaches it
(:func:`tool_model`): a short SFT run of this project (``python -m agent_trainer.sft``, ``data.source=jsonl``) on the
tool agent's own first prompts (the chat template with the servers' tool schemas, as listed by the servers) and
replies calling one tool in the format the agent parses. The RL runs then use the real agent on that model's text.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformers import AutoTokenizer

from agent_trainer.common import prompts
from agent_trainer.agents.base import agent_options
from agent_trainer.agents.mcp_tools import McpToolbox
from agent_trainer.agents.tool_call import (TOOL_CALL_TAG, ToolCallAgent, env_tools, function_tool, parse_tool_calls,
                                            tool_call_text)
from agent_trainer.config.schema import McpServerConfig
from agent_trainer.agents.demonstrations import encode_conversation
from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
from agent_trainer.checks.prepare import compose_and_prepare
from e2e_runs import metrics_records, train_here
from mcp_calculator import http_calculator

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

REPO = Path(__file__).resolve().parents[2]
KEY_ENV = "AGENT_TRAINER_TEST_E2E_MCP_KEY"
KEY = "e2e-mcp-calculator-key-7a3e91"
SFT_STEPS = 250
"""Enough to teach the replies (measured: held-out loss 9.2 -> 0.015 at 200 steps, 0.0016 at 300; greedy writes every
taught call, sampling 5 in 6)."""
CALC_CALL = ("add", {"a": 2, "b": 3})
LOOKUP_CALL = ("lookup", {"key": "ice"})
LOOKUP = {"name": "lookup", "command": ["python", "tests/agent_trainer/mcp_test_server.py"], "tools": ["lookup"]}
SMALL = ["trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.save_freq=0",
         "trainer.log_trajectories_freq=1",
         "es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
         "es_manager.train.env_configs.tags=[FrozenLake3x3]", "agent_proxy.num_env_actors=1", "agent_proxy.max_turn=2",
         "actor_rollout_ref.actor.fsdp.world_size=1", "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.response_length=64", "actor_rollout_ref.rollout.max_model_len=2048",
         "actor_rollout_ref.actor.use_kl_loss=false",
         "agent_proxy.agent_cls=tool_call"]


def demonstrations(rl, tokenizer, env_outputs, server: dict, call: tuple[str, dict]) -> list[dict]:
    """One conversation per env output: the tool agent's own first prompt (the RL config's agent options) with
    ``server``'s tools (listed by the server), as system and user messages, and a reply calling ``call`` in the
    format the agent parses."""
    toolbox = McpToolbox([McpServerConfig(**server)]).connect()
    try:
        agent = ToolCallAgent(tokenizer, toolbox=toolbox, **agent_options(rl))
        reply = tool_call_text(*call)
        wrap = tokenizer.apply_chat_template([{"role": "system", "content": "\x00"}], tokenize=False)
        prefix, suffix = wrap.split("\x00")
        convs = []
        for out in env_outputs:
            ctx = agent.start(out)
            system = tokenizer.apply_chat_template([{"role": "system", "content": prompts.SYSTEM_PROMPT}],
                                                   tools=ctx.tools, tokenize=False)
            assert system.startswith(prefix) and system.endswith(suffix)
            messages = [{"role": "system", "content": system[len(prefix):len(system) - len(suffix)]},
                        {"role": "user", "content": agent.first_user_message(out, env_tools(out.instruction))},
                        {"role": "assistant", "content": reply}]
            ids, mask = encode_conversation(agent, messages)  # as the SFT run will encode it
            assert ids[:len(ctx.token_ids)] == ctx.token_ids and not any(mask[:len(ctx.token_ids)])
            assert parse_tool_calls(reply, ctx.tools, toolbox.names).calls == [call]
            convs.append({"messages": messages})
        return convs
    finally:
        toolbox.close()


@pytest.fixture(scope="module")
def tool_model(tiny_model_path, tmp_path_factory):
    """The tiny model after SFT_STEPS steps of SFT on both servers' first prompts (48 FrozenLake3x3 maps each)."""
    folder = tmp_path_factory.mktemp("tool_sft")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rl, env_tags = compose_and_prepare([f"model_path={tiny_model_path}", *SMALL], "frozenlake_grpo")
    manager = EnvStateManager(env_tags, [EpisodeSpec(env_id=i, group_id=i, tag="FrozenLake3x3") for i in range(48)],
                              format_penalty=rl.es_manager.format_penalty)
    try:
        outputs = manager.reset({i: 1000 + i for i in range(48)})
    finally:
        manager.close()
    calc = {"name": "calc", "command": ["python", "examples/mcp/calculator_server.py"]}
    convs = demonstrations(rl, tokenizer, outputs, calc, CALC_CALL) + demonstrations(rl, tokenizer, outputs, LOOKUP,
                                                                                  LOOKUP_CALL)
    data = folder / "tool_calls.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    rl_overrides = [o for o in SMALL if o.startswith(("es_manager.train.env_configs.tags", "actor_rollout_ref.rollout"))]
    cmd = [sys.executable, "-m", "agent_trainer.sft", "--config-name", "sft_frozenlake", f"model_path={tiny_model_path}",
           f"trainer.default_local_dir={folder}", f"rl_config=frozenlake_grpo", f"rl_overrides={json.dumps(rl_overrides)}",
           "data.source=jsonl", f"data.train_files=[{data}]", "data.noise=0.0", "data.num_episodes=256", "eval.env_success=false", "eval.test_freq=0",
           "train.total_epochs=1000", f"train.max_steps={SFT_STEPS}", "train.batch_size=8",
           "train.micro_batch_size_per_gpu=4", "train.optim.lr=5e-3", "train.optim.warmup_steps=5",
           "train.optim.lr_scheduler_type=cosine", "train.optim.min_lr_ratio=0.05"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, not the tests' shared one
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics_records(folder)
    assert records[-1]["val/sft_loss"] < 0.05 < records[0]["val/sft_loss"], (records[0], records[-1])
    return str(folder / "final")


def tool_turns(run_dir, names: tuple[str, ...]) -> list[dict]:
    """The sampled turns whose reply called a tool of ``names``; each turn's calls are checked to be the ones its
    recorded reply (the model's text) writes, read by the agent's parser (up to a call whose server failed)."""
    tools = [function_tool(n, "", "direction", None) for n in ("move", *names)]
    called = [t for t in turns(run_dir) if t["tool_calls"]]
    for t in called:
        written = parse_tool_calls(t["reply"], tools, set(names)).calls
        assert f"<{TOOL_CALL_TAG}>" in t["reply"] and written, t
        assert [(c["name"], c["arguments"]) for c in t["tool_calls"]] == written[:len(t["tool_calls"])], t
    return called


def turns(run_dir) -> list[dict]:
    """Every turn of the sampled episodes of both steps."""
    records = [json.loads(line) for step in (1, 2)
               for line in (Path(run_dir) / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
    return [dict(t, step=r["step"], env_id=r["env_id"]) for r in records for t in r["turns"]]


@pytest.fixture()
def calculator_over_http(tmp_path):
    log = tmp_path / "calculator.log"
    with http_calculator(log, KEY, key_env=KEY_ENV) as url:
        yield url, log


def test_an_mcp_server_serves_the_tool_agent_and_its_calls_are_in_the_trajectories(tool_model, tmp_path,
                                                                                    calculator_over_http, monkeypatch):
    url, log = calculator_over_http
    monkeypatch.setenv(KEY_ENV, KEY)  # the driver (this process) calls the tools
    run = tmp_path / "run"
    train_here("frozenlake_grpo", tool_model, run, *SMALL,
               f"agent_proxy.mcp_servers=[{{name: calc, url: '{url}', api_key_env: {KEY_ENV}}}]")
    records = metrics_records(run)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["actor/pg_loss"]) and r["rollout/service_failures"] == 0
    assert sum(r["rollout/tool_calls_per_episode"] for r in records) > 0
    assert sum(r["rollout/tool_turns_per_episode"] for r in records) > 0
    called = tool_turns(run, ("add", "subtract", "multiply", "divide"))
    calls = [c for t in called for c in t["tool_calls"]]
    assert calls and all(c["server"] == "calc" and not c["service_failure"] for c in calls)
    # the server computed the answers of the calls the model wrote as it was taught
    taught = [c for c in calls if (c["name"], c["arguments"]) == CALC_CALL]
    assert taught and all((c["result"], c["error"]) == ("5.0", "") for c in taught)
    assert all(r["rollout/tool_call_latency_s_mean"] > 0 for r in records if r["rollout/tool_calls_per_episode"])
    # the answers come back before the next turn: the next turn's prompt shows them
    by_turn = {(t["step"], t["env_id"], t["turn"]): t for t in turns(run)}
    answered = [(t, by_turn[(t["step"], t["env_id"], t["turn"] + 1)]) for t in called
                if (t["step"], t["env_id"], t["turn"] + 1) in by_turn]
    assert answered
    for t, after in answered:
        for c in t["tool_calls"]:
            shown = f"{c['name']}: {c['result']}" if not c["error"] else f"{c['name']} error: {c['error']}"
            assert f"<tool_response>\n{shown}\n</tool_response>" in after["prompt"]
    viewer = (run / "trajectories" / "viewer.html").read_text()  # its data holds the calls, its script shows them
    assert '"tool_calls": [{"server": "calc", "name": "' in viewer and '"tool " + c.server' in viewer
    assert KEY not in log.read_text()
    assert not [p for p in run.rglob("*") if p.is_file() and KEY in p.read_text(errors="replace")]


def test_a_tool_server_killed_mid_run_ends_its_episode_and_the_run_completes(tool_model, tmp_path, monkeypatch):
    calls_file = tmp_path / "calls.txt"
    monkeypatch.setenv("MCP_TEST_CALLS_FILE", str(calls_file))
    monkeypatch.setenv("MCP_TEST_CRASH_AT", "2")  # the server dies during its 2nd call
    run = tmp_path / "run"
    server = ("[{name: lookup, command: [python, tests/agent_trainer/mcp_test_server.py], tools: [lookup], "
              "env_vars: [MCP_TEST_CALLS_FILE, MCP_TEST_CRASH_AT], call_timeout_s: 20}]")
    train_here("frozenlake_grpo", tool_model, run, *SMALL, f"agent_proxy.mcp_servers={server}")
    records = metrics_records(run)
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["rollout/service_failures"] for r in records) == 1
    assert sum(r["rollout/tool_call_failures"] for r in records) == 1
    assert all(math.isfinite(r["actor/pg_loss"]) for r in records)
    calls = [c for t in tool_turns(run, ("lookup",)) for c in t["tool_calls"]]
    assert [c["service_failure"] for c in calls].count(True) == 1
    # the server saw exactly the calls the model wrote (the killed one too), the later ones on a restarted server
    seen = calls_file.read_text().splitlines()
    assert sorted(seen) == sorted(c["arguments"]["key"] for c in calls if c["service_failure"] or not c["error"])
    assert len(seen) > 2
    assert all(c["result"] == "frozen water" for c in calls if not c["error"] and c["arguments"] == {"key": "ice"})
