"""EnvStateManager inside real Ray actors (workers/env_worker.py)."""

import pytest

ray = pytest.importorskip("ray")

from agent_trainer.es_manager import EnvInput, EsManagerConfig, group_seeds, plan_episodes  # noqa: E402
from envs import load_env_tags  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_two_tags_across_two_actors(ray_local):
    from workers.env_worker import EnvWorker

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
    assert [s["env_id"] for s in states] == [0, 1, 2, 3]
    assert states[1]["penalty"] == pytest.approx(cfg.format_penalty)
    assert states[0]["metrics"]["num_actions"] in (1.0, 2.0)
