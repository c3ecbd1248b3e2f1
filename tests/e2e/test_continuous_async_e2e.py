"""Continuous asynchronous training (trainer.max_off_policy_steps=2, trainer.async_mode=continuous) on the real
components: Ray, FSDP2 over gloo, vLLM's CPU build, env actors of a slow FrozenLake (every step sleeps 1 s).

The producer thread runs the next two steps' rollouts while a step trains. A rollout here lasts three turns of at
least a second each, longer than a step's update, so the actor's update lands while episodes are in flight: the
engines take the new weights between two engine calls and the episodes go on under them. Each generated token
records the version that produced it: some trained episode must carry two versions, and no trained token may be
more than two versions older than the weights its step trains from.
"""

from pathlib import Path

import pytest
import yaml

from agent_trainer.trainer import AgentTrainer
from e2e_runs import train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]
K = 2


class Recording(AgentTrainer):
    """Notes each step's trained tokens' versions, per episode, and the trainer's version."""

    trained: list[dict]

    def shape(self, batch, metrics):
        mask = batch["response_mask"].bool()
        episodes: dict[int, set[int]] = {}
        for row, uid in enumerate(batch["traj_uid"].tolist()):
            episodes.setdefault(uid, set()).update(batch["token_versions"][row][mask[row]].tolist())
        self.__dict__.setdefault("trained", []).append(
            {"step": self.global_step, "actor": self.versions.actor, "episodes": episodes,
             "rows": batch["policy_version"].tolist()})
        return super().shape(batch, metrics)


def slow_envs(tmp_path: Path) -> Path:
    path = tmp_path / "envs.yaml"
    base = yaml.safe_load((Path(__file__).parents[2] / "bench" / "slow_envs.yaml").read_text())["custom_envs"]["SlowFrozenLake3x3"]
    base["env_config"].update(min_latency_ms=1000, max_latency_ms=1000)
    path.write_text(yaml.safe_dump({"custom_envs": {"SlowFrozenLake3x3": base}}))
    return path


def test_episodes_in_flight_take_new_weights_and_no_token_is_more_than_k_versions_old(tiny_model_path, tmp_path):
    trainer, metrics = train_here(
        "frozenlake_grpo", tiny_model_path, tmp_path / "run", f"envs_file={slow_envs(tmp_path)}",
        "es_manager.train.env_configs.tags=[SlowFrozenLake3x3]", "es_manager.val.env_configs.tags=[SlowFrozenLake3x3]",
        "es_manager.train.env_configs.n_groups=[2]", "es_manager.train.env_groups=2", "es_manager.train.group_size=4",
        "trainer.total_training_steps=4", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.progress_bar=false", "trainer.log_trajectories_freq=0", "trainer.save_freq=0",
        f"trainer.max_off_policy_steps={K}", "trainer.async_mode=continuous",
        "algorithm.rollout_correction.rollout_is=token", "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2",
        "agent_proxy.max_turn=3", "actor_rollout_ref.rollout.response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3", trainer_cls=Recording)
    assert [r["step"] for r in trainer.trained] == [1, 2, 3, 4]

    # the bound, per token: every trained token's version is at most K behind the weights its step trains from
    for record in trainer.trained:
        assert record["actor"] == record["step"] - 1
        tokens = [v for versions in record["episodes"].values() for v in versions]
        assert tokens and all(0 <= record["actor"] - v <= K for v in tokens), record
        assert all(record["actor"] - v <= K for v in record["rows"])  # a row is as old as its oldest token
    assert all(m["rollout/policy_staleness"] <= K and m["rollout/stale_dropped"] == 0.0 for m in metrics)

    # an update landed mid-rollout: the engines took it between two engine calls, and some trained episode's
    # tokens come from two policy versions (its first turns under one, its later turns under the next)
    assert sum(m.get("rollout/in_flight_syncs", 0.0) for m in metrics) >= 1
    mixed = [versions for r in trainer.trained for versions in r["episodes"].values() if len(versions) > 1]
    assert mixed, [r["episodes"] for r in trainer.trained]
    assert all(max(v) - min(v) <= K for v in mixed)
    assert max(m["rollout/mixed_version_episodes"] for m in metrics) >= 1
    assert max(m["rollout/versions_in_batch"] for m in metrics) >= 2
