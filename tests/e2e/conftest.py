"""Fixtures of the e2e tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def module_cluster():
    """One local Ray cluster for the module's in-process runs (e2e_runs.train_here), ended after its last test."""
    import ray

    yield
    ray.shutdown()
