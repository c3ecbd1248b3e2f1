"""SyncMultiTurnRollout: non-finite rewards, per-tag generation budgets, ReMax's greedy baseline split.

The last test runs the real thing: a local Ray cluster, the HF rollout engine on the tiny
model and real env actors.
"""

import dataclasses
import math
import time
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from agent_trainer.common.batch import BatchMeta, TensorBatch
from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.checks.load import load_config
from agent_trainer.agents.ctx_manager import EpisodeContext
from agent_trainer.checks.prepare import CONFIG_DIR
from agent_trainer.rollout import SyncMultiTurnRollout, screen_nonfinite
from agent_trainer.training.trainer import AgentTrainer
from envs import load_env_tags


def _describe(env_id: int) -> str:
    return f"env tag 'Bandit', env_id {env_id}, group 0 (group seed 7), train split"


def _episode(env_id: int, rewards: list[float]) -> EpisodeContext:
    return EpisodeContext(env_id=env_id, group_id=0, tag="Bandit", rewards=rewards, response_mask=[1] * len(rewards))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_reward_stops_the_rollout_naming_the_episode(bad):
    episodes = [_episode(0, [0.0, 1.0]), _episode(1, [0.5, bad]), _episode(2, [bad])]
    with pytest.raises(RuntimeError) as err:
        screen_nonfinite(episodes, "error", _describe)
    message = str(err.value)
    assert "env tag 'Bandit', env_id 1, group 0 (group seed 7)" in message and "(2 of 3 episodes)" in message
    assert "algorithm.nonfinite_reward=drop" in message
    kept, dropped = screen_nonfinite(episodes, "drop", _describe)
    assert [e.env_id for e in kept] == [0] and dropped == 2
    with pytest.raises(RuntimeError, match="all 2 episodes"):
        screen_nonfinite(episodes[1:], "drop", _describe)
    assert screen_nonfinite(episodes[:1], "error", _describe) == (episodes[:1], 0)


def test_drop_removes_every_row_of_a_condensed_episode(tokenizer, play_mixed):
    ctx_mgr = CondensedContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    episodes = [played.episodes[k] for k in sorted(played.episodes)]
    episodes[1].rows[2].reward = math.nan  # episode 1 plays 4 turns; its third one got a NaN reward
    kept, dropped = screen_nonfinite(episodes, "drop", _describe)
    batch = ctx_mgr.build_update_batch(kept)
    assert dropped == 1 and 1 not in batch["traj_uid"].tolist()
    assert sorted(set(batch["traj_uid"].tolist())) == [0, 2, 3]
    assert torch.isfinite(batch["token_level_rewards"]).all()


def test_nonfinite_advantages_stop_the_step_naming_the_episode():
    """The episode is named with its own batch's group seeds (a prefetched rollout has replaced the last ones)."""
    trainer = SimpleNamespace(train_rollout=SimpleNamespace(
        describe_episode=lambda env_id, seeds: f"env_id {env_id} (group seed {seeds[0]})"))
    batch = TensorBatch({"response_mask": torch.tensor([[0, 1, 1], [0, 1, 0]]), "traj_uid": torch.tensor([4, 9])},
                        meta=BatchMeta(group_seeds=[7]))
    finite = torch.zeros(2, 3)
    AgentTrainer.check_finite(trainer, batch, finite, finite)
    outside_mask = finite.clone()
    outside_mask[1, 2] = math.nan  # not a generated token: ignored
    AgentTrainer.check_finite(trainer, batch, outside_mask, finite)
    bad = finite.clone()
    bad[1, 1] = math.inf
    with pytest.raises(RuntimeError, match=r"in 1 of 2 rows, the first in env_id 9 \(group seed 7\)"):
        AgentTrainer.check_finite(trainer, batch, finite, bad)


def _config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose("frozenlake", overrides=[
            "es_manager.train.env_groups=3", "es_manager.train.group_size=2",
            "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]", "es_manager.train.env_configs.n_groups=[1,2]",
            "ppo_mini_batch_size=6", "micro_batch_size_per_gpu=1", "agent_proxy.max_turn=2", "actor_rollout_ref.rollout.response_length=24",
            *overrides]))


