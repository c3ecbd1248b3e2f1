"""The actor's SFT methods on one rank (no process group): the loss is the reply-token NLL, padding is inert."""

import torch
from transformers import AutoModelForCausalLM

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig
from agent_trainer.workers.actor import ActorWorker


def _worker(path: str, micro: int = 2) -> ActorWorker:
    torch.manual_seed(0)
    cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=micro, optim=OptimConfig(lr=1e-3),
                      fsdp=FSDPConfig(world_size=1), grad_clip=1e9)
    worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=path), actor=cfg, device="cpu")
    worker.init_model()
    return worker


def _batch(rows: int = 3, length: int = 20) -> TensorBatch:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (rows, length), generator=gen)
    attention = torch.ones(rows, length, dtype=torch.long)
    attention[0, 15:] = 0  # a right-padded row
    mask = torch.zeros(rows, length, dtype=torch.long)
    mask[:, 6:10] = 1
    mask[1:, 12:18] = 1
    return TensorBatch({"input_ids": ids, "attention_mask": attention,
                        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "response_mask": mask * attention})


def test_sft_loss_is_the_nll_of_the_masked_tokens(tiny_model_path):
    batch = _batch()
    stats = _worker(tiny_model_path).compute_sft_loss(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    nll, tokens, correct = 0.0, 0, 0
    for b in range(len(batch)):
        n = int(batch["attention_mask"][b].sum())
        ids = batch["input_ids"][b, :n]
        with torch.no_grad():
            logits = model(ids.unsqueeze(0)).logits[0]
        for t in range(1, n):
            if batch["response_mask"][b, t]:
                nll -= float(torch.log_softmax(logits[t - 1], -1)[ids[t]])
                tokens += 1
                correct += int(logits[t - 1].argmax() == ids[t])
    assert stats["sft/tokens"] == tokens
    assert abs(stats["sft/nll_sum"] - nll) < 1e-3 * tokens
    assert stats["sft/correct"] == correct


def test_sft_steps_lower_the_loss_and_padding_rows_change_nothing(tiny_model_path):
    batch = _batch()
    padding = batch.index([0, 1])
    padding["response_mask"] = torch.zeros_like(padding["response_mask"])
    after = {}
    for name, b in (("real", batch), ("padded", TensorBatch.concat([batch, padding]))):
        worker = _worker(tiny_model_path)
        before = worker.compute_sft_loss(batch)
        first = worker.update_sft(b)
        assert first["sft/tokens"] == before["sft/tokens"] and abs(first["sft/nll_sum"] - before["sft/nll_sum"]) < 1e-3
        for _ in range(4):
            worker.update_sft(b)
        after[name] = worker.compute_sft_loss(batch)
        assert after[name]["sft/nll_sum"] < 0.8 * before["sft/nll_sum"]
    assert abs(after["real"]["sft/nll_sum"] - after["padded"]["sft/nll_sum"]) < 1e-3
