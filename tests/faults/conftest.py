"""Fault-injection tests (docs/reliability.md): every test here carries the ``faults`` marker."""

from __future__ import annotations

import time

import psutil
import pytest


def pytest_collection_modifyitems(config, items):
    """Mark every test of tests/faults with ``faults``."""
    for item in items:
        if "/tests/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)


def ray_descendants() -> list[psutil.Process]:
    """Ray processes (gcs, raylet, workers) started by this test process and still alive."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(proc.cmdline()).lower() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def wait_for_no_ray_descendants(timeout_s: float = 30.0) -> list[psutil.Process]:
    """Poll until no Ray process of this test process is left; returns the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (alive := ray_descendants()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


@pytest.fixture(scope="session")
def no_ray_left():
    """``no_ray_left(timeout_s)``: the Ray processes of this test process still alive after waiting (want [])."""
    return wait_for_no_ray_descendants

