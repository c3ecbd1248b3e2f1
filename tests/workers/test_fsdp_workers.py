"""FSDP worker pieces that need no process group: loss weighting, log-prob alignment, a 1-rank update."""

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.batch import TensorBatch
from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig
from workers.actor import ActorWorker
from workers.fsdp_base import micro_weight, token_log_probs


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_weighted_micro_losses_equal_the_mini_batch_loss(mode):
    """Sum of micro_weight * agg_loss(micro) == agg_loss(mini), with padding rows anywhere."""
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(8, 12, generator=gen)
    mask = (torch.rand(8, 12, generator=gen) > 0.4).long()
    mask[[2, 5, 6, 7]] = 0  # padding rows, including a whole micro-batch of them
    whole = core_algos.agg_loss(loss, mask, mode)
    parts = sum(
        micro_weight(mask[i : i + 2], mask, mode) * core_algos.agg_loss(loss[i : i + 2], mask[i : i + 2], mode)
        for i in range(0, 8, 2)
    )
    assert torch.allclose(parts, whole, atol=1e-6)
    assert micro_weight(mask[6:8], mask, mode) == 0.0


def test_token_log_probs_are_aligned_with_input_ids():
    logits = torch.randn(1, 4, 5)
    ids = torch.tensor([[1, 3, 0, 4]])
    lp = token_log_probs(logits, ids)
    assert lp[0, 0] == 0
    for t in range(1, 4):
        assert torch.isclose(lp[0, t], torch.log_softmax(logits[0, t - 1], -1)[ids[0, t]])


def test_padding_rows_do_not_change_the_actor_update(tiny_model_path):
    """A 1-rank actor (no process group) takes the same step with and without zero-mask padding rows."""
    cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-3),
                      fsdp=FSDPConfig(world_size=1), grad_clip=1e9)
    gen = torch.Generator().manual_seed(0)
    B, T = 2, 16
    ids = torch.randint(3, 200, (B, T), generator=gen)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 8:] = 1
    real = TensorBatch({"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long),
                        "position_ids": torch.arange(T).expand(B, T).clone(), "response_mask": mask,
                        "advantages": torch.randn(B, T, generator=gen) * mask})
    padding = real.index([0, 1])
    padding["response_mask"] = torch.zeros_like(mask)
    padding["advantages"] = torch.zeros(B, T)
    params, grad_norms = {}, {}
    for name, batch in (("real", real), ("padded", TensorBatch.concat([real, padding]))):
        torch.manual_seed(0)
        worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=cfg, device="cpu")
        worker.init_model()
        batch = batch.update(worker.compute_log_prob(batch))
        # one mini-batch of 4 rows: for "real" only its 2 rows (a 2-row mini-batch)
        worker.config.ppo_mini_batch_size = len(batch)
        grad_norms[name] = worker.update_actor(batch)["actor/grad_norm"]
        params[name] = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    # Adam's first step hides a scaled gradient; the pre-clip norm does not (dilution would halve it)
    assert grad_norms["padded"] == pytest.approx(grad_norms["real"], rel=1e-4)
    for key in params["real"]:
        assert torch.allclose(params["real"][key], params["padded"][key], atol=1e-6), key


def _actor_batch(seed: int, B: int = 4, T: int = 16) -> TensorBatch:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 8:] = 1
    return TensorBatch({"input_ids": torch.randint(3, 200, (B, T), generator=gen),
                        "attention_mask": torch.ones(B, T, dtype=torch.long),
                        "position_ids": torch.arange(T).expand(B, T).clone(), "response_mask": mask,
                        "advantages": torch.randn(B, T, generator=gen) * mask})


def _train_once(worker: ActorWorker, seed: int) -> None:
    batch = _actor_batch(seed)
    worker.update_actor(batch.update(worker.compute_log_prob(batch)))


def test_checkpoint_round_trip_continues_bit_exactly(tiny_model_path, tmp_path):
    """Save after one update, load into a fresh worker: the next update gives identical weights and Adam moments."""
    cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                      optim=OptimConfig(lr=1e-3, warmup_steps=3), fsdp=FSDPConfig(world_size=1))

    def fresh() -> ActorWorker:
        worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=cfg, device="cpu")
        worker.init_model()
        return worker

    original = fresh()
    _train_once(original, seed=1)
    original.save_checkpoint(str(tmp_path / "actor"))
    assert (tmp_path / "actor" / "model.safetensors").exists() and (tmp_path / "actor" / "rng" / "rank_0.json").exists()
    resumed = fresh()
    resumed.load_checkpoint(str(tmp_path / "actor"))
    assert resumed.lr_scheduler.last_epoch == original.lr_scheduler.last_epoch == 1
    for worker in (original, resumed):
        _train_once(worker, seed=2)
    for key, value in original.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    orig_state, res_state = original.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for pid, entries in orig_state.items():
        for name, value in entries.items():
            assert torch.equal(value, res_state[pid][name]), (pid, name)
    # the folder is an ordinary HF model
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "actor"))
