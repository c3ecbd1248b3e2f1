"""A build of the run's workers that fails halfway leaves nothing running in a cluster that lives on.

The real builder on a real local Ray cluster: PPO with the critic in a group of its own, whose model folder has a
config but no weights, so the critic's ranks raise in ``init_model`` after the actor group, the critic group and
the engine are placed. Before the builder shut down what it had started, those groups kept their placement
groups and actors, and the next run in the same cluster (a notebook's, the test suite's shared one) waited for a
placement that never came.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import ray

from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.workers.build import build_workers

pytestmark = pytest.mark.e2e


def test_a_build_that_fails_in_init_model_frees_every_group_it_started(ray_cluster, tiny_model_path, tmp_path):
    no_weights = tmp_path / "critic_without_weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(tiny_model_path) / name).exists():
            shutil.copy(Path(tiny_model_path) / name, no_weights / name)
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", f"trainer.default_local_dir={tmp_path / 'run'}",
                                  "critic.colocate=false", "actor_rollout_ref.rollout.name=hf",
                                  "actor_rollout_ref.actor.fsdp.num_cpus_per_rank=0.25",
                                  "critic.fsdp.num_cpus_per_rank=0.25"], "frozenlake")
    cfg.critic.model.path = str(no_weights)  # after the start-up checks, which would refuse it
    cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(Exception, match="(?i)critic"):
        build_workers(cfg)
    deadline = time.monotonic() + 120  # a liveness bound, not a speed one: without the cleanup it never frees
    while ray.available_resources().get("CPU", 0.0) < cpus and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0.0) == cpus, (ray.available_resources(), cpus)
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states
