"""Shared fixtures: the tiny model (built once per session) and a local Ray cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``make test`` runs two pytest-xdist workers (``--dist loadgroup``): each test module goes to one worker
    whole (its module fixtures run once), and every ``shared_cluster`` test to the same worker, so those runs
    share one Ray cluster (tests/e2e/conftest.py). A run's start is CPU-bound only in parts (imports, model
    loads); its waits on Ray, on sockets and on the other processes leave a core for the other worker.

    ``tryfirst``: the groups must be marked before pytest-xdist's own hook reads them into the test ids (run
    after it, every test went alone to whichever worker was free). pytest 9.2 drops those ids' group suffix
    altogether, hence pyproject's pytest below 9.2."""
    for item in items:
        shared = item.get_closest_marker("shared_cluster") is not None
        item.add_marker(pytest.mark.xdist_group("shared_cluster" if shared else str(item.path)))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny Qwen2 model + tokenizer in Hugging Face format.

    Uses ``AGENT_TRAINER_TEST_MODEL`` when set (``make test`` points it at the
    model ``make model`` built), else builds one without warm-up into a temp dir.
    """
    env_path = os.environ.get("AGENT_TRAINER_TEST_MODEL")
    if env_path and Path(env_path, "config.json").exists():
        return str(Path(env_path).resolve())  # absolute: a test may change its working folder
    from launch.build_tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-model") / "tiny-qwen2"
    return str(build_tiny_model(out, warmup_steps=0))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module (2 CPUs' worth of fractional accounting)."""
    import ray

    from agent_trainer.ray_cluster import WORKERS_AT_NORMAL_PRIORITY, local_cluster_system_config, shutdown_ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _system_config=local_cluster_system_config(WORKERS_AT_NORMAL_PRIORITY))
    yield ray
    shutdown_ray()


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left_behind():
    """A module that leaves torch.distributed's default group initialized breaks whichever module runs next
    in the same xdist worker ("initialize the default process group twice"), so which test fails would depend
    on the split. Fail the module that leaked instead, and clean up after it."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this module left torch.distributed's default process group initialized; "
                    "destroy it (or shut the in-process vLLM engine down) before the module ends")


class ServedTag:
    """An env tag served by ``python -m agent_trainer.serve_env`` in a process of its own on 127.0.0.1 (a real
    server: tests talk to it over HTTP and WebSocket), or the OpenEnv server a ``script`` starts (``--port``).
    ``url`` is its address, ``log`` what it printed."""

    def __init__(self, envs_file, tag: str, key: str | None, log_path: Path, port: int | None = None,
                 script: str | None = None):
        import socket

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.envs_file, self.tag, self.key, self.log_path, self.port = str(envs_file), tag, key, log_path, port
        self.url = f"http://127.0.0.1:{port}"
        self.script = script
        self.proc = None

    def start(self, timeout_s: float = 120.0) -> "ServedTag":
        """Start the server and wait until its health check answers with the key."""
        import subprocess
        import sys
        import time

        import httpx

        env = {**os.environ, "AGENT_TRAINER_ENV_KEY": self.key or "", "PYTHONPATH": str(REPO)}
        cmd = ([sys.executable, self.script] if self.script else
               [sys.executable, "-m", "agent_trainer.serve_env", "--envs-file", self.envs_file, "--tag", self.tag])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve_env exited with {self.proc.returncode}: {self.log}")
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"serve_env did not answer within {timeout_s} s: {self.log}")

    def kill(self) -> None:
        """SIGKILL the server (as a crash would end it) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def serve_tag(tmp_path):
    """Start servers of env tags (``serve_tag(envs_file, tag, key)`` -> a started :class:`ServedTag`; with
    ``script=``, that script's server); every one is killed when the test ends."""
    servers = []

    def start(envs_file, tag: str, key: str | None, port: int | None = None, script: str | None = None) -> ServedTag:
        served = ServedTag(envs_file, tag, key, tmp_path / f"serve_{tag}_{len(servers)}.log", port, script)
        servers.append(served)
        return served.start()

    yield start
    for served in servers:
        served.kill()
