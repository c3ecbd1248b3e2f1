"""EnvStateManager inside real Ray actors (agent_trainer/workers/env_worker.py)."""

import time

import pytest

ray = pytest.importorskip("ray")

from agent_trainer.config.envs import EsManagerConfig  # noqa: E402
from agent_trainer.episode.es_manager import (EnvInput, EnvStateManager, group_seeds,  # noqa: E402
                                      plan_episodes)
from envs import load_env_tags  # noqa: E402


def test_two_tags_across_two_actors(ray_cluster):
    from agent_trainer.workers.env_worker import EnvWorker

    cfg = EsManagerConfig.from_dict({
        "max_actions_per_turn": 2,
        "train": {"env_groups": 2, "group_size": 2,
                  "env_configs": {"tags": ["FrozenLake", "SimpleSokoban"], "n_groups": [1, 1]}},
    })
    tags = load_env_tags()
    plan = plan_episodes(cfg.train)
    shards = [plan[:2], plan[2:]]  # whole groups per actor
    actors = [EnvWorker.remote(tags, shard, cfg.format_penalty, cfg.action_sep, cfg.max_actions_per_turn)
              for shard in shards]
    seeds = dict(enumerate(group_seeds("train", cfg.train.env_groups, 0, cfg.seed)))
    resets = sum(ray.get([a.reset.remote(seeds) for a in actors]), [])
    assert [o.tag for o in resets] == ["FrozenLake"] * 2 + ["SimpleSokoban"] * 2
    assert resets[2].observation == resets[3].observation and "#" in resets[2].observation
    assert resets[0].observation == resets[1].observation
    outs = ray.get(actors[0].step.remote([EnvInput(0, "r", ["Down", "Right"]), EnvInput(1, "r", [])]))
    assert outs[1].reward == pytest.approx(cfg.format_penalty)
    states = sum(ray.get([a.get_rollout_states.remote() for a in actors]), [])
    assert [s.env_id for s in states] == [0, 1, 2, 3]
    assert states[1].penalty == pytest.approx(cfg.format_penalty)
    assert states[0].metrics["num_actions"] in (1.0, 2.0)


def _slow_start_pool(name: str, **remote_options):
    from agent_trainer.rollout.env_pool import EnvActorPool

    class SlowStartManager(EnvStateManager):  # defined in a function: Ray ships it by value (tests/ is no package)
        """An env state manager whose actor takes 3 s to start (a process start on a busy machine)."""

        def __init__(self, *args, **kwargs):
            import time

            time.sleep(3.0)
            super().__init__(*args, **kwargs)

        def get_rollout_states(self):
            import time

            time.sleep(2.0)  # long enough to be killed in
            return super().get_rollout_states()

    cfg = EsManagerConfig.from_dict({"train": {"env_groups": 1, "group_size": 2,
                                               "env_configs": {"tags": ["Bandit"], "n_groups": [1]}}})
    pool = EnvActorPool(ray.remote(num_cpus=0.1, **remote_options)(SlowStartManager), name,
                        [plan_episodes(cfg.train)],
                        dict(tags=load_env_tags(), format_penalty=cfg.format_penalty, action_sep=cfg.action_sep,
                             max_actions_per_turn=cfg.max_actions_per_turn))
    return pool, cfg


def test_a_call_deadline_starts_once_the_actor_has_started(ray_cluster):
    """es_manager.env_reset_timeout_s 1 s against a 3 s start: the reset is not taken for a hung env."""
    pool, cfg = _slow_start_pool("slowstart")
    try:
        call = pool.call("reset", {0: dict(enumerate(group_seeds("train", 1, 0, cfg.seed)))}, timeout_s=1.0)
        assert call.timed_out == [] and call.failed == [] and len(call.results) == 2
        assert pool.replaced == 0
    finally:
        ray.kill(pool.actors[0])


def test_after_an_actor_died_the_next_call_waits_for_its_restart(ray_cluster):
    """An actor killed in a call (Ray restarts it, 3 s to start) fails that call; the next calls wait for the
    restart instead of failing while Ray restarts it."""
    pool, cfg = _slow_start_pool("restarting", max_restarts=1)
    seeds = dict(enumerate(group_seeds("train", 1, 0, cfg.seed)))
    try:
        assert len(pool.call("reset", {0: seeds}, timeout_s=60.0).results) == 2
        in_flight = pool.submit("get_rollout_states", {0: None}, timeout_s=60.0)
        time.sleep(0.5)
        ray.kill(pool.actors[0], no_restart=False)
        died = pool.collect(in_flight)
        assert died.failed == [0] and died.results == []
        states = pool.call("get_rollout_states", {0: None}, timeout_s=60.0)
        assert states.failed == [] and states.timed_out == [] and len(states.results) == 2
        reset = pool.call("reset", {0: seeds}, timeout_s=60.0)
        assert reset.failed == [] and len(reset.results) == 2 and pool.replaced == 0
    finally:
        ray.kill(pool.actors[0])
