"""Padding a variable-size batch to whole mini-batches: equal work on every rank, no effect on any loss."""

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.training.trainer import pad_for_update
from agent_trainer.workers.worker_group import split_for_ranks


@pytest.fixture()
def condensed_batch(tokenizer, play_mixed):
    """A real condensed batch (9 rows from 4 episodes) with advantages and old log probs, as before an update."""
    ctx_mgr = CondensedContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    adv, ret = core_algos.compute_advantage(batch.tensors, "grpo_multiturn")
    batch["advantages"], batch["returns"] = adv, ret
    batch["old_log_probs"] = batch["rollout_log_probs"]
    return batch


def test_padding_rows_are_masked_copies_appended_at_the_end(condensed_batch):
    n = len(condensed_batch)
    assert n % 8 != 0
    padded, n_pad = pad_for_update(condensed_batch, 8)
    assert len(padded) % 8 == 0 and n_pad == len(padded) - n < 8
    for key in condensed_batch.keys():
        assert torch.equal(padded[key][:n], condensed_batch[key]), key
    for key in ("response_mask", "token_level_rewards", "advantages", "returns"):
        assert padded[key][n:].abs().sum() == 0, key
    assert torch.equal(padded["input_ids"][n:], condensed_batch["input_ids"][:n_pad])  # well-defined forwards
    same, none = pad_for_update(condensed_batch, n)
    assert same is condensed_batch and none == 0


@pytest.mark.parametrize("loss_agg_mode", core_algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("policy_loss_mode", core_algos.POLICY_LOSS_MODES)
def test_padding_rows_change_no_loss(condensed_batch, loss_agg_mode, policy_loss_mode):
    padded, _ = pad_for_update(condensed_batch, 8)
    loss_fn = core_algos.get_policy_loss_fn(policy_loss_mode)

    def losses(batch):
        torch.manual_seed(0)
        log_prob = batch["old_log_probs"] + 0.05 * torch.randn(batch["old_log_probs"].shape[1])  # same per column
        mask = batch["response_mask"].float()
        pg = loss_fn(old_log_prob=batch["old_log_probs"], log_prob=log_prob, advantages=batch["advantages"],
                     response_mask=mask, cliprange_low=0.2, cliprange_high=0.28, loss_agg_mode=loss_agg_mode)
        # T is the same with and without padding, so seq-mean-token-sum-norm's constant matches too
        return [float(x) for x in pg] + [float(core_algos.agg_loss(log_prob, mask, loss_agg_mode))]

    assert losses(padded) == pytest.approx(losses(condensed_batch))
    only_padding = padded.index(torch.arange(len(condensed_batch), len(padded)))
    assert all(v == 0.0 for v in losses(only_padding))  # a micro-batch of padding: zero loss, no NaN


@pytest.mark.parametrize("world_size, mini, micro", [(1, 4, 2), (2, 8, 2), (2, 4, 1), (4, 8, 2)])
def test_every_rank_runs_the_same_full_mini_and_micro_batches(condensed_batch, world_size, mini, micro):
    """The actor/critic update loop: dp_execute's rank split, then mini-batches of mini // world_size rows."""
    n_real = len(condensed_batch)
    padded, _ = pad_for_update(condensed_batch, mini)
    shards, split_pad = split_for_ranks(padded, world_size)
    assert split_pad == 0  # dp_execute never repeats real rows of an update batch
    per_rank = [[[len(m) for m in mb.split(micro)] for mb in shard.split(mini // world_size)] for shard in shards]
    assert all(p == per_rank[0] for p in per_rank)
    assert all(size == micro for minis in per_rank for micros in minis for size in micros)
    # every optimizer step (the j-th mini-batch of every rank) holds a real row on rank 0
    assert len(padded) - n_real < mini
    for rank0_mini in shards[0].split(mini // world_size):
        assert rank0_mini["response_mask"].sum() > 0
