"""The template-collapse rows (agent_trainer.episode.collapse_metrics) and their keys' start-up checks."""

import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from agent_trainer.common.batch import BatchMeta, TensorBatch
from agent_trainer.checks.load import load_config
from agent_trainer.episode.collapse_metrics import (collapse_metrics, collapse_metrics_due, cross_scoring_batch,
                                                    first_turns)
from agent_trainer.checks.prepare import CONFIG_DIR

# full mode, one row per episode: prompt (3), reply 1 (2), observation (1), reply 2 (2), padding (1)
MASK = [0, 0, 0, 1, 1, 0, 1, 1, 0]


def _full_batch(prompts: list[list[int]], replies: list[list[int]]) -> TensorBatch:
    rows = []
    for prompt, reply in zip(prompts, replies):
        rows.append(prompt + reply + [90, 91, 92, 0])  # observation, reply 2, padding
    return TensorBatch({
        "input_ids": torch.tensor(rows),
        "response_mask": torch.tensor([MASK] * len(rows)),
        "traj_uid": torch.arange(len(rows)),
    }, BatchMeta(temperature=0.7, group_seeds=[5, 6]))


def test_first_turns_take_the_prompt_and_the_first_reply_only():
    batch = _full_batch([[1, 2, 3], [4, 5, 6]], [[10, 11], [12, 13]])
    assert first_turns(batch) == [((1, 2, 3), (10, 11)), ((4, 5, 6), (12, 13))]


def test_per_turn_rows_take_each_episodes_first_row():
    # condensed mode: episode 7's rows are turn 1 then turn 2; episode 8 has one row
    batch = TensorBatch({
        "input_ids": torch.tensor([[1, 2, 10, 11, 0], [3, 4, 20, 21, 22], [5, 6, 30, 0, 0]]),
        "response_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]),
        "traj_uid": torch.tensor([7, 7, 8]),
    })
    assert first_turns(batch) == [((1, 2), (10, 11)), ((5, 6), (30,))]


def test_cross_scoring_rows_put_every_reply_after_every_prompt():
    # two groups of two episodes: two distinct prompts (of different lengths), four replies
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [4, 5, 6]]
    batch = _full_batch(prompts, [[10, 11], [12, 13], [14, 15], [16, 17]])
    plan = cross_scoring_batch(batch, num_prompts=8, seed=0)
    assert plan.num_prompts == 2 and plan.own.tolist() == [0, 0, 1, 1] and plan.lengths.tolist() == [2, 2, 2, 2]
    rows = plan.batch
    assert len(rows) == 8 and rows.meta.temperature == 0.7  # scored at the rollout temperature
    assert rows["input_ids"][1 * 2 + 1, :5].tolist() == [4, 5, 6, 12, 13]  # reply 1 after prompt 1
    assert rows["response_mask"][1 * 2 + 1].tolist() == [0, 0, 0, 1, 1]
    assert rows["attention_mask"].sum(-1).tolist() == [5] * 8
    assert rows["position_ids"][0].tolist() == [0, 1, 2, 3, 4]


def test_more_prompts_than_asked_are_drawn_by_the_seed():
    prompts = [[p, p, p] for p in range(1, 7)]
    batch = _full_batch(prompts, [[10 + p, 20 + p] for p in range(6)])
    a, b = cross_scoring_batch(batch, num_prompts=3, seed=1), cross_scoring_batch(batch, num_prompts=3, seed=1)
    assert a.num_prompts == 3 and len(a.own) == 3 and len(a.batch) == 9  # only the drawn prompts' replies
    assert torch.equal(a.batch["input_ids"], b.batch["input_ids"])
    draws = {tuple(cross_scoring_batch(batch, 3, seed=s).batch["input_ids"][:, 0].tolist()) for s in range(8)}
    assert len(draws) > 1


