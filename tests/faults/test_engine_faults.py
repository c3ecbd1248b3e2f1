"""A rollout engine that misses ``actor_rollout_ref.rollout.generate_timeout_s`` is killed for a restart.

The deadline is tested on a real Ray actor whose call hangs (vLLM cannot be made to hang on
purpose); the engines killed during weight sync and mid-rollout are cases of the shared run in
tests/faults/test_env_faults.py.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.exceptions import GetTimeoutError

from agent_trainer.rollout import get_or_kill
from agent_trainer.workers.worker_group import wait_until_ready

pytestmark = pytest.mark.e2e


@ray.remote(max_restarts=1, num_cpus=0.01)
class SlowEngine:
    """A Ray actor whose ``generate`` takes as long as asked (a hung engine stand-in for the deadline)."""

    def generate(self, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()


def test_a_generate_call_past_its_deadline_kills_the_engine_for_a_restart(ray_cluster):
    engine = SlowEngine.remote()
    pid = ray.get(engine.generate.remote(0))
    start = time.monotonic()
    with pytest.raises(GetTimeoutError, match="generate_timeout_s"):
        get_or_kill([engine.generate.remote(3600)], [engine], timeout_s=2)
    assert time.monotonic() - start < 10
    wait_until_ready([engine], timeout_s=60)
    assert ray.get(engine.generate.remote(0)) != pid  # a fresh process: the hung one was killed
