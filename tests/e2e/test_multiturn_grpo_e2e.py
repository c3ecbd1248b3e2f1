"""Multi-turn GRPO with context condensation end to end (real Ray, FSDP2 over gloo, vLLM CPU, tiny model).

Each test trains 2 steps with a seed-004 config (``config/multiturn_grpo_math.yaml`` with the
``simple`` and the ``summary`` condenser, ``config/multiturn_grpo_coding.yaml``) on the question
environment over the shipped sets, with tiny sizes. The last step's training batch is checked:
one row per turn, ``response_mask`` 1 exactly on the tokens the engine generated for that turn,
the trajectory's one advantage on every output token of all its rows, and (summary) the
policy-written summaries in the context of later turns but never in the mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from agent_trainer.training.trainer import AgentTrainer
from e2e_runs import train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

TINY = ["trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.progress_bar=false",
        "algorithm.multiturn_grpo.n_trajectories_per_question=2", "algorithm.multiturn_grpo.max_turns_per_trajectory=3",
        "algorithm.multiturn_grpo.max_context_length=768", "multiturn_trajectory.generation.max_new_tokens=16",
        "es_manager.train.env_groups=2", "es_manager.train.env_configs.n_groups=[2]", "agent_proxy.num_env_actors=1",
        "es_manager.val.env_groups=2", "es_manager.val.env_configs.n_groups=[2]",
        "actor_rollout_ref.actor.fsdp.world_size=1", "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2",
        "trainer.log_trajectories_freq=0"]


class BatchRecordingTrainer(AgentTrainer):
    """The trainer, keeping the batch whose advantages it just computed (the real one, not a copy)."""

    def compute_advantage(self, batch):
        metrics = super().compute_advantage(batch)
        self.last_batch = batch
        return metrics


def train(model_path: str, run_dir, config: str, *overrides: str):
    """Compose ``config`` with the tiny overrides, train 2 steps here; returns (trainer, history)."""
    return train_here(config, model_path, run_dir, *TINY, *overrides, trainer_cls=BatchRecordingTrainer)


def check_rows(trainer) -> None:
    """Every row is one turn: mask 1 exactly on that turn's generated ids; one advantage per trajectory."""
    batch = trainer.last_batch
    generations = trainer.train_rollout.last_generations  # the engine's ids per episode and turn, last step
    real = batch["response_mask"].sum(-1) > 0  # padding rows for the update have an all-zero mask
    assert int(real.sum()) == sum(len(turns) for turns in generations.values())
    for row in real.nonzero().flatten().tolist():
        ids, mask = batch["input_ids"][row], batch["response_mask"][row].bool()
        turn = int(batch["turn_ids"][row][mask][0])
        assert ids[mask].tolist() == generations[int(batch["traj_uid"][row])][turn - 1]
        assert mask.nonzero().flatten().tolist() == list(range(int(mask.nonzero()[0]), int(mask.nonzero()[-1]) + 1))
    for traj in batch["traj_uid"][real].unique().tolist():
        rows = real & (batch["traj_uid"] == traj)
        mask = batch["response_mask"][rows].bool()
        adv = batch["advantages"][rows]
        assert torch.allclose(adv[mask], adv[mask][0].expand(int(mask.sum())))
        assert adv[~mask].abs().sum() == 0


def check_metrics(history) -> None:
    for m in history:
        assert math.isfinite(m["actor/pg_loss"]) and "rollout/trajectory_reward_mean" in m
        assert m["timing_s/generate"] > 0 and m["timing_s/reward_computation"] >= 0
        assert m["profile/context_tokens_after_turn_1"] > 0


def test_math_with_the_simple_condenser_trains_two_steps(tiny_model_path, tmp_path):
    trainer, history = train(tiny_model_path, tmp_path / "run", "multiturn_grpo_math")
    assert len(history) == 2
    check_metrics(history)
    check_rows(trainer)


def test_math_with_the_summary_condenser_trains_two_steps_and_never_trains_on_summaries(tiny_model_path, tmp_path):
    trainer, history = train(tiny_model_path, tmp_path / "run", "multiturn_grpo_math",
                             "multiturn_trajectory.context_condenser.type=summary",
                             "multiturn_trajectory.context_condenser.keep_last_n_steps=1",
                             "multiturn_trajectory.context_condenser.summary_max_tokens=12",
                             "data.final_marker=NEVER-FINAL")  # every episode plays all 3 turns
    check_metrics(history)
    check_rows(trainer)  # mask 1 only on the turns' own generations: no summary token
    last = history[-1]
    assert last["profile/summaries"] == 4  # turn 3 of each of the 4 episodes summarised turn 1
    assert last["profile/summary_tokens"] > 0 and last["timing_s/summary_generate"] > 0
    batch = trainer.last_batch
    third = (batch["turn_ids"] == 3).any(-1)
    tokenizer = trainer.tokenizer
    for row in third.nonzero().flatten().tolist():
        context = batch["input_ids"][row][(batch["attention_mask"][row] == 1) & (batch["response_mask"][row] == 0)]
        assert "Summary of turns 1-1:" in tokenizer.decode(context.tolist())


def test_coding_config_trains_two_steps(tiny_model_path, tmp_path):
    trainer, history = train(tiny_model_path, tmp_path / "run", "multiturn_grpo_coding")
    check_metrics(history)
    check_rows(trainer)
