"""On-policy distillation end to end on the tiny model (real Ray, FSDP2 over gloo, vLLM CPU, env actors): the
teacher is another model than the student (the tiny model with perturbed weights, saved to a temporary folder),
loaded in a group of its own. Two steps each:

- mode advantage, full-weight student, multi-turn FrozenLake and single-turn Bandit: every trained row's advantage
  is log p_teacher - log p_student of its generated tokens, both computed here independently with transformers on
  the same ids (the student of step 1 is the model on disk), 0 on every other token;
- mode reward, LoRA student, the teacher hosted by the actor's ranks (colocate): the token rewards the estimator
  saw are the task's plus coef times the same difference.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_trainer.training.trainer import AgentTrainer
from e2e_runs import train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

TINY = [
    "trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false",
    "trainer.progress_bar=false", "trainer.log_trajectories_freq=0",
    "es_manager.train.env_groups=2", "es_manager.train.group_size=2",
    "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]", "es_manager.train.env_configs.n_groups=[1,1]",
    "agent_proxy.max_turn=2", "agent_proxy.num_env_actors=1", "actor_rollout_ref.rollout.response_length=16",
    "actor_rollout_ref.actor.fsdp.world_size=1", "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.optim.lr=1e-3", "algorithm.adv_estimator=grpo",
]


class BatchRecordingTrainer(AgentTrainer):
    """The trainer, keeping step 1's batch after its advantages were computed, and its task rewards before."""

    def compute_advantage(self, batch):
        task_rewards = batch["token_level_rewards"].clone()
        metrics = super().compute_advantage(batch)
        if self.global_step == 1:
            self.first_batch = {k: batch[k].clone() for k in ("input_ids", "attention_mask", "response_mask",
                                                              "advantages", "token_level_rewards")}
            self.first_batch["task_rewards"] = task_rewards
            self.teacher_in_actor = self.teacher_wg is self.actor_wg  # algorithm.distill.colocate
        return metrics


@pytest.fixture(scope="module")
def teacher_path(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with every weight moved by N(0, 0.05) noise: another model, the same tokenizer."""
    folder = tmp_path_factory.mktemp("teacher")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return str(folder)


def token_log_probs(model_path: str, batch: dict) -> torch.Tensor:
    """log p(token_t | tokens_<t) [B, T] of every attended token after the first, under ``model_path`` with
    transformers, each row alone without padding (temperature 1, as the rollout sampled)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = torch.zeros(batch["input_ids"].shape)
    for row in range(len(out)):
        where = batch["attention_mask"][row].nonzero().flatten()
        ids = batch["input_ids"][row][where]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
        out[row, where[1:]] = lp
    return out


def real_rows(batch: dict) -> torch.Tensor:
    return batch["response_mask"].sum(-1) > 0


def test_advantage_mode_trains_on_the_teacher_minus_the_student_per_token(tiny_model_path, teacher_path, tmp_path):
    trainer, history = train_here("frozenlake", tiny_model_path, tmp_path / "run", *TINY,
                                  "algorithm.distill.enable=true", f"algorithm.distill.teacher_path={teacher_path}",
                                  trainer_cls=BatchRecordingTrainer)
    assert len(history) == 2 and not trainer.teacher_in_actor  # a group of its own
    for m in history:
        assert m["timing_s/teacher"] > 0 and math.isfinite(m["actor/pg_loss"])
        assert m["distill/signal_abs_mean"] > 1e-3  # another model: the teacher disagrees on the student's tokens
        assert m["critic/advantages_mean"] == pytest.approx(-m["distill/reverse_kl"], abs=1e-5)
    batch = trainer.first_batch
    mask = batch["response_mask"].bool()
    assert int(real_rows(batch).sum()) == 4 and int(mask.sum()) > 0
    expected = token_log_probs(teacher_path, batch) - token_log_probs(tiny_model_path, batch)
    advantages = batch["advantages"]
    rows = real_rows(batch)
    assert torch.allclose(advantages[rows][mask[rows]], expected[rows][mask[rows]], atol=1e-4), \
        (advantages[rows][mask[rows]] - expected[rows][mask[rows]]).abs().max()
    assert advantages[rows][~mask[rows]].abs().sum() == 0  # prompts, observations, padding: no signal
    multi_turn = [r for r in rows.nonzero().flatten().tolist()
                  if mask[r].int().diff().eq(1).sum() + int(mask[r, 0]) >= 2]  # two separate generated spans
    assert multi_turn, "no FrozenLake episode played two turns; the multi-turn rows were not checked"


def test_reward_mode_adds_the_weighted_difference_to_a_lora_students_rewards_with_a_colocated_teacher(tiny_model_path, teacher_path, tmp_path):
    trainer, history = train_here("frozenlake", tiny_model_path, tmp_path / "run", *TINY,
                                  "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.optim.lr=2e-2",
                                  "algorithm.distill.enable=true", f"algorithm.distill.teacher_path={teacher_path}",
                                  "algorithm.distill.mode=reward", "algorithm.distill.coef=0.5",
                                  "algorithm.distill.colocate=true", trainer_cls=BatchRecordingTrainer)
    assert trainer.teacher_in_actor  # the actor's ranks answered compute_teacher_log_prob
    assert len(history) == 2 and all(m["distill/signal_abs_mean"] > 1e-3 for m in history)
    batch = trainer.first_batch
    rows, mask = real_rows(batch), batch["response_mask"].bool()
    # step 1's student is the base model (a fresh adapter adds 0)
    signal = 0.5 * (token_log_probs(teacher_path, batch) - token_log_probs(tiny_model_path, batch))
    expected = batch["task_rewards"] + torch.where(mask, signal, 0.0)
    assert torch.allclose(batch["token_level_rewards"][rows], expected[rows], atol=1e-4)
