"""Shared fixtures: the tiny model (built once per session) and a local Ray cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """``make test`` runs two pytest-xdist workers (``--dist loadgroup``): each test module goes to one worker
    whole (its module fixtures run once), and every ``shared_cluster`` test to the same worker, so those runs
    share one Ray cluster (tests/e2e/conftest.py). A run's start is CPU-bound only in parts (imports, model
    loads); its waits on Ray, on sockets and on the other processes leave a core for the other worker."""
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
        return env_path
    from launch.build_tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-model") / "tiny-qwen2"
    return str(build_tiny_model(out, warmup_steps=0))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module (2 CPUs' worth of fractional accounting)."""
    import ray

    if not ray.is_initialized():
        from agent_trainer.main import WORKERS_AT_NORMAL_PRIORITY, local_cluster_system_config

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _system_config=local_cluster_system_config(WORKERS_AT_NORMAL_PRIORITY))
    yield ray
    ray.shutdown()


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
