"""End to end on the tiny model with the real components: a local Ray cluster, 2 FSDP2 actor
ranks over gloo, 1 FSDP2 critic rank, 1 vLLM (CPU build) rollout engine and 2 env actors."""

import json
import math
import os

import pytest
import ray
import torch
from transformers import AutoTokenizer

from e2e_runs import started

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

SMALL = [
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
    "trainer.val_before_train=false",
    "trainer.progress_bar=false",
    "es_manager.train.env_groups=2",
    "es_manager.train.group_size=4",
    # two tags in one config: multi-turn FrozenLake, and a Bandit whose random payout
    # guarantees reward variance (so advantages, and therefore updates, are non-zero)
    "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]",
    "es_manager.train.env_configs.n_groups=[1,1]",
    "es_manager.val.env_groups=4",
    "es_manager.val.env_configs.n_groups=[4]",
    "ppo_mini_batch_size=4",
    "micro_batch_size_per_gpu=2",
    "agent_proxy.max_turn=2",
    "actor_rollout_ref.rollout.response_length=24",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.rollout.num_threads=2",  # not the default (auto: 1 for the tiny model)
    "trainer.collapse_metrics_freq=1",  # RAGEN-2's template-collapse diagnostic on both steps
]


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory):
    """Two PPO steps on the e2e tests' shared cluster; yields the trainer (workers alive), its step metrics,
    and pre-training weights."""
    with started("frozenlake", tiny_model_path, tmp_path_factory.mktemp("run"), *SMALL) as trainer:
        before = ray.get(trainer.actor_wg.execute_all_async("full_state_dict"))[0]
        history = trainer.fit()
        yield trainer, history, before


def test_two_steps_train_and_log(trained):
    trainer, history, _ = trained
    assert len(history) == 2
    for key in ("rollout/success_rate", "rollout/episode_reward_mean", "rollout/num_turns_mean",
                "rollout/response_length_mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                "actor/grad_norm", "critic/vf_loss", "timing_s/rollout", "timing_s/log_prob", "timing_s/values",
                "timing_s/adv", "timing_s/update_critic", "timing_s/update_actor", "timing_s/sync", "timing_s/step"):
        assert key in history[0], key
    assert "val/success_rate" in history[1]
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    for record in map(json.loads, lines):  # two groups, two distinct first prompts (a FrozenLake map, a Bandit)
        assert record["collapse/mi_upper_bound"] == pytest.approx(math.log(2))
        for key in ("collapse/mi_estimate", "collapse/mi_seq_estimate"):
            # at most log M by construction; a small batch can read slightly below 0 (RAGEN notes the same)
            assert -0.25 <= record[key] <= math.log(2) + 1e-9, (key, record[key])
        for key in ("collapse/conditional_entropy_est", "collapse/conditional_entropy_seq_est"):
            assert math.isfinite(record[key]) and record[key] > 0, (key, record[key])
        assert record["collapse/num_responses"] == 8 and record["timing_s/collapse"] > 0


def test_actor_parameters_changed(trained):
    trainer, _, before = trained
    after = ray.get(trainer.actor_wg.execute_all_async("full_state_dict"))[0]
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, changed


def test_rollout_logprobs_match_actor_before_update(trained):
    """The engine sampled with the actor's synced weights: its logprobs equal the actor's old_log_probs."""
    _, history, _ = trained
    for metrics in history:
        assert metrics["actor/rollout_vs_actor_logprob_diff"] < 1e-3


def test_the_engine_runs_the_configured_threads(trained):
    trainer, _, _ = trained
    assert ray.get(trainer.engines[0].intra_op_threads.remote()) == 2  # rollout.num_threads, through OMP_NUM_THREADS


def test_workers_run_at_normal_priority(trained):
    """A local cluster's workers at niceness 0, not Ray's 15, at which any unrelated process starves them."""
    niceness = ray.remote(num_cpus=0)(lambda: os.nice(0))  # the run's actors hold every CPU of the cluster
    assert ray.get(niceness.remote(), timeout=300) == 0


def test_weight_sync_is_real(trained):
    """After the sync, vLLM's logprobs on fixed sequences equal the FSDP actor's compute_log_prob."""
    trainer, _, _ = trained
    tok = trainer.tokenizer
    texts = ["<think>go down</think><answer>Down</answer>", "Observation:\nP_O\n__G", "Reward: 1\nLeft Right Up"]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    vllm_lp = ray.get(trainer.engines[0].prompt_logprobs.remote(seqs))
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    from agent_trainer.common.batch import TensorBatch

    batch = TensorBatch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
    actor_lp = trainer.actor_wg.dp_compute("compute_log_prob", batch)["old_log_probs"]
    for i, s in enumerate(seqs):
        diff = (torch.tensor(vllm_lp[i][1:]) - actor_lp[i, 1 : len(s)]).abs().max().item()
        assert diff < 1e-3, (i, diff)


def test_response_mask_covers_exactly_the_generated_tokens(trained):
    trainer, _, _ = trained
    result = trainer.train_rollout.rollout()
    batch = result.batch
    for row, env_id in enumerate(batch["traj_uid"].tolist()):
        generated = [t for turn in trainer.train_rollout.last_generations[env_id] for t in turn]
        masked = batch["input_ids"][row][batch["response_mask"][row].bool()].tolist()
        assert masked == generated
        assert len(generated) > 0


def test_a_dead_env_actor_is_reported_and_survived(trained):
    trainer, _, _ = trained
    rollout = trainer.train_rollout
    ray.kill(rollout.env_actors[0], no_restart=False)
    result = rollout.rollout()
    m = result.metrics
    assert m["rollout/env_actor_failures"] >= 1
    # each episode of the killed actor either played again on its restart (killed before its reset) or, when the
    # prefetched reset had already run there, ended at its first step: left out of the batch and counted
    assert len(result.batch) + m["rollout/env_actor_lost"] == len(rollout.episodes)
    assert len(result.batch) >= len(rollout.episodes) - len(rollout.episodes) // len(rollout.env_actors)
    assert rollout.rollout().metrics["rollout/env_actor_failures"] == 0


def test_checkpoint_is_a_loadable_hf_model(trained):
    from transformers import AutoModelForCausalLM

    trainer, _, _ = trained
    path = trainer.save_checkpoint() / "actor"
    assert (trainer.run_dir / "latest_checkpointed_iteration.txt").read_text() == str(trainer.global_step)
    model = AutoModelForCausalLM.from_pretrained(path)
    state = ray.get(trainer.actor_wg.execute_all_async("full_state_dict"))[0]
    for key, value in model.state_dict().items():
        if key in state:
            assert torch.equal(value, state[key]), key
    assert AutoTokenizer.from_pretrained(path).eos_token_id == trainer.tokenizer.eos_token_id

