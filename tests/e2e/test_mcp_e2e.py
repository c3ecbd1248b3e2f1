"""The tool-calling agent with tools from MCP servers (real Ray, FSDP2 over gloo, vLLM CPU, and real MCP servers
written with the ``mcp`` SDK's ``MCPServer``), 2 GRPO steps each on FrozenLake3x3:

- the example calculator (examples/mcp/calculator_server.py) over streamable HTTP on 127.0.0.1, started by the test
  and checking a key the run reads from an environment variable: every episode's calls are in the trajectories;
- the tests' lookup server over stdio, which kills itself during its 6th call (the 2nd episode of step 2): that
  episode ends as a service failure (counted, left out of training), the next call starts the server again, and
  the run completes.

The tiny model never writes a tool call (it was warmed up on ``<answer>`` replies), so the agent is
``ScriptedFirstCallAgent``: each episode's first reply is read as a tool call (tests/agent_trainer/agents_example.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from e2e_runs import metrics_records, train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

REPO = Path(__file__).resolve().parents[2]
KEY_ENV = "AGENT_TRAINER_TEST_E2E_MCP_KEY"
KEY = "e2e-mcp-calculator-key-7a3e91"
SMALL = ["trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.save_freq=0",
         "trainer.log_trajectories_freq=1",
         "es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
         "es_manager.train.env_configs.tags=[FrozenLake3x3]", "agent_proxy.num_env_actors=1", "agent_proxy.max_turn=2",
         "actor_rollout_ref.actor.fsdp.world_size=1", "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.response_length=24", "actor_rollout_ref.actor.use_kl_loss=false",
         "agent_proxy.agent_cls=tests.agent_trainer.agents_example.ScriptedFirstCallAgent"]


def turns(run_dir) -> list[dict]:
    """Every turn of the sampled episodes of both steps."""
    records = [json.loads(line) for step in (1, 2)
               for line in (Path(run_dir) / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
    return [dict(t, step=r["step"], env_id=r["env_id"]) for r in records for t in r["turns"]]


@pytest.fixture()
def calculator_over_http(tmp_path):
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "calculator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "examples/mcp/calculator_server.py", "--http", "--port", str(port),
                                 "--key-env", KEY_ENV], cwd=REPO, env={**os.environ, KEY_ENV: KEY,
                                                                        "PYTHONPATH": str(REPO)},
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
    yield url, log
    proc.kill()
    proc.wait(timeout=30)


def test_an_mcp_server_serves_the_tool_agent_and_its_calls_are_in_the_trajectories(tiny_model_path, tmp_path,
                                                                                    calculator_over_http, monkeypatch):
    url, log = calculator_over_http
    monkeypatch.setenv(KEY_ENV, KEY)  # the driver (this process) calls the tools
    run = tmp_path / "run"
    train_here("frozenlake_grpo", tiny_model_path, run, *SMALL,
               f"agent_proxy.mcp_servers=[{{name: calc, url: '{url}', api_key_env: {KEY_ENV}}}]")
    records = metrics_records(run)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["actor/pg_loss"]) and r["rollout/service_failures"] == 0
        assert r["rollout/tool_calls_per_episode"] == 1 and r["rollout/tool_turns_per_episode"] == 1
        assert r["rollout/tool_call_error_rate"] == 0 and r["rollout/tool_call_latency_s_mean"] > 0
    first = [t for t in turns(run) if t["turn"] == 1]
    assert len(first) == 8  # 2 steps x 4 episodes, each sampled (log_trajectories_per_tag covers them)
    for t in first:
        (c,) = t["tool_calls"]
        assert (c["server"], c["name"], c["arguments"], c["result"], c["error"]) == \
            ("calc", "add", {"a": 2, "b": 3}, "5.0", "") and t["actions"] == [] and t["reward"] == 0
    second = [t for t in turns(run) if t["turn"] == 2]
    assert second and all("<tool_response>\nadd: 5.0\n</tool_response>" in t["prompt"] for t in second)
    viewer = (run / "trajectories" / "viewer.html").read_text()  # its data holds the calls, its script shows them
    assert '"tool_calls": [{"server": "calc", "name": "add"' in viewer and '"tool " + c.server' in viewer
    assert KEY not in log.read_text()
    assert not [p for p in run.rglob("*") if p.is_file() and KEY in p.read_text(errors="replace")]


def test_a_tool_server_killed_mid_run_ends_its_episode_and_the_run_completes(tiny_model_path, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("MCP_TEST_CALLS_FILE", str(tmp_path / "calls.txt"))
    monkeypatch.setenv("MCP_TEST_CRASH_AT", "6")  # step 2, its 2nd episode's call
    run = tmp_path / "run"
    server = ("[{name: lookup, command: [python, tests/agent_trainer/mcp_test_server.py], "
              "env_vars: [MCP_TEST_CALLS_FILE, MCP_TEST_CRASH_AT], call_timeout_s: 20}]")
    train_here("frozenlake_grpo", tiny_model_path, run, *SMALL, f"agent_proxy.mcp_servers={server}")
    records = metrics_records(run)
    assert [r["step"] for r in records] == [1, 2]
    assert [r["rollout/service_failures"] for r in records] == [0, 1]
    assert [r["rollout/tool_call_failures"] for r in records] == [0, 1]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in records)
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 8  # the 7th and 8th on a restarted server
    calls = [c for t in turns(run) if t["step"] == 2 for c in t["tool_calls"]]
    assert sorted(c["service_failure"] for c in calls) == [False, False, False, True]
    assert [c["result"] for c in calls if not c["service_failure"]] == ["frozen water"] * 3