@pytest.mark.e2e
def test_per_tag_budgets_and_the_greedy_baseline_split(ray_cluster, tiny_model_path, tokenizer):
    """FrozenLake3x3 replies stay within the tag's max_tokens = 3; ReMax baselines replay the group seeds."""
    from agent_trainer.training.lifecycle import kill_actors
    from agent_trainer.workers.env_worker import EnvWorker
    from agent_trainer.workers.rollout import HFRolloutWorker

    cfg = _config(f"model_path={tiny_model_path}")
    tags = load_env_tags()
    tags["FrozenLake3x3"] = dataclasses.replace(tags["FrozenLake3x3"], max_tokens=3)
    engine = ray_cluster.remote(HFRolloutWorker).options(num_cpus=0.5).remote(tiny_model_path, max_model_len=1536)
    env_cls = EnvWorker
    made = []  # the next test of the module starts env actors of the same names
    try:
        train = SyncMultiTurnRollout(cfg, tokenizer, [engine], env_cls, tags, split="train", num_env_actors=1)
        made.append(train)
        assert train.turn_budget == {"FrozenLake3x3": 3, "Bandit": 24}  # min(tag max_tokens, response_length)
        result = train.rollout(step=1)
        lengths = {tag: [len(ids) for e in train.episodes if e.tag == tag for ids in train.last_generations[e.env_id]]
                   for tag in ("FrozenLake3x3", "Bandit")}
        assert lengths["FrozenLake3x3"] and max(lengths["FrozenLake3x3"]) <= 3
        assert max(lengths["Bandit"]) > 3  # the small budget is the tag's, not a global one
        assert len(result.group_seeds) == 3 and result.metrics["rollout/nonfinite_dropped"] == 0

        baseline = SyncMultiTurnRollout(cfg, tokenizer, [engine], env_cls, tags, split="remax_baseline", num_env_actors=1)
        made.append(baseline)
        with pytest.raises(ValueError, match="seeds="):
            baseline.rollout(step=1)
        first = baseline.rollout(step=1, seeds=result.group_seeds)
        assert baseline.sampling_params().temperature == 0.0
        assert first.batch["uid"].tolist() == [0, 1, 2]  # one greedy episode per training group
        for group in range(3):  # ... starting from the group's initial state: the same first prompt
            row = int((result.batch["uid"] == group).nonzero()[0])
            start = int(result.batch["response_mask"][row].nonzero()[0])
            assert torch.equal(first.batch["input_ids"][group, :start], result.batch["input_ids"][row, :start])
        replies = dict(baseline.last_generations)
        baseline.rollout(step=2, seeds=result.group_seeds)
        assert dict(baseline.last_generations) == replies  # greedy: the same replies whatever the step
    finally:
        kill_actors([actor for rollout in made for actor in rollout.env_actors])


