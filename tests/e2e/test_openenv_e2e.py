"""Training through the ``openenv`` env tag (real Ray, FSDP2 over gloo, vLLM CPU, and a real OpenEnv server on
127.0.0.1 started by the test), 2 steps each, every episode a session on the server: the shipped FrozenLake tag served
by ``python -m agent_trainer.serve_env``, and a server written with openenv-core alone (tests/envs/openenv_word_env.py).
The env-level equivalence with the in-process env is tests/envs/test_openenv_env.py.
"""

from __future__ import annotations

import math
import os

import pytest
import yaml

from agent_trainer.checks.prepare import CONFIG_DIR
from e2e_runs import metrics_records, train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

KEY_ENV = "AGENT_TRAINER_TEST_E2E_OPENENV_KEY"
KEY = os.environ.setdefault(KEY_ENV, "e2e-openenv-key-51c0d2")
"""Set when the module is collected, so before the e2e tests' shared Ray cluster starts: the env actors inherit it."""

SMALL = ["trainer.test_freq=0", "trainer.progress_bar=false", "trainer.save_freq=0", "trainer.total_training_steps=2",
         "es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
         "es_manager.train.env_configs.tags=[FrozenLakeServed]", "agent_proxy.max_turn=2",
         "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.response_length=24"]


def test_frozenlake_served_over_openenv_trains(tiny_model_path, tmp_path, serve_tag):
    served = serve_tag("config/envs.yaml", "FrozenLake", KEY)
    tags = yaml.safe_load((CONFIG_DIR / "envs.yaml").read_text())["custom_envs"]  # the validation split's tag too
    tags["FrozenLakeServed"] = {
        "env_type": "openenv", "max_actions_per_traj": 10, "max_tokens": 100,
        "env_instruction": "You are solving the FrozenLake puzzle. Answer with one move, e.g. <answer>Down</answer>.",
        "env_config": {"base_url": served.url, "api_key_env": KEY_ENV}}
    envs_file = tmp_path / "envs.yaml"
    envs_file.write_text(yaml.safe_dump({"custom_envs": tags}))
    sessions_before = served.log.count("connection open")  # the run's preflight plays the tag too
    train_here("frozenlake", tiny_model_path, tmp_path / "run", *SMALL, f"envs_file={envs_file}")
    records = metrics_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["actor/pg_loss"]) and r["rollout/service_failures"] == 0
        assert r["env/FrozenLakeServed/num_actions"] > 0 and r["env/FrozenLakeServed/error"] == 0
    assert served.log.count("connection open") - sessions_before >= 8  # a session per episode: 2 steps x 4
    assert KEY not in served.log
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and KEY in p.read_text(errors="replace")]


def test_a_server_written_with_openenv_core_alone_trains(tiny_model_path, tmp_path, serve_tag):
    served = serve_tag(None, "Word", None, script="tests/envs/openenv_word_env.py")
    tags = yaml.safe_load((CONFIG_DIR / "envs.yaml").read_text())["custom_envs"]
    tags["Word"] = {"env_type": "openenv", "max_actions_per_traj": 3, "max_tokens": 24,
                    "env_instruction": "Say the secret word, a direction, e.g. <answer>Left</answer>.",
                    "env_config": {"base_url": served.url, "observation_field": "prompt", "action_field": "word",
                                   "success_reward": 1.0, "action_description": "Left | Down | Right | Up"}}
    envs_file = tmp_path / "envs.yaml"
    envs_file.write_text(yaml.safe_dump({"custom_envs": tags}))
    overrides = [o.replace("FrozenLakeServed", "Word") for o in SMALL]
    train_here("frozenlake", tiny_model_path, tmp_path / "run", *overrides, f"envs_file={envs_file}",
               "algorithm.adv_estimator=grpo")
    records = metrics_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["actor/pg_loss"]) and r["rollout/service_failures"] == 0
        assert r["env/Word/num_actions"] > 0 and r["env/Word/error"] == 0
    assert served.log.count("connection open") >= 8
