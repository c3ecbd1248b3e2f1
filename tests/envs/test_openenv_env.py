"""The ``openenv`` env tag against real OpenEnv servers on 127.0.0.1 (``python -m agent_trainer.serve_env``, started
by the tests; nothing of HTTP mocked): a served FrozenLake plays exactly the in-process env's episodes and keeps the
env contract; the key is checked and never printed; a server that hangs, dies or is down ends the episode with a
ServiceError and the next reset reconnects; a server down at start-up is refused in one line before Ray."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys

import httpx
import pytest
import yaml

import envs
from agent_trainer.check_env import check_tags
from agent_trainer.checks.env_contract import check_garbage_actions, random_action_strings
from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
from agent_trainer.checks.prepare import compose_and_prepare
from envs import ServiceError
from envs.registry import load_env_tags

KEY = "test-key-7f3a9c1e5b"
KEY_ENV = "AGENT_TRAINER_TEST_OPENENV_KEY"
ACTIONS = ["Left", "Down", "Right", "Up", "down.", "junk", ""]


def write_tags(path, url: str, **env_config) -> str:
    """An envs file with the served tag (``FrozenLakeServed``) pointing at ``url``."""
    tags = {"FrozenLakeServed": {"env_type": "openenv", "max_actions_per_traj": 10, "env_instruction": "FrozenLake",
                                 "max_tokens": 100,
                                 "env_config": {"base_url": url, "api_key_env": KEY_ENV, **env_config}}}
    path.write_text(yaml.safe_dump(tags))
    return str(path)


def faulty_tags(path, fault: str) -> str:
    path.write_text(yaml.safe_dump({"Faulty": {"env_type": "envs.examples.faulty:FaultyEnv",
                                               "env_config": {"fault": fault, "steps": 5}}}))
    return str(path)


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


@pytest.fixture
def frozen_lake(serve_tag, tmp_path, key):
    """The shipped FrozenLake tag served, and the envs file of a tag that plays it through the adapter."""
    served = serve_tag("config/envs.yaml", "FrozenLake", key)
    return served, load_env_tags(write_tags(tmp_path / "envs.yaml", served.url, retries=0))


def test_served_frozenlake_plays_the_in_process_episodes(frozen_lake):
    served, tags = frozen_lake
    remote, local = envs.make_env("FrozenLakeServed", tags), envs.make_env("FrozenLake")
    rng = random.Random(0)
    steps = 0
    for seed in [0, 1, 2, 7, 123, 2**30 + 5]:
        assert remote.reset(seed=seed) == local.reset(seed=seed)
        assert (remote.legend(), remote.action_description()) == (local.legend(), local.action_description())
        for _ in range(10):
            action = rng.choice(ACTIONS)
            got, want = remote.step(action), local.step(action)
            assert got == want, (seed, action)  # observation, reward, done and info (success, validity, chose_hole)
            steps += 1
            if want[2]:
                break
    assert steps > 20
    remote.close()
    remote.close()
    assert KEY not in served.log


def test_served_frozenlake_keeps_the_env_contract(frozen_lake, tmp_path, key):
    """``check_env`` (determinism, text methods, junk actions, the preflight) passes on the served tag, and the
    shared junk fuzz."""
    served, _ = frozen_lake
    results = check_tags(write_tags(tmp_path / "check.yaml", served.url), ["FrozenLakeServed"], junk=200)
    failed = [r.line() for r in results if not r.ok]
    assert len(results) == 8 and not failed, failed  # the expert check is skipped: a served tag has no solver
    env = envs.make_env("FrozenLakeServed", load_env_tags(tmp_path / "check.yaml"))
    check_garbage_actions(env, random_action_strings(300))
    env.close()


def test_the_key_is_checked_and_never_printed(frozen_lake, tmp_path, monkeypatch, caplog):
    served, tags = frozen_lake
    caplog.set_level(logging.DEBUG)  # websockets logs a handshake's headers at DEBUG: the client keeps it quiet
    envs.make_env("FrozenLakeServed", tags).reset(seed=0)
    assert caplog.records and KEY not in caplog.text
    assert httpx.get(served.url + "/health").status_code == 401
    assert httpx.get(served.url + "/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(served.url + "/schema", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    monkeypatch.setenv(KEY_ENV, "wrong-key-4242")
    env = envs.make_env("FrozenLakeServed", tags)
    with pytest.raises(ServiceError, match="cannot open a session") as refused:  # the WebSocket handshake too
        env.reset(seed=0)
    assert "wrong-key-4242" not in str(refused.value)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ServiceError, match=f"{KEY_ENV}, which is not set"):
        env.reset(seed=0)
    assert KEY not in served.log and "wrong-key-4242" not in served.log


def test_serve_env_refuses_to_start_without_a_key(monkeypatch):
    monkeypatch.delenv("AGENT_TRAINER_ENV_KEY", raising=False)
    proc = subprocess.run([sys.executable, "-m", "agent_trainer.serve_env", "--envs-file", "config/envs.yaml",
                           "--tag", "FrozenLake"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "serve_env: --key-env names AGENT_TRAINER_ENV_KEY, which is not set; set it to the key the clients send "
        "(their env_config.api_key_env names the variable holding it)"]


def test_a_hung_server_ends_the_episode_and_the_next_reset_reconnects(serve_tag, tmp_path, key):
    served = serve_tag(faulty_tags(tmp_path / "faulty.yaml", "hang_step"), "Faulty", key)
    tags = load_env_tags(write_tags(tmp_path / "envs.yaml", served.url, step_timeout_s=1.0, observation_field="text",
                                    action_description="anything"))
    env = envs.make_env("FrozenLakeServed", tags)
    assert env.reset(seed=0) == "step 0 of 5"
    with pytest.raises(ServiceError, match="step at .* failed: TimeoutError"):
        env.step("go")
    assert env.reset(seed=1) == "step 0 of 5"  # a fresh session: the hung one is left to the server
    env.close()


def test_a_killed_server_ends_the_episode_and_a_restarted_one_is_reconnected(frozen_lake, serve_tag, tmp_path, key):
    served, _ = frozen_lake
    tags = load_env_tags(write_tags(tmp_path / "retry.yaml", served.url, retries=20, retry_backoff_s=0.5))
    env, local = envs.make_env("FrozenLakeServed", tags), envs.make_env("FrozenLake")
    env.reset(seed=3)
    served.kill()
    with pytest.raises(ServiceError, match="step at .*(connection was lost|failed)"):
        env.step("Down")
    with pytest.raises(ServiceError, match="cannot open a session"):  # down: each retry refused, then the error
        envs.make_env("FrozenLakeServed", load_env_tags(write_tags(tmp_path / "once.yaml", served.url,
                                                                   retries=1, retry_backoff_s=0.1))).reset(seed=3)
    serve_tag("config/envs.yaml", "FrozenLake", key, port=served.port)
    assert env.reset(seed=3) == local.reset(seed=3)  # the same address again: the next episode reconnects
    assert env.step("Down") == local.step("Down")
    env.close()


def test_a_lost_server_ends_its_episodes_as_service_failures(frozen_lake):
    """In the env-state manager: the episode ends with its error, marked a service failure (the rollout leaves it
    out of training and counts it), not an env error."""
    served, tags = frozen_lake
    manager = EnvStateManager(tags, [EpisodeSpec(0, 0, "FrozenLakeServed"), EpisodeSpec(1, 0, "FrozenLakeServed")])
    manager.reset({0: 5})
    out = manager.step([{"env_id": 0, "llm_response": "", "actions": ["Down"]}])
    assert not out[0].info.get("error")
    served.kill()
    manager.step([{"env_id": 0, "llm_response": "", "actions": ["Right"]},
                  {"env_id": 1, "llm_response": "", "actions": ["Right"]}])
    states = manager.get_rollout_states()
    assert [s.service_failure for s in states] == [True, True]
    assert all("ServiceError" in s.error and s.metrics["service_failure"] == 1.0 for s in states)
    manager.close()


def test_a_server_down_at_start_up_is_refused_in_one_line_before_ray(tiny_model_path, tmp_path, key):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    envs_file = write_tags(tmp_path / "envs.yaml", f"http://127.0.0.1:{port}")
    with pytest.raises(SystemExit) as refused:
        compose_and_prepare([f"model_path={tiny_model_path}", f"envs_file={envs_file}",
                             "es_manager.train.env_configs.tags=[FrozenLakeServed]",
                             "es_manager.val.env_configs.tags=[FrozenLakeServed]"])
    line = str(refused.value)
    assert "\n" not in line and KEY not in line
    assert line.startswith(f"agent-trainer: env tag 'FrozenLakeServed': env_config.base_url = http://127.0.0.1:{port}: "
                           f"no OpenEnv server answers at http://127.0.0.1:{port}/health (ConnectError")
    assert line.endswith("start the server (python -m agent_trainer.serve_env serves a tag of this project) or fix "
                         "base_url (docs/environments.md, \"Services\")")
    import ray

    assert not ray.is_initialized()


def test_a_step_timeout_past_the_env_actors_deadline_is_refused(frozen_lake, tiny_model_path, tmp_path):
    served, _ = frozen_lake
    envs_file = write_tags(tmp_path / "envs.yaml", served.url, step_timeout_s=90.0)
    with pytest.raises(SystemExit, match=r"env_config.step_timeout_s = 90 is not below es_manager.env_step_timeout_s "
                                         r"= 60: .*set env_config.step_timeout_s below 60"):
        compose_and_prepare([f"model_path={tiny_model_path}", f"envs_file={envs_file}",
                             "es_manager.train.env_configs.tags=[FrozenLakeServed]",
                             "es_manager.val.env_configs.tags=[FrozenLakeServed]"])


WORD_SERVER = "tests/envs/openenv_word_env.py"
"""An OpenEnv server written with openenv-core alone (its own types; no success field, no key)."""


def word_tags(path, url: str, **env_config) -> dict:
    path.write_text(yaml.safe_dump({"Word": {
        "env_type": "openenv", "max_actions_per_traj": 3, "env_instruction": "Say the word.", "max_tokens": 24,
        "env_config": {"base_url": url, "observation_field": "prompt", "action_field": "word", "success_reward": 1.0,
                       "action_description": "Left | Down | Right | Up", **env_config}}}))
    return load_env_tags(path)


def test_a_third_party_openenv_server_maps_onto_the_env_contract(serve_tag, tmp_path):
    served = serve_tag(None, "Word", None, script=WORD_SERVER)
    env = envs.make_env("Word", word_tags(tmp_path / "text.yaml", served.url))
    assert env.reset(seed=0) == "Say the secret word (4 letters, a direction)."
    assert env.action_description() == "Left | Down | Right | Up" and env.legend() == ""
    again = "Not that one. Say another direction."
    assert env.step("Up") == (again, 0.0, False, envs.make_info(False, True, True))
    # the server's schema refuses an empty word (min_length 1): an invalid action, and its session goes on
    assert env.step("") == (again, 0.0, False, envs.make_info(False, False, False))
    assert env.step("LEFT") == ("Right!", 1.0, True, envs.make_info(True, True, True))  # success: reward >= 1
    # action_format json, and an observation shown whole (as JSON) when observation_field is absent from it
    env = envs.make_env("Word", word_tags(tmp_path / "json.yaml", served.url, action_format="json",
                                          observation_field="text"))
    first = env.reset(seed=1)
    assert json.loads(first) == {"prompt": "Say the secret word (4 letters, a direction).", "heard": ""}
    assert env.step("Down") == (first, 0.0, False, envs.make_info(False, False, False))  # no JSON: not sent
    assert env.step('["down"]') == (first, 0.0, False, envs.make_info(False, False, False))
    obs, reward, done, info = env.step('{"word": "down"}')
    assert (json.loads(obs)["heard"], reward, done, info["success"]) == ("down", 1.0, True, True)
    env.close()