@pytest.mark.e2e
def test_the_next_reset_runs_while_the_step_trains(ray_cluster, tiny_model_path, tokenizer, caplog):
    """es_manager.prefetch_reset: rollout k+1's reset starts when rollout k is done. The batches are the ones
    a rollout that resets when it starts gives; a checkpoint counts only the resets used; an env actor that
    restarts after its prefetched reset ends its episodes (it never reset them) instead of stepping them."""
    import ray

    from agent_trainer.episode.es_manager import EnvStateManager
    from agent_trainer.training.lifecycle import kill_actors
    from agent_trainer.workers.worker_group import wait_until_ready
    from agent_trainer.workers.rollout import HFRolloutWorker

    env_worker_cls = ray.remote(num_cpus=0.1, max_restarts=1)(EnvStateManager)  # as agent_trainer.workers.build starts them
    engine = ray_cluster.remote(HFRolloutWorker).options(num_cpus=0.5).remote(tiny_model_path, max_model_len=1536)
    batches = {}
    for prefetch in (False, True):
        cfg = _config(f"model_path={tiny_model_path}", f"es_manager.prefetch_reset={str(prefetch).lower()}")
        rollout = SyncMultiTurnRollout(cfg, tokenizer, [engine], env_worker_cls, load_env_tags(), split="train",
                                       num_env_actors=2)
        results = [rollout.rollout(step=1)]
        assert rollout.num_resets == 1 and (rollout.resets.pending is not None) == prefetch
        results.append(rollout.rollout(step=2))
        batches[prefetch] = [r.batch for r in results]
        assert [r.metrics["rollout/reset_prefetched"] for r in results] == [0.0, float(prefetch)]
        if not prefetch:
            kill_actors(rollout.env_actors)
    for plain, prefetched in zip(batches[False], batches[True]):
        assert sorted(plain.keys()) == sorted(prefetched.keys())
        for key in plain.keys():
            assert torch.equal(plain[key], prefetched[key]), key

    # Env actor 0 dies after its prefetched reset finished; Ray restarts it with episodes never reset.
    pending = rollout.resets.pending[1]
    ray.wait(list(pending.refs.values()), num_returns=len(pending.refs), timeout=60)
    ray.kill(rollout.env_actors[0], no_restart=False)
    time.sleep(1.0)  # Ray notices the death ...
    wait_until_ready(rollout.env_actors[:1], timeout_s=120)  # ... and has restarted it
    third = rollout.rollout(step=3)
    assert third.metrics["rollout/env_actor_failures"] == 1 and third.metrics["rollout/reset_prefetched"] == 1
    assert "was never reset in this env actor" in caplog.text
    fourth = rollout.rollout(step=4)  # its prefetched reset found the restarted actor
    assert fourth.metrics["rollout/env_actor_failures"] == 0 and fourth.metrics["rollout/num_turns_mean"] > 1
    assert rollout.num_resets == 4
    kill_actors(rollout.env_actors)


@pytest.mark.e2e
def test_an_env_actor_killed_during_its_prefetched_reset_is_reset_again(ray_cluster, tiny_model_path, tokenizer):
    """The actor dies while the step trains and its prefetched reset runs: the next rollout sees the failed
    reset, waits for Ray's restart and resets it again; every episode plays."""
    import ray

    from agent_trainer.episode.es_manager import EnvStateManager
    from agent_trainer.training.lifecycle import kill_actors
    from agent_trainer.workers.rollout import HFRolloutWorker

    tags = load_env_tags()
    slow = dict(tags["FrozenLake3x3"].env_config, min_latency_ms=0.0, max_latency_ms=0.0, reset_latency_ms=500.0)
    tags["SlowReset"] = dataclasses.replace(tags["FrozenLake3x3"], env_type="slow_frozen_lake", env_config=slow)
    cfg = _config(f"model_path={tiny_model_path}", "es_manager.train.env_configs.tags=[SlowReset]",
                  "es_manager.train.env_configs.n_groups=[3]")
    env_worker_cls = ray.remote(num_cpus=0.1, max_restarts=1)(EnvStateManager)
    engine = ray_cluster.remote(HFRolloutWorker).options(num_cpus=0.5).remote(tiny_model_path, max_model_len=1536)
    rollout = SyncMultiTurnRollout(cfg, tokenizer, [engine], env_worker_cls, tags, split="train", num_env_actors=2)
    try:
        rollout.rollout(step=1)
        pending = rollout.resets.pending[1]
        time.sleep(0.3)  # actor 0 resets 4 episodes of 0.5 s: its prefetched reset is running
        assert not ray.wait([pending.refs[0]], timeout=0)[0]
        ray.kill(rollout.env_actors[0], no_restart=False)
        second = rollout.rollout(step=2)
        m = second.metrics
        assert m["rollout/reset_prefetched"] == 1 and m["rollout/env_actor_failures"] == 1
        assert m["rollout/reset_failures"] == 0 and len(second.batch) == 6
    finally:
        kill_actors(rollout.env_actors)
