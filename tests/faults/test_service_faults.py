"""An env served over HTTP whose server dies mid-run, on the real stack (Ray, FSDP2, vLLM, the tiny model, two real
OpenEnv servers on 127.0.0.1 started by the test: ``python -m agent_trainer.serve_env``): its episodes end as service
failures, are left out of training and counted, the next reset of its episodes fails (counted), and the run trains
both steps on the other server's episodes. The key reaches no log of the run or the servers.
"""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from agent_trainer.ray_cluster import init_ray, shutdown_ray
from agent_trainer.training.trainer import AgentTrainer
from agent_trainer.workers.build import build_workers
from fault_runs import fault_config

pytestmark = pytest.mark.e2e

KEY = "service-fault-key-93ab71"
KEY_ENV = "AGENT_TRAINER_TEST_OPENENV_KEY"


def served_tag(url: str, **env_config) -> dict:
    return {"env_type": "openenv", "max_actions_per_traj": 3, "max_tokens": 24,
            "env_instruction": "Answer with one move, e.g. <answer>Left</answer>.",
            "env_config": {"base_url": url, "api_key_env": KEY_ENV, "retries": 0, "step_timeout_s": 10.0,
                           **env_config}}


def test_a_server_killed_mid_run_ends_its_episodes_and_the_run_goes_on(tiny_model_path, tmp_path, serve_tag,
                                                                       monkeypatch, no_ray_left):
    monkeypatch.setenv(KEY_ENV, KEY)  # before the cluster starts: the env actors inherit it
    faulty = tmp_path / "faulty.yaml"
    faulty.write_text("Faulty:\n  env_type: envs.examples.faulty:FaultyEnv\n  env_config: {fault: exit_step}\n")
    lake = serve_tag("config/envs.yaml", "FrozenLake", KEY)
    dying = serve_tag(faulty, "Faulty", KEY)  # its env's first step ends the server's process (exit code 3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg, tags = fault_config(tiny_model_path, run_dir, ["FrozenLakeServed", "DyingServed"],
                             "trainer.total_training_steps=2",
                             extra_tags={"FrozenLakeServed": served_tag(lake.url),
                                         "DyingServed": served_tag(dying.url, action_description="any word")})
    init_ray(cfg)
    try:
        trainer = AgentTrainer(cfg, AutoTokenizer.from_pretrained(tiny_model_path), tags, build_workers=build_workers)
        trainer.init_workers(build_workers(cfg))
        history = trainer.fit()
    finally:
        shutdown_ray()
    assert no_ray_left(30.0) == []
    assert dying.proc.poll() == 3 and lake.proc.poll() is None  # the step killed its server; the other one serves
    assert len(history) == 2 and all(math.isfinite(h["actor/pg_loss"]) for h in history)
    first, second = history
    # step 1: both episodes of the dead server's group ended as service failures and were left out of the batch
    assert first["rollout/service_failures"] == 2 and first["env/DyingServed/service_failure"] == 1.0
    assert first["env/FrozenLakeServed/service_failure"] == 0.0 and first["env/FrozenLakeServed/num_actions"] > 0
    assert first["perf/num_rows"] == 2  # one row per episode (full mode): the served FrozenLake's group only
    # step 2: the dead server's episodes could not reset (counted); the other group trained again
    assert second["rollout/reset_failures"] == 2 and second["rollout/service_failures"] == 0
    assert second["perf/num_rows"] == 2
    logs = [p for p in run_dir.rglob("*") if p.is_file()]
    assert logs and not [p for p in logs if KEY in p.read_text(errors="replace")]
    assert KEY not in lake.log and KEY not in dying.log