def test_metrics_from_the_actors_log_probs():
    """Each reply scores -0.5 per token after its own prompt and -30 after any other: MI = log M."""
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    plan = cross_scoring_batch(_full_batch(prompts, [[10, 11], [12, 13], [14, 15]]), num_prompts=8, seed=0)
    m = plan.num_prompts
    own_rows = torch.tensor([i * m + int(j) for i, j in enumerate(plan.own)])
    per_token = torch.full(plan.batch["input_ids"].shape, -30.0)
    per_token[own_rows] = -0.5
    per_token[plan.batch["response_mask"] == 0] = 0.0  # the actor's contract: 0 off the scored tokens
    metrics = collapse_metrics(plan, per_token)
    assert metrics["collapse/mi_seq_estimate"] == pytest.approx(math.log(3), abs=1e-9)
    assert metrics["collapse/mi_estimate"] == pytest.approx(math.log(3), abs=1e-9)
    assert metrics["collapse/mi_upper_bound"] == pytest.approx(math.log(3))
    assert metrics["collapse/conditional_entropy_seq_est"] == pytest.approx(1.0)
    assert metrics["collapse/conditional_entropy_est"] == pytest.approx(0.5)


def test_no_generated_token_no_rows():
    batch = TensorBatch({"input_ids": torch.ones(2, 3, dtype=torch.long), "response_mask": torch.zeros(2, 3),
                         "traj_uid": torch.arange(2)})
    assert cross_scoring_batch(batch, 8, seed=0) is None


def test_due_every_n_steps_and_at_the_last():
    assert [s for s in range(1, 8) if collapse_metrics_due(3, s, 7)] == [3, 6, 7]
    assert not any(collapse_metrics_due(0, s, 7) for s in range(1, 8))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("frozenlake", overrides=list(overrides))


@pytest.mark.parametrize("overrides, words", [
    (["trainer.collapse_metrics_num_prompts=1"], "trainer.collapse_metrics_num_prompts = 1 must be >= 2"),
    (["trainer.collapse_metrics_freq=-1"], "trainer.collapse_metrics_freq = -1 must be >= 0"),
    (["trainer.collapse_metrics_freq=5", "es_manager.train.env_groups=1", "es_manager.train.env_configs.n_groups=[1]",
      "ppo_mini_batch_size=4"], "es_manager.train.env_groups >= 2 or trainer.collapse_metrics_freq=0"),
])
def test_values_that_cannot_work_are_refused_in_one_line(overrides, words):
    with pytest.raises(ValueError) as err:
        load_config(_compose(*overrides))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_keys_load():
    cfg = load_config(_compose("trainer.collapse_metrics_freq=1", "trainer.collapse_metrics_num_prompts=2"))
    assert (cfg.trainer.collapse_metrics_freq, cfg.trainer.collapse_metrics_num_prompts) == (1, 2)


def test_the_trainer_scores_the_rows_with_the_actor_when_due():
    """``AgentTrainer.collapse_diagnostic`` on a fake actor: a reply scores well only after its own prompt
    (reply tokens 10 + p answer prompt p), so the MI is log M; off-step and with freq 0, no forward runs."""
    from types import SimpleNamespace

    from agent_trainer.config import AgentTrainerConfig
    from agent_trainer.training.trainer import AgentTrainer

    calls = []

    def dp_compute(method, rows):
        calls.append((method, len(rows)))
        ids, mask = rows["input_ids"], rows["response_mask"].bool()
        fits = (ids[:, :1] + 10 == ids).any(-1, keepdim=True)  # the row's reply answers its prompt
        return TensorBatch({"old_log_probs": torch.where(mask, torch.where(fits, -0.5, -30.0), 0.0)})

    cfg = AgentTrainerConfig()
    cfg.trainer.total_training_steps, cfg.trainer.collapse_metrics_freq = 10, 4
    cfg.trainer.collapse_metrics_num_prompts = 3
    trainer = AgentTrainer.__new__(AgentTrainer)
    trainer.cfg, trainer.actor_wg = cfg, SimpleNamespace(dp_compute=dp_compute)
    batch = _full_batch([[p, p, p] for p in (1, 1, 2, 2, 3, 3, 4, 4)], [[10 + p, 0] for p in (1, 1, 2, 2, 3, 3, 4, 4)])
    trainer.global_step = 3
    assert trainer.collapse_diagnostic(batch) == {} and calls == []
    trainer.global_step = 4
    metrics = trainer.collapse_diagnostic(batch)
    assert calls == [("compute_log_prob", 6 * 3)]  # 3 of the 4 prompts drawn: their 6 replies after each
    assert metrics["collapse/num_prompts"] == 3 and metrics["timing_s/collapse"] >= 0
    assert metrics["collapse/mi_seq_estimate"] == pytest.approx(math.log(3), abs=1e-9)
    cfg.trainer.collapse_metrics_freq = 0
    assert trainer.collapse_diagnostic(batch) == {} and len(calls) == 1
