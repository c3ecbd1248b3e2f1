"""Shared fixtures: the tiny model (built once per session) and a local Ray cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
