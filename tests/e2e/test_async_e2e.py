"""Asynchronous training (trainer.max_off_policy_steps=2) on the real components: Ray, FSDP2 over gloo, vLLM's
CPU build, the FrozenLake/Bandit env actors.

Run A trains 4 GRPO steps with k = 2: a producer thread keeps the next two steps' rollouts generating while a
step trains, syncing the engines to the newest actor version between two rollouts. Every trained row carries
the policy version that generated it; none may be more than 2 versions older than the weights its step trains
from, and the first steps' batches (queued before any update) must be stale. Its step-2 checkpoint is written
while steps 3 and 4 are buffered: it does not hold them (counted), and saves the reset counter from before them.

Run B resumes from A's step-2 checkpoint: it regenerates steps 3 and 4 from the same initial states, so the
episodes trained over A's steps 1-2 and B's steps 3-4 are A's episodes, none twice and none lost.

Both runs set ``actor.target_kl`` below any moved policy's KL: each step's first mini-batch (scored by the
weights it trains from) takes its optimizer step, the second (after it) stops the update, on both actor ranks.
"""

import json
from pathlib import Path

import pytest

from agent_trainer.training.trainer import AgentTrainer
from e2e_runs import train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]
K = 2


class Recording(AgentTrainer):
    """Notes what each step trains on (its groups' seeds, its rows' policy versions, the trainer's version)."""

    trained: list[dict]

    def shape(self, batch, metrics):
        self.__dict__.setdefault("trained", []).append(
            {"step": self.global_step, "seeds": list(batch.meta.group_seeds),
             "versions": batch["policy_version"].tolist(), "actor": self.versions.actor})
        return super().shape(batch, metrics)


def _train(model_path: str, run_dir: Path, *overrides: str) -> tuple[Recording, list[dict[str, float]]]:
    return train_here("frozenlake_grpo", model_path, run_dir,
                      "trainer.total_training_steps=4", "trainer.test_freq=0", "trainer.val_before_train=false",
                      "trainer.progress_bar=false", "trainer.log_trajectories_freq=0", "trainer.save_freq=2",
                      f"trainer.max_off_policy_steps={K}", "algorithm.rollout_correction.rollout_is=token",
                      "es_manager.train.env_groups=2", "es_manager.train.group_size=4",
                      "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]",
                      "es_manager.train.env_configs.n_groups=[1,1]", "ppo_mini_batch_size=4",
                      "micro_batch_size_per_gpu=2", "agent_proxy.max_turn=2",
                      "actor_rollout_ref.rollout.response_length=16", "actor_rollout_ref.actor.optim.lr=1e-3",
                      "actor_rollout_ref.actor.target_kl=1e-8", *overrides, trainer_cls=Recording)


def test_asynchronous_training_bounds_staleness_and_resumes_without_training_an_episode_twice(tiny_model_path,
                                                                                                 tmp_path):
    a, metrics = _train(tiny_model_path, tmp_path / "a")
    assert [r["step"] for r in a.trained] == [1, 2, 3, 4]

    # the bound, per row: the policy that generated it is at most K versions older than the one it trains from
    for record in a.trained:
        assert record["actor"] == record["step"] - 1
        assert all(0 <= record["actor"] - v <= K for v in record["versions"]), record
    staleness = [m["rollout/policy_staleness"] for m in metrics]
    assert staleness[0] == 0.0 and all(s <= K for s in staleness), staleness
    assert max(staleness) >= 1.0  # steps 2 and 3 were queued before step 1's update
    for m in metrics:
        assert (m["actor/kl_stopped"], m["actor/optimizer_steps"]) == (1.0, 1.0)  # of 2 mini-batches
        assert m["actor/approx_kl"] > 1e-8 / 2  # the second mini-batch's, averaged with the first's (about 0)
        assert m["rollout/stale_dropped"] == 0.0
        assert m["rollout/mismatch_kl"] >= 0.0 and m["rollout/policy_staleness_mean"] <= K
        assert sum(m[f"rollout/policy_staleness_frac/{lag}"] for lag in range(K + 1)) == pytest.approx(1.0)
    stale = next(m for m in metrics if m["rollout/policy_staleness"] >= 1.0)
    assert stale["rollout/mismatch_kl"] > 10 * max(metrics[0]["rollout/mismatch_kl"], 1e-8)  # the KL sees staleness

    # step 2's checkpoint was written with steps 3 and 4 buffered: it counts them, holds neither, and saves the
    # reset counter of step 2's, so a resumed run plays step 3 from the same initial states
    assert metrics[1]["rollout/buffered_not_checkpointed"] == 2.0
    state = json.loads((tmp_path / "a" / "global_step_2" / "trainer_state.json").read_text())
    assert state["env_resets"]["train"] == 2, state["env_resets"]

    b, resumed = _train(tiny_model_path, tmp_path / "b", "trainer.resume_mode=resume_path",
                        f"trainer.resume_from_path={tmp_path / 'a' / 'global_step_2'}")
    assert [r["step"] for r in b.trained] == [3, 4]
    assert b.trained[0]["versions"] == [2] * len(b.trained[0]["versions"])  # regenerated by the saved weights
    seeds_a = [r["seeds"] for r in a.trained]
    trained = seeds_a[:2] + [r["seeds"] for r in b.trained]
    flat = [seed for step in trained for seed in step]
    assert all(seeds_a) and len(set(flat)) == len(flat)  # no episode group trained twice
    assert trained == seeds_a  # and none lost: the uninterrupted run's episodes
