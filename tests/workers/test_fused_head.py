"""The output head's scores in chunks (agent_trainer/workers/fused_head.py) and the update's micro-batch loop.

- The chunked log-prob, entropy and argmax hits equal the plain full-vocabulary computation within 1e-5 in float32,
  gradients included (hidden states, head weight, bias), at a temperature and at 1, one chunk or many.
- Through the tiny model, with padding rows, ragged rows and a response mask: the scores the workers train on
  (``target_scores``) equal ``target_logits``' plain ones, and so do the parameters' gradients; the backward keeps
  no [tokens x vocabulary] tensor.
- An update of several micro-batches reads nothing from the device inside its micro-batch loops (torch.profiler:
  no ``aten::item``, ``aten::_local_scalar_dense`` or ``aten::nonzero`` there).
"""

from __future__ import annotations

import pytest
import torch

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig
from agent_trainer.workers.actor import ActorWorker
from agent_trainer.workers.fsdp_base import MICRO_BATCH_LOOP, ModelInputs, target_logits, target_scores
from agent_trainer.workers.fused_head import head_scores

TOL = 1e-5


def _plain(hidden, head, targets, temperature):
    logits = head(hidden).float()
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    p1 = torch.log_softmax(logits, -1)
    return logp, -(p1.exp() * p1).sum(-1), (logits.argmax(-1) == targets).float()


def _grads(outputs, coeffs, params):
    loss = sum((o * c).sum() for o, c in zip(outputs, coeffs))
    return torch.autograd.grad(loss, params, retain_graph=True)


@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.7, 3), (1.3, 1)])
def test_chunked_scores_and_gradients_equal_the_full_vocabulary_ones(temperature, chunk):
    gen = torch.Generator().manual_seed(0)
    n, h, v = 10, 16, 50
    head = torch.nn.Linear(h, v, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=gen))
        head.bias.copy_(torch.randn(v, generator=gen))
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    coeffs = (torch.randn(n, generator=gen), torch.randn(n, generator=gen))
    params = (hidden, head.weight, head.bias)
    want = _plain(hidden, head, targets, temperature)
    got = head_scores(hidden, head, targets, temperature, entropy=True, hits=True, chunk=chunk)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL)
    for w, g in zip(_grads(want[:2], coeffs, params), _grads(got[:2], coeffs, params)):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL)
    # the log-prob alone (no entropy asked): the same gradient as the plain log-prob's
    only = head_scores(hidden, head, targets, temperature, chunk=chunk)[0]
    for w, g in zip(_grads(want[:1], coeffs, params), _grads((only,), coeffs, params)):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL)


def _ragged_rows(vocab: int) -> tuple[ModelInputs, torch.Tensor]:
    """Four rows: ragged right padding, one padding row, a response mask over two replies of a row."""
    gen = torch.Generator().manual_seed(1)
    B, T = 4, 20
    lengths = [20, 13, 16, 0]
    ids = torch.randint(3, vocab, (B, T), generator=gen)
    attention = torch.zeros(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
        if n:
            response[row, 8:11] = 1
            response[row, 13:n] = 1
    ids = ids * attention
    return ModelInputs(ids, attention, torch.arange(T).expand(B, T).clone()), response


def test_the_models_scores_and_gradients_equal_the_plain_heads(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    inputs, response = _ragged_rows(model.config.vocab_size)
    coeffs = torch.randn(response.shape), torch.randn(response.shape)
    params = [p for p in model.parameters() if p.requires_grad]

    plain = target_logits(model, inputs, response)
    want = (plain.log_probs(0.8), plain.entropy())
    saved: list[tuple] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        fused = target_scores(model, inputs, response, temperature=0.8, entropy=True, hits=True)
    got = (fused.log_probs, fused.entropy)
    for w, g in zip(want, got):
        assert g.shape == response.shape and not g[response == 0].any()
        torch.testing.assert_close(g, w, rtol=0, atol=TOL)
    assert torch.equal(fused.greedy_hits, plain.greedy_hits())
    for name, w, g in zip([n for n, p in model.named_parameters() if p.requires_grad],
                          _grads(want, coeffs, params), _grads(got, coeffs, params)):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL, msg=name)
    # no [tokens x vocabulary] tensor kept for the backward (the head's weight, [vocabulary x hidden], is)
    assert saved and not [shape for shape in saved if shape and shape[-1] == model.config.vocab_size]


def _batch(B: int = 6, T: int = 18, seed: int = 0) -> TensorBatch:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 9:] = 1
    mask[1, 14:] = 0
    return TensorBatch({"input_ids": torch.randint(3, 200, (B, T), generator=gen),
                        "attention_mask": torch.ones(B, T, dtype=torch.long),
                        "position_ids": torch.arange(T).expand(B, T).clone(), "response_mask": mask,
                        "advantages": torch.randn(B, T, generator=gen) * mask,
                        "old_log_probs": -torch.rand(B, T, generator=gen) * mask})


def test_the_micro_batch_loop_reads_nothing_from_the_device(tiny_model_path):
    """Two mini-batches of three micro-batches, entropy and KL terms on: inside each micro-batch loop (forwards
    and backwards) no op that copies a value to the host, nor a boolean mask's nonzero."""
    from torch.profiler import ProfilerActivity, profile

    cfg = ActorConfig(ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=1, optim=OptimConfig(lr=1e-3),
                      fsdp=FSDPConfig(world_size=1), entropy_coeff=0.01, use_kl_loss=True)
    worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=cfg, device="cpu")
    worker.init_model()
    batch = _batch()
    batch.tensors["ref_log_prob"] = batch["old_log_probs"] * 1.1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        metrics = worker.update_actor(batch)
    events = prof.events()
    loops = [(e.time_range.start, e.time_range.end) for e in events if e.name == MICRO_BATCH_LOOP]
    assert len(loops) == 2  # one per mini-batch
    syncing = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"}
    inside = [e.name for e in events if e.name in syncing
              and any(start <= e.time_range.start <= end for start, end in loops)]
    assert inside == []
    outside = [e.name for e in events if e.name in syncing]
    assert outside  # the profiler sees these ops: the planning before each loop runs them
    assert {"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"} <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
