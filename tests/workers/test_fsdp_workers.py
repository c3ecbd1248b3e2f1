"""FSDP worker pieces that need no process group: loss weighting, log-prob alignment, a 1-rank update."""

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig, RefConfig
from agent_trainer.workers.actor import ActorWorker, ReferenceWorker
from agent_trainer.workers.fsdp_base import ModelInputs, micro_weight


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


def _full_logit_reference(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: float):
    """Loop reference over every position's logits: log-prob, entropy, greedy hit of each masked token t from t-1."""
    lp, ent, hit = (torch.zeros(ids.shape) for _ in range(3))
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if mask[b, t]:
                logp = torch.log_softmax(logits[b, t - 1] / temperature, -1)
                lp[b, t] = logp[ids[b, t]]
                full = torch.log_softmax(logits[b, t - 1], -1)
                ent[b, t] = -(full.exp() * full).sum()
                hit[b, t] = float(logits[b, t - 1].argmax() == ids[b, t])
    return lp, ent, hit


def test_target_logits_equal_the_full_forward_on_the_masked_tokens(tiny_model_path):
    """Projecting only the positions that predict response tokens changes no value and no gradient."""
    from transformers import AutoModelForCausalLM

    from agent_trainer.workers.fsdp_base import ModelInputs, target_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (3, 12), generator=gen)
    attention = torch.ones(3, 12, dtype=torch.long)
    attention[2, 9:] = 0  # right padding
    mask = torch.zeros(3, 12, dtype=torch.long)
    mask[0, 4:7], mask[1, 2:4], mask[1, 8:12], mask[2, 5:9] = 1, 1, 1, 1  # multi-turn: two replies in row 1
    mask[0, 0] = 1  # column 0 has no predicting position: never a target
    inputs = ModelInputs(ids, attention, (attention.cumsum(-1) - 1).clamp(min=0))
    full = model(**vars(inputs)).logits
    lp, ent, hit = _full_logit_reference(full.detach(), ids, mask * (torch.arange(12) > 0), temperature=0.7)
    picked = target_logits(model, inputs, mask)
    assert picked.logits.shape == (int(mask[:, 1:].sum()), model.config.vocab_size)
    assert torch.allclose(picked.log_probs(0.7), lp, atol=1e-5)
    assert torch.allclose(picked.entropy(), ent, atol=1e-5)
    assert torch.equal(picked.greedy_hits(), hit)
    # the gradient of a masked loss is the full forward's
    model.zero_grad()
    (picked.log_probs(0.7) * torch.arange(36.0).view(3, 12)).sum().backward()
    picked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = torch.log_softmax(model(**vars(inputs)).logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (full * (mask[:, 1:] * torch.arange(36.0).view(3, 12)[:, 1:])).sum().backward()
    for mine, theirs in zip(picked_grads, (p.grad for p in model.parameters())):
        assert torch.allclose(mine, theirs, atol=1e-5)


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



def test_the_cosine_schedule_follows_the_runs_progress_after_the_warm_up(tiny_model_path, tmp_path):
    """lr_scheduler_type=cosine: each update's learning rate is lr * (floor + (1 - floor) * (1 + cos(pi * p)) / 2)
    at the batch's progress p, times the warm-up; constant ignores p; a resumed worker gets the same rate."""
    import math

    def worker(**optim) -> ActorWorker:
        cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                          optim=OptimConfig(lr=1e-3, **optim), fsdp=FSDPConfig(world_size=1))
        actor = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=cfg, device="cpu")
        actor.init_model()
        return actor

    def update(actor: ActorWorker, progress: float) -> float:
        batch = _actor_batch(seed=3)
        batch = batch.update(actor.compute_log_prob(batch))
        batch.meta.progress = progress
        return actor.update_actor(batch)["actor/lr"]

    cosine, constant = worker(lr_scheduler_type="cosine", min_lr_ratio=0.1, warmup_steps=2), worker()
    expected = []
    for step, progress in enumerate((0.0, 0.25, 0.5, 0.9)):
        decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        expected.append(1e-3 * min(1.0, (step + 1) / 2) * decay)
        assert update(cosine, progress) == pytest.approx(expected[-1], rel=1e-6)
        assert update(constant, progress) == pytest.approx(1e-3)
        # the rate the step just taken used is the one reported
        assert cosine.optimizer.param_groups[0]["lr"] == pytest.approx(
            1e-3 * min(1.0, (step + 2) / 2) * decay, rel=1e-6)
    assert expected[1] > expected[2] > expected[3] > 1e-4
    cosine.save_checkpoint(str(tmp_path / "actor"))
    resumed = worker(lr_scheduler_type="cosine", min_lr_ratio=0.1, warmup_steps=2)
    resumed.load_checkpoint(str(tmp_path / "actor"))
    assert update(resumed, 0.95) == pytest.approx(update(cosine, 0.95), rel=1e-9)


# -- trainer-side optimisations: on-policy skip of old log-probs, dynamic batch size ---------------------------

def _ragged_batch(lengths: list[int], T: int = 16, seed: int = 0) -> TensorBatch:
    """Right-padded rows of the given lengths: prompt 4 tokens (mask 0), the rest generated (mask 1)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    attention = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention[b, :n] = 1
    response = attention.clone()
    response[:, :4] = 0
    return TensorBatch({"input_ids": torch.randint(3, 200, (B, T), generator=gen) * attention,
                        "attention_mask": attention, "position_ids": torch.arange(T).expand(B, T).clone(),
                        "response_mask": response, "advantages": torch.randn(B, T, generator=gen) * response,
                        "rollout_log_probs": -torch.rand(B, T, generator=gen) * response})


def _actor(path: str, **overrides) -> ActorWorker:
    cfg = ActorConfig(**{"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 2, "optim": OptimConfig(lr=1e-3),
                         "fsdp": FSDPConfig(world_size=1), "grad_clip": 1e9, **overrides})
    torch.manual_seed(0)
    worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=path), actor=cfg, device="cpu")
    worker.init_model()
    return worker


def test_on_policy_update_without_old_log_probs_is_the_recomputed_update(tiny_model_path):
    """Skipping the old-log-prob forward (one epoch, one mini-batch) gives the very same first update: ratio 1."""
    lengths = [16, 9, 12, 5, 16, 7]
    results = {}
    for name in ("recomputed", "skipped"):
        worker = _actor(tiny_model_path)
        batch = _ragged_batch(lengths)
        if name == "recomputed":
            batch.update(worker.compute_log_prob(batch))
        results[name] = (worker.update_actor(batch), {k: v.detach().clone() for k, v in worker.model.state_dict().items()})
    (rec_metrics, rec_params), (skip_metrics, skip_params) = results["recomputed"], results["skipped"]
    assert skip_metrics["actor/ppo_kl"] == 0.0 and skip_metrics["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
    assert rec_metrics["actor/ppo_kl"] == 0.0  # the recomputed old log-probs equal the training forward's bit for bit
    assert skip_metrics["actor/pg_loss"] == rec_metrics["actor/pg_loss"]
    assert skip_metrics["actor/grad_norm"] == rec_metrics["actor/grad_norm"]
    for key, value in rec_params.items():
        assert torch.equal(value, skip_params[key]), key
    assert "actor/rollout_vs_actor_logprob_diff" in skip_metrics  # reported by the actor when the driver cannot
    assert skip_metrics["rollout/mismatch_kl"] >= 0.0 and "rollout/mismatch_kl" not in rec_metrics  # so is the KL


def test_a_colocated_reference_is_the_separate_reference_and_never_moves(tiny_model_path):
    """actor_rollout_ref.ref.colocate: the actor rank's frozen copy gives the separate ReferenceWorker's log-probs,
    before and after the policy's update, while the policy's own log-probs move."""
    batch = _ragged_batch([16, 9, 12, 5, 16, 7])
    ref = RefConfig(log_prob_micro_batch_size_per_gpu=4)
    separate = ReferenceWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), ref=ref, device="cpu")
    separate.init_model()
    expected = separate.compute_ref_log_prob(batch)["ref_log_prob"]
    cfg = ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2),
                      fsdp=FSDPConfig(world_size=1))
    actor = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=cfg, device="cpu", ref=ref)
    actor.init_model()
    assert not any(p.requires_grad for p in actor.ref_model.parameters())
    assert torch.equal(actor.compute_ref_log_prob(batch)["ref_log_prob"], expected)
    before = actor.compute_log_prob(batch)["old_log_probs"]
    actor.update_actor(batch.update({"old_log_probs": before}))
    assert not torch.allclose(actor.compute_log_prob(batch)["old_log_probs"], before)  # the policy moved ...
    assert torch.equal(actor.compute_ref_log_prob(batch)["ref_log_prob"], expected)  # ... the reference did not
    with pytest.raises(RuntimeError, match="no reference"):
        _actor(tiny_model_path).compute_ref_log_prob(batch)


def test_a_colocated_distillation_teacher_is_the_separate_teacher_group(tiny_model_path, tmp_path):
    """algorithm.distill: the teacher hosted by an actor rank (colocate) gives the log-probs of a teacher group of its
    own (a ReferenceWorker on the teacher's path), and they are the teacher's, not the student's."""
    from transformers import AutoModelForCausalLM

    teacher_path = tmp_path / "teacher"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(teacher_path)
    batch = _ragged_batch([16, 9, 12, 5, 16, 7])
    forward = RefConfig(log_prob_micro_batch_size_per_gpu=4, colocate=False)
    teacher_model = ModelConfig(path=str(teacher_path))
    separate = ReferenceWorker(rank=0, world_size=1, model=teacher_model, ref=forward, device="cpu")
    separate.init_model()
    expected = separate.compute_teacher_log_prob(batch)["teacher_log_prob"]
    cfg = ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2),
                      fsdp=FSDPConfig(world_size=1))
    actor = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=cfg, device="cpu",
                        teacher=(teacher_model, forward))
    actor.init_model()
    assert not any(p.requires_grad for p in actor.teacher_model.parameters())
    assert torch.equal(actor.compute_teacher_log_prob(batch)["teacher_log_prob"], expected)
    mask = batch["response_mask"].bool()
    student = actor.compute_log_prob(batch)["old_log_probs"]
    assert (student - expected)[mask].abs().mean() > 1e-3 and expected[~mask].abs().sum() == 0
    with pytest.raises(RuntimeError, match="no distillation teacher"):
        _actor(tiny_model_path).compute_teacher_log_prob(batch)


def test_update_without_old_log_probs_refuses_a_second_epoch(tiny_model_path):
    worker = _actor(tiny_model_path, ppo_epochs=2)  # the second pass over the first mini-batch is off-policy
    with pytest.raises(RuntimeError, match="needs one PPO epoch"):
        worker.update_actor(_ragged_batch([16, 9, 12, 5, 16, 7]))


def test_later_mini_batches_without_old_log_probs_are_scored_before_the_first_step(tiny_model_path):
    """Three mini-batches, one epoch, no old log-probs from the trainer: the first mini-batch is on-policy and
    the actor scores the other rows before its first optimizer step, so the update is the recomputed one."""
    lengths = [16, 9, 12, 5, 16, 7]
    results = {}
    for name in ("recomputed", "in the update"):
        worker = _actor(tiny_model_path, ppo_mini_batch_size=2)
        batch = _ragged_batch(lengths)
        if name == "recomputed":
            batch.update(worker.compute_log_prob(batch))
        keys = set(batch.keys())
        metrics = worker.update_actor(batch)
        results[name] = (metrics, {k: v.detach().clone() for k, v in worker.model.state_dict().items()})
        assert set(batch.keys()) == keys  # the caller's batch is left as it was
    (rec_metrics, rec_params), (own_metrics, own_params) = results["recomputed"], results["in the update"]
    assert own_metrics["actor/ppo_kl"] != 0.0  # later mini-batches move off the old policy
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm"):
        assert own_metrics[key] == pytest.approx(rec_metrics[key], rel=1e-4, abs=1e-6), key  # float noise: 1e-7
    for key, value in rec_params.items():
        # Adam turns float noise in tiny gradients into up to ~1% of one step (measured 1.2e-5 at lr 1e-3)
        assert (value - own_params[key]).abs().max() < 5e-5, (key, (value - own_params[key]).abs().max())
    assert own_metrics["actor/rollout_vs_actor_logprob_diff"] > 0  # the actor reports it over all rows


def test_target_kl_stops_the_update_at_the_first_mini_batch_past_it(tiny_model_path):
    """actor.target_kl: three mini-batches; the first is on-policy (approx_kl about 0), the second has moved. A limit
    below the second's KL leaves exactly the first mini-batch's optimizer step; a limit above every mini-batch's
    KL is the update without the key."""
    batch = _ragged_batch([16, 9, 12, 5, 16, 7])

    def update(rows: TensorBatch, **overrides) -> tuple[dict, dict]:
        worker = _actor(tiny_model_path, ppo_mini_batch_size=2, **overrides)
        rows = rows.select(rows.keys())
        metrics = worker.update_actor(rows.update(worker.compute_log_prob(rows)))
        return metrics, {k: v.detach().clone() for k, v in worker.model.state_dict().items()}

    plain, plain_params = update(batch)
    assert "actor/kl_stopped" not in plain
    loose, loose_params = update(batch, target_kl=1e9)
    assert (loose["actor/kl_stopped"], loose["actor/optimizer_steps"]) == (0.0, 3.0)
    assert loose["actor/grad_norm"] == plain["actor/grad_norm"]
    assert all(torch.equal(loose_params[k], v) for k, v in plain_params.items())

    tight, tight_params = update(batch, target_kl=1e-8)
    assert (tight["actor/kl_stopped"], tight["actor/optimizer_steps"]) == (1.0, 1.0)
    assert 0.0 <= loose["actor/approx_kl"] and tight["actor/approx_kl"] > 1e-8 / 2  # the second's is past it
    first, first_params = update(batch.index(torch.arange(2)))  # the first mini-batch alone
    assert tight["actor/grad_norm"] == pytest.approx(first["actor/grad_norm"], rel=1e-5)  # float noise: 2e-7

    def farthest(params: dict) -> float:
        return max(float((tight_params[k] - v).abs().max()) for k, v in params.items())

    # Adam turns float noise in tiny gradients into up to ~1% of one step (lr 1e-3); two more steps move far more
    assert farthest(first_params) < 5e-5 < 1e-4 < farthest(plain_params), (farthest(first_params),
                                                                          farthest(plain_params))


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_dynamic_batch_size_gives_the_fixed_micro_batch_update(tiny_model_path, mode):
    """Micro-batches by token budget (rows packed by length, padding columns cut) accumulate the same gradient."""
    lengths = [16, 9, 12, 5, 16, 7]
    out = {}
    for name, dynamic in (("fixed", {}), ("dynamic", {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 36})):
        worker = _actor(tiny_model_path, loss_agg_mode=mode, **dynamic)
        batch = _ragged_batch(lengths)
        batch.update(worker.compute_log_prob(batch))
        plan = worker.plan_micro_batches(batch, worker.batching)
        grads = _record_grads(worker)
        out[name] = (plan, worker.update_actor(batch)["actor/grad_norm"], grads)
    fixed_plan, dynamic_plan = out["fixed"][0], out["dynamic"][0]
    assert [r.tolist() for r, _ in fixed_plan] == [[0, 4], [1, 2], [3, 5]]  # 2 rows each, longest first
    assert [m["input_ids"].shape[1] for _, m in fixed_plan] == [16, 12, 7]
    # 36 tokens: the two 16-token rows (2 x 16), then 12 + 9 + 7 (3 x 12), then the 5 alone (cut to 5 columns)
    assert [r.tolist() for r, _ in dynamic_plan] == [[0, 4], [1, 2, 5], [3]]
    assert [m["input_ids"].shape[1] for _, m in dynamic_plan] == [16, 12, 5]
    assert out["dynamic"][1] == pytest.approx(out["fixed"][1], rel=1e-5)
    # float32 sums over other shapes, in another order: measured 1-3e-7 of the whole gradient's norm; a tensor
    # whose gradient mostly cancels keeps fewer digits of its own (up to 6e-5 of its norm, layer 1's q_proj on
    # this machine). A mis-weighted micro-batch moves the gradient by its share of it, orders of magnitude more.
    fixed, dynamic = out["fixed"][2], out["dynamic"][2]
    flat = {name: torch.cat([g[k].flatten() for k in fixed]) for name, g in (("fixed", fixed), ("dynamic", dynamic))}
    assert (flat["dynamic"] - flat["fixed"]).norm() <= 1e-5 * flat["fixed"].norm()
    for key, value in fixed.items():
        assert (dynamic[key] - value).norm() <= 1e-3 * value.norm(), key


def _record_grads(worker) -> dict[str, torch.Tensor]:
    """Filled with each parameter's accumulated gradient just before the worker's optimizer step."""
    grads, step = {}, worker.optimizer_step

    def recording_step(grad_clip: float) -> float:
        grads.update({k: p.grad.detach().clone() for k, p in worker.model.named_parameters() if p.grad is not None})
        return step(grad_clip)

    worker.optimizer_step = recording_step
    return grads


def test_log_probs_are_the_same_under_every_micro_batching(tiny_model_path):
    lengths = [16, 9, 12, 5, 16, 7]
    batch = _ragged_batch(lengths)
    one_row = _actor(tiny_model_path, ppo_micro_batch_size_per_gpu=1).compute_log_prob(batch)["old_log_probs"]
    dynamic = _actor(tiny_model_path, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20).compute_log_prob(batch)
    attended = batch["attention_mask"].bool()  # padding positions hold whatever their micro-batch computed there
    assert torch.allclose(one_row[attended], dynamic["old_log_probs"][attended], atol=1e-5)
    assert (one_row * ~attended).abs().sum() == 0  # one row per micro-batch: every padding column was cut, comes back 0


def test_token_budget_groups_and_split_to_count():
    from agent_trainer.workers.fsdp_base import split_to_count, token_budget_groups

    lengths = [10, 3, 8, 3, 20]
    groups = token_budget_groups(lengths, 20)
    assert groups == [[4], [0, 2], [1, 3]]  # 20 alone; 10 + 8 -> 2 x 10 = 20; 3 + 3
    assert all(len(g) * max(lengths[i] for i in g) <= 20 for g in groups)
    assert token_budget_groups([30, 2], 20) == [[0], [1]]  # a row over the budget gets its own micro-batch
    split = split_to_count(groups, lengths, 4)
    assert len(split) == 4 and sorted(i for g in split for i in g) == [0, 1, 2, 3, 4] and all(split)
    with pytest.raises(ValueError, match="non-empty"):
        split_to_count([[0], [1]], [1, 1], 3)


def _two_rank_update(rank: int, init_file: str, path: str, results) -> None:
    """One rank of a 2-rank FSDP2 (gloo) actor with a token budget: log-probs and one on-policy update."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        worker = ActorWorker(rank=rank, world_size=2, model=ModelConfig(path=path), device="cpu",
                             actor=ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                                               optim=OptimConfig(lr=1e-3), fsdp=FSDPConfig(world_size=2),
                                               use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20))
        worker.init_model()
        batch = _two_rank_rows(rank)
        counts = len(worker.plan_micro_batches(batch, worker.batching))
        log_probs = worker.compute_log_prob(batch)["old_log_probs"]
        disagreeing = _disagreeing_ranks(worker)  # before the update: the same weights as the single rank below
        metrics = worker.update_actor(batch)
        gathered = worker.full_state_dict()  # unit by unit (gather_full_weights)
        expected = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        same = (list(gathered) == list(expected) and all(type(v) is torch.Tensor for v in gathered.values())
                and all(torch.equal(gathered[k], expected[k]) for k in expected))
        results[rank] = (counts, log_probs, float(metrics["actor/grad_norm"]), same if rank == 0 else gathered == {},
                         _shared_prefix_gradients_match(worker), disagreeing,
                         worker._ranks_mean([0.1 + 0.2 * rank, 0.1 + 0.2 * rank]))  # actor.target_kl's mean
    finally:
        dist.destroy_process_group()


def _shared_prefix_gradients_match(worker: ActorWorker) -> bool:
    """Under FSDP2 the checkpointed prefix call gathers each unit for one forward and backward at a time:
    this rank's gradient shards equal the full forward's (the rows after the prefix run packed)."""
    import agent_trainer.workers.fsdp_base as fsdp_base

    batch, grads, default = _prefix_rows(seed=worker.rank), [], fsdp_base.SHARED_PREFIX_MIN_TOKENS
    for minimum, shared in ((default, 24), (10**9, 0)):
        fsdp_base.SHARED_PREFIX_MIN_TOKENS = minimum
        worker.model.zero_grad()
        inputs = worker.model_inputs(batch)
        assert inputs.shared_prefix == shared and (inputs.suffix_lengths is not None) == bool(shared)  # packed
        worker._scores(worker.model, worker.prepare(batch)).log_probs.sum().backward()
        grads.append({k: p.grad.to_local().clone() for k, p in worker.model.named_parameters()})
    fsdp_base.SHARED_PREFIX_MIN_TOKENS = default
    return all(torch.allclose(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-6) for k in grads[1])


def _long_episodes(rank: int) -> TensorBatch:
    """Rank 0: four long rows sharing a 150-token prompt, whose cheapest layout caches it (two model calls);
    rank 1: four rows sharing nothing (one call)."""
    batch = _ragged_batch([580, 570, 560, 550], T=580, seed=rank)
    batch["response_mask"][:, :200] = 0
    if rank == 0:
        batch["input_ids"][:, :150] = batch["input_ids"][0, :150]
    return batch


def _disagreeing_ranks(worker: ActorWorker) -> tuple[list[bool], torch.Tensor]:
    """FSDP gathers each unit once per model call: where one rank's micro-batch would cache its prefix (two calls)
    and the other's runs in one call, both run one (``meta.two_calls``); without it this would hang."""
    from agent_trainer.workers.fsdp_base import MicroBatching

    batch, batching = _long_episodes(worker.rank), MicroBatching(rows=4)
    alone = worker.layout(batch, two_calls=True).model_calls
    agreed = [micro.meta.two_calls for _, micro in worker.plan_micro_batches(batch, batching)]
    return [alone == 2, *agreed], worker._log_probs(batch, worker.model, batching)


def _two_rank_rows(rank: int) -> TensorBatch:
    # rank 0: four long rows, one micro-batch each under 20 tokens; rank 1: short rows, two micro-batches (7+6, 6+5)
    return _ragged_batch([16, 16, 15, 14] if rank == 0 else [6, 5, 7, 6], seed=rank)


def test_two_ranks_agree_on_the_number_of_dynamic_micro_batches(tiny_model_path, tmp_path):
    """Ranks whose rows pack into different numbers of micro-batches still run as many forwards (an
    all-reduce agrees on the count; a mismatch would hang FSDP's all-gathers), with the right log-probs.
    After the update, the weights gathered for the engines equal torch's full state dict, a shared
    prefix's forward gives the full forward's gradients, and ranks agree on each micro-batch's model calls."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_two_rank_update, args=(r, str(tmp_path / "pg"), tiny_model_path, results))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert results[0][0] == results[1][0] == 4  # rank 1 split its two micro-batches to match rank 0's four
    assert results[0][2] == results[1][2] > 0  # one global gradient norm
    assert results[0][3] and results[1][3]  # the weight sync's gather: DCP's full state dict on rank 0, {} on rank 1
    assert results[0][4] and results[1][4]  # a shared prefix's forward gives the full forward's gradients
    assert results[0][5][0] == [True, False] and results[1][5][0] == [False, False]  # one call each, agreed
    assert results[0][6] == results[1][6] == pytest.approx(0.2)  # a mini-batch's KL, the same on both ranks
    single = _actor(tiny_model_path)  # the same weights on one rank, fixed micro-batches
    for rank in range(2):
        for rows, log_probs in ((_two_rank_rows(rank), results[rank][1]), (_long_episodes(rank), results[rank][5][1])):
            attended = rows["attention_mask"].bool()
            expected = single.compute_log_prob(rows)["old_log_probs"]
            assert torch.allclose(log_probs[attended], expected[attended], atol=1e-5)


def test_critic_shares_the_update_loop_and_the_dynamic_batching(tiny_model_path):
    """The critic's values and its update's gradient norm are the same under rows or a token budget."""
    from agent_trainer.config import CriticConfig
    from agent_trainer.workers.critic import CriticWorker

    out = {}
    for name, dynamic in (("fixed", {}), ("dynamic", {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 36})):
        cfg = CriticConfig(model=ModelConfig(path=tiny_model_path), ppo_mini_batch_size=6,
                           ppo_micro_batch_size_per_gpu=2, fsdp=FSDPConfig(world_size=1), grad_clip=1e9,
                           optim=OptimConfig(lr=1e-3), **dynamic)
        torch.manual_seed(0)
        worker = CriticWorker(rank=0, world_size=1, critic=cfg, device="cpu")
        worker.init_model()
        batch = _ragged_batch([16, 9, 12, 5, 16, 7])
        batch.update(worker.compute_values(batch))
        batch["returns"] = batch["advantages"] + 0.5
        out[name] = (batch["values"], worker.update_critic(batch)["critic/grad_norm"])
    attended = _ragged_batch([16, 9, 12, 5, 16, 7])["attention_mask"].bool()
    assert torch.allclose(out["fixed"][0][attended], out["dynamic"][0][attended], atol=1e-6)
    assert out["dynamic"][1] == pytest.approx(out["fixed"][1], rel=1e-5) and out["fixed"][1] > 0


def test_a_colocated_critic_is_the_separate_critic_and_checkpoints_apart(tiny_model_path, tmp_path):
    """critic.colocate: the actor rank's critic component gives the separate CriticWorker's values and update,
    bit for bit, leaves the policy untouched, and saves/loads under its own role."""
    from agent_trainer.config import CriticConfig
    from agent_trainer.workers.critic import CriticWorker

    critic_cfg = CriticConfig(model=ModelConfig(path=tiny_model_path), ppo_mini_batch_size=6,
                              ppo_micro_batch_size_per_gpu=2, fsdp=FSDPConfig(world_size=1), grad_clip=1e9,
                              optim=OptimConfig(lr=1e-3))
    actor_cfg = ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-3),
                            fsdp=FSDPConfig(world_size=1))

    def values_and_update(worker) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        batch = _ragged_batch([16, 9, 12, 5, 16, 7])
        batch.update(worker.compute_values(batch))
        batch["returns"] = batch["advantages"] + 0.5
        metrics = worker.update_critic(batch)
        return batch["values"], metrics, worker.compute_values(batch)["values"]

    separate = CriticWorker(rank=0, world_size=1, critic=critic_cfg, device="cpu")
    separate.init_model()
    host = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=actor_cfg, device="cpu",
                       critic=critic_cfg)
    host.init_model()
    policy_before = {k: v.clone() for k, v in host.model.state_dict().items()}
    expected, got = values_and_update(separate), values_and_update(host)
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert not torch.equal(got[2], got[0])  # the update moved the values ...
    assert all(torch.equal(v, policy_before[k]) for k, v in host.model.state_dict().items())  # ... not the policy

    host.save_checkpoint(str(tmp_path / "actor"))
    host.save_checkpoint(str(tmp_path / "critic"), role="critic")
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "actor"))
    AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"))
    fresh = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=actor_cfg, device="cpu",
                        critic=critic_cfg)
    fresh.init_model()
    fresh.load_checkpoint(str(tmp_path / "critic"), role="critic")
    batch = _ragged_batch([16, 9, 12, 5, 16, 7])
    assert torch.equal(fresh.compute_values(batch)["values"], host.compute_values(batch)["values"])
    with pytest.raises(RuntimeError, match="no critic"):
        _actor(tiny_model_path).compute_values(batch)


def test_bf16_mixed_precision_computes_in_bfloat16_and_keeps_float32_weights(tiny_model_path):
    """fsdp.mixed_precision=bf16 on a worker without a process group (the autocast fallback; with one it is FSDP2's
    MixedPrecisionPolicy, tests/workers/test_gpu_path_precision.py): the forward's products are bfloat16 (log-probs
    move by bf16 rounding, not more), while weights, gradients and optimizer states stay float32; the critic colocated
    with it follows."""
    from agent_trainer.config import CriticConfig

    batch = _actor_batch(0)
    fp32 = _actor(tiny_model_path).compute_log_prob(batch)["old_log_probs"]
    bf16 = _actor(tiny_model_path, fsdp=FSDPConfig(world_size=1, mixed_precision="bf16"),
                  ppo_mini_batch_size=4)
    mixed = bf16.compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].bool()
    diff = (mixed - fp32)[mask].abs()
    assert 0 < diff.max() < 0.1 and diff.mean() < 0.02  # bfloat16 rounding of the products, no more
    assert mixed.dtype == torch.float32 and torch.equal(mixed[~mask], torch.zeros_like(mixed[~mask]))
    bf16.update_actor(batch.update(TensorBatch({"old_log_probs": mixed})))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(s.dtype == torch.float32 for state in bf16.optimizer.state.values() for s in state.values()
               if torch.is_tensor(s) and s.is_floating_point())
    hosting = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=bf16.config,
                          critic=CriticConfig(), device="cpu")
    assert hosting.critic.precision().fast_dtype == torch.bfloat16


def test_tokens_after_the_last_reply_are_cut_and_change_nothing(tiny_model_path):
    """An observation appended after a row's last reply is scored by nothing: the passes stop at the last
    generated token, and log-probs, values and the update equal those of the rows without it."""
    from agent_trainer.config import CriticConfig
    from agent_trainer.workers.critic import CriticWorker

    tailed = _ragged_batch([16, 14, 12, 10])
    tailed["response_mask"][:, 8:] = 0  # replies at 4..7, then 8 tokens (or fewer) of observation
    tailed["advantages"] *= tailed["response_mask"]
    bare = TensorBatch(dict(tailed.tensors))
    bare["attention_mask"] = bare["attention_mask"].clone()
    bare["attention_mask"][:, 8:] = 0
    actor = _actor(tiny_model_path, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
    plan = actor.plan_micro_batches(tailed, actor.batching)
    assert [m["input_ids"].shape[1] for _, m in plan] == [8] and plan[0][1].meta.seq_len == 16
    log_probs = actor.compute_log_prob(tailed)["old_log_probs"]
    assert torch.equal(log_probs, actor.compute_log_prob(bare)["old_log_probs"])
    critic = CriticWorker(rank=0, world_size=1, device="cpu", critic=CriticConfig(
        model=ModelConfig(path=tiny_model_path), fsdp=FSDPConfig(world_size=1), ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=4))
    critic.init_model()
    assert torch.equal(critic.compute_values(tailed)["values"], critic.compute_values(bare)["values"])
    grads = {}
    for name, batch in (("tailed", tailed), ("bare", bare)):
        worker = _actor(tiny_model_path, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
        grads[name] = worker.update_actor(batch.update(TensorBatch({"old_log_probs": log_probs})))["actor/grad_norm"]
    assert grads["tailed"] == grads["bare"]


def test_a_batch_without_response_mask_gets_every_attended_tokens_log_prob(tiny_model_path):
    """Plain sequences to score (no response_mask): every attended token, as if all were generated."""
    batch = _ragged_batch([16, 9, 12])
    plain = TensorBatch({k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
    actor = _actor(tiny_model_path)
    expected = actor.compute_log_prob(batch.update(TensorBatch({"response_mask": batch["attention_mask"]})))
    got = actor.compute_log_prob(plain)["old_log_probs"]
    assert torch.equal(got, expected["old_log_probs"]) and (got[:, 1:] != 0).sum() == 16 + 9 + 12 - 3


def test_right_padded_rows_run_without_a_padding_mask_and_score_the_same(tiny_model_path):
    """Right-padded rows need only the causal mask: the worker drops the padding mask (positions count on
    over the pads) and every attended position's log-prob and value is the masked forward's; left padding
    keeps its mask."""
    from transformers import AutoModelForCausalLM

    from agent_trainer.config import CriticConfig
    from agent_trainer.workers.critic import CriticWorker
    from agent_trainer.workers.fsdp_base import causal_mask_suffices

    batch = _ragged_batch([16, 9, 12, 5])
    actor = _actor(tiny_model_path)
    inputs = actor.model_inputs(batch)
    assert inputs.attention_mask is None and torch.equal(inputs.position_ids[3], torch.arange(16))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    masked = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
    expected = torch.log_softmax(masked[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    scored = batch["response_mask"][:, 1:].bool()
    got = actor.compute_log_prob(batch)["old_log_probs"][:, 1:]
    assert torch.allclose(got[scored], expected[scored], atol=1e-5)
    critic = CriticWorker(rank=0, world_size=1, device="cpu", critic=CriticConfig(
        model=ModelConfig(path=tiny_model_path), fsdp=FSDPConfig(world_size=1), ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=4))
    critic.init_model()
    unmasked = critic.compute_values(batch)["values"]
    critic.model_inputs = lambda micro: ModelInputs(micro["input_ids"], micro["attention_mask"], micro["position_ids"])
    with_mask = critic.compute_values(batch)["values"]
    attended = batch["response_mask"].bool()
    assert torch.allclose(unmasked[attended], with_mask[attended], atol=1e-5)
    left = batch["attention_mask"].flip(-1)
    assert not causal_mask_suffices(left, (left.cumsum(-1) - 1).clamp(min=0))
    assert not causal_mask_suffices(batch["attention_mask"], batch["position_ids"] + 1)  # offset positions
    assert causal_mask_suffices(batch["attention_mask"], (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))


def _prefix_rows(seed: int = 0, prefix: int = 24, lengths: tuple[int, ...] = (40, 33, 38, 29)) -> TensorBatch:
    """Right-padded rows whose first ``prefix`` tokens are one prompt (a GRPO group); generated from column 28."""
    batch = _ragged_batch(list(lengths), T=40, seed=seed)
    batch["input_ids"][:, :prefix] = batch["input_ids"][0, :prefix]
    batch["response_mask"][:, :28] = 0
    batch["advantages"] *= batch["response_mask"]
    return batch


def _without_prefix_sharing(monkeypatch) -> None:
    import agent_trainer.workers.fsdp_base as fsdp_base

    monkeypatch.setattr(fsdp_base, "SHARED_PREFIX_MIN_TOKENS", 10**9)


def test_shared_prefix_length_stops_at_the_first_output_a_pass_reads():
    from agent_trainer.workers.fsdp_base import shared_prefix_length

    batch = _prefix_rows()
    assert shared_prefix_length(batch["input_ids"], batch["response_mask"]) == 24  # the rows part at column 24
    early = batch["response_mask"].clone()
    early[1, 20] = 1  # column 19's output predicts a generated token: the prefix ends before it
    assert shared_prefix_length(batch["input_ids"], early) == 19
    early[1, 10] = 1  # 9 columns: under SHARED_PREFIX_MIN_TOKENS, not worth a forward of its own
    assert shared_prefix_length(batch["input_ids"], early) == 0
    assert shared_prefix_length(batch["input_ids"][:1], batch["response_mask"][:1]) == 0  # one row: nothing to share
    assert shared_prefix_length(batch["input_ids"], batch["attention_mask"]) == 0  # every column scored (reward model)


@pytest.mark.parametrize("suffixes", ["padded", "packed"])
def test_a_shared_prefix_runs_once_and_changes_no_output_or_gradient(tiny_model_path, monkeypatch, suffixes):
    """Rows sharing a prompt: the actor's log-probs, the critic's values and both updates' gradients equal the
    forward of every row in full (float rounding), and the prompt's columns ran for one row only; the rows'
    remaining columns ran padded, or packed into one row without their padding."""
    import agent_trainer.workers.fsdp_base as fsdp_base
    from agent_trainer.config import CriticConfig
    from agent_trainer.workers.critic import CriticWorker

    def run() -> dict[str, object]:
        actor = _actor(tiny_model_path, ppo_mini_batch_size=4)
        critic = CriticWorker(rank=0, world_size=1, device="cpu", critic=CriticConfig(
            model=ModelConfig(path=tiny_model_path), ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
            fsdp=FSDPConfig(world_size=1), grad_clip=1e9, optim=OptimConfig(lr=1e-3)))
        critic.init_model()
        batch = _prefix_rows()
        widths = []
        embed = actor.model.get_input_embeddings().register_forward_hook(lambda m, a, out: widths.append(out.shape))
        batch.update(actor.compute_log_prob(batch))
        embed.remove()
        batch.update(critic.compute_values(batch))
        batch["returns"] = batch["advantages"] + 0.5
        actor_grads, critic_grads = _record_grads(actor), _record_grads(critic)
        metrics = {**actor.update_actor(batch), **critic.update_critic(batch)}
        return {"batch": batch, "widths": widths, "actor": actor_grads, "critic": critic_grads, "metrics": metrics}

    def forced(config, ids, scored, two_calls) -> fsdp_base.Layout:  # whichever the cost would pick for these rows
        shared = fsdp_base.shared_prefix_length(ids, scored)
        return fsdp_base.Layout(shared, fsdp_base.suffix_spans(scored, shared) if suffixes == "packed" else None)

    with monkeypatch.context() as patch:
        patch.setattr(fsdp_base, "choose_layout", forced)
        shared = run()
    with monkeypatch.context() as patch:
        _without_prefix_sharing(patch)
        full = run()
    # micro-batches of 2 rows (longest first) cut to 40 and 33 columns: the prompt once ([1, 24]), then the rest
    # padded to the longer row, or the prompt and both rows' rest in one row (24 + 16 + 14 and 24 + 9 + 5)
    padded = [(1, 24, 128), (2, 16, 128), (1, 24, 128), (2, 9, 128)]
    assert shared["widths"] == (padded if suffixes == "padded" else [(1, 54, 128), (1, 38, 128)])
    assert full["widths"] == [(2, 40, 128), (2, 33, 128)]
    scored = full["batch"]["response_mask"].bool()
    for key in ("old_log_probs", "values"):
        assert torch.allclose(shared["batch"][key][scored], full["batch"][key][scored], atol=1e-5), key
    for role in ("actor", "critic"):
        assert shared[role].keys() == full[role].keys() and shared[role]
        for name, grad in full[role].items():
            assert torch.allclose(shared[role][name], grad, rtol=1e-4, atol=1e-6), (role, name)
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert shared["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-4), key


def test_the_layout_of_rows_sharing_a_prefix_follows_their_flops(tiny_model_path):
    """GRPO replies of one group differ in length: packed with their prompt into one row, without padding.
    Long episodes of near-equal length sharing a system prompt: the prefix cached, or every row in full where
    two model calls are ruled out (FSDP ranks that disagree). Attentions without 4D masks never pack."""
    from transformers import AutoConfig

    from agent_trainer.workers.fsdp_base import Layout, choose_layout, linear_per_attention_pair

    config = AutoConfig.from_pretrained(tiny_model_path)
    config._attn_implementation = "sdpa"
    assert linear_per_attention_pair(config) == 768  # 2 x 196,608 linear weights per layer / (4 x 128)

    def rows(ends: list[int], start: int, common: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = torch.randint(3, 200, (len(ends), max(ends)), generator=torch.Generator().manual_seed(0)), \
            torch.zeros(len(ends), max(ends), dtype=torch.long)
        ids[:, :common] = ids[0, :common]
        for row, end in enumerate(ends):
            mask[row, start:end] = 1
        return ids, mask

    grpo = rows([175 + 64, 175 + 12, 175 + 8, 175 + 6], start=175, common=175)
    assert choose_layout(config, *grpo, two_calls=True) == Layout(174, (65, 13, 9, 7))  # through each last token
    episodes = rows([580, 570, 560, 550], start=200, common=150)
    assert choose_layout(config, *episodes, two_calls=True) == Layout(150)
    assert Layout(150).model_calls == 2 and Layout(174, (1,)).model_calls == Layout().model_calls == 1
    assert choose_layout(config, *episodes, two_calls=False) == Layout()
    no_reply = grpo[1].clone()
    no_reply[3] = 0  # a padding row: nothing to run after the prefix
    assert choose_layout(config, grpo[0], no_reply, two_calls=True) == Layout(174, (65, 13, 9, 0))
    config._attn_implementation = "eager"
    assert choose_layout(config, *grpo, two_calls=False) == Layout()


def _two_prompts(lengths: tuple[int, ...], second: list[int]) -> TensorBatch:
    """:func:`_prefix_rows` whose prompts (28 tokens) share 24: the rows in ``second`` end theirs differently."""
    batch = _prefix_rows(lengths=lengths)
    batch["input_ids"][:, 24:28] = batch["input_ids"][0, 24:28]
    batch["input_ids"][second, 24:28] += 1
    return batch


def test_micro_batches_keep_a_prompts_rows_together_when_that_runs_fewer_positions(tiny_model_path, monkeypatch):
    """Two prompts' rows interleaved (a GRPO batch after shuffling): longest first would pair different prompts,
    which share 24 tokens; each prompt's rows together share all 28 and run 8 positions fewer. Rows of very
    different lengths stay longest first where pairing by prompt would add more padding than it shares."""
    actor = _actor(tiny_model_path)

    def plan(batch: TensorBatch) -> list[list[int]]:
        return [rows.tolist() for rows, _ in actor.plan_micro_batches(batch, actor.batching)]

    interleaved = _two_prompts((40, 40, 39, 39), second=[1, 3])
    assert plan(interleaved) == [[0, 2], [1, 3]]
    micro = actor.plan_micro_batches(interleaved, actor.batching)[0][1]
    assert micro["input_ids"].shape[1] == 40 and actor.model_inputs(micro).shared_prefix == 27
    assert plan(_two_prompts((40, 30, 39, 29), second=[1, 3])) == [[0, 2], [1, 3]]  # longest first agrees
    assert plan(_two_prompts((40, 29, 30, 39), second=[2, 3])) == [[0, 3], [1, 2]]  # by prompt: 104 positions, not 92
    _without_prefix_sharing(monkeypatch)
    assert plan(interleaved) == [[0, 1], [2, 3]]


def _one_rank_fsdp(init_file: str, path: str, gather_once: bool, results) -> None:
    """A one-rank FSDP2 (gloo) actor: its first update's gradients, the gathers and gradient reductions of that
    update, then those of ``compute_log_prob``. Without ``gather_once`` the loops run under FSDP2's defaults."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.profiler import ProfilerActivity, profile

    from agent_trainer.workers import actor as actor_mod, fsdp_base

    if not gather_once:
        actor_mod.gathered_once = fsdp_base.gathered_once = lambda model, plan, backward: iter(plan)
    gathers = []
    unshard = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):  # counts the unshards that copy, then runs FSDP2's own
        if group._all_gather_result is None and not group.is_unsharded:
            gathers.append(group)
        return unshard(group, *args, **kwargs)

    FSDPParamGroup.unshard = counted
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=path), device="cpu",
                             actor=ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                                               optim=OptimConfig(lr=1e-3), fsdp=FSDPConfig(world_size=1)))
        worker.init_model()
        grads = []
        worker.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(
            {n: p.grad.full_tensor().clone() for n, p in worker.model.named_parameters() if p.grad is not None}))
        batch = _actor_batch(0, B=6)
        batch.tensors["old_log_probs"] = torch.zeros(batch["input_ids"].shape)
        gathers.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            worker.update_actor(batch)
        events = prof.events()
        reduces = sum(e.name.startswith("FSDP::post_backward_reduce") for e in events)
        loops = [(e.time_range.start, e.time_range.end) for e in events if e.name == fsdp_base.MICRO_BATCH_LOOP]
        syncs = [e.name for e in events if e.name in {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"}
                 and any(start <= e.time_range.start <= end for start, end in loops)]
        update_gathers = len(gathers)
        gathers.clear()
        log_probs = worker.compute_log_prob(batch)["old_log_probs"]
        units = sum(isinstance(m, fsdp_base.FSDPModule) for m in worker.model.modules())
        resharded = all(not m._get_fsdp_state()._fsdp_param_group.is_unsharded
                        for m in worker.model.modules() if isinstance(m, fsdp_base.FSDPModule) and m is not worker.model)
        results[gather_once] = (grads[0], update_gathers, reduces, len(gathers), log_probs, units, resharded,
                                worker.optimizer.param_groups[0]["fused"], len(loops), syncs)
    finally:
        dist.destroy_process_group()


def test_one_rank_gathers_the_model_once_per_update_with_the_same_gradients(tiny_model_path, tmp_path):
    """On one rank FSDP2 keeps the gathered layers from a mini-batch's first forward to its last backward and reduces
    the gradients once (``gathered_once``): three micro-batches take one gather per unit instead of one per forward
    and backward, the gradients equal FSDP2's defaults', and ``compute_log_prob``'s micro-batches share one
    gather too; every layer is resharded afterwards, and the micro-batch loop still reads nothing from the device.
    The optimizer is torch's fused AdamW."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    for gather_once in (True, False):
        proc = ctx.Process(target=_one_rank_fsdp, args=(str(tmp_path / f"pg{gather_once}"), tiny_model_path,
                                                        gather_once, results))
        proc.start()
        proc.join(timeout=300)
        assert proc.exitcode == 0
    once, default = results[True], results[False]
    units = once[5]
    assert units > 2
    assert once[1] == units and once[2] == units  # one gather and one reduction per unit for 3 micro-batches
    assert default[1] > 3 * units and default[2] == 3 * units  # FSDP2's defaults: per forward/backward, per backward
    assert once[3] == units < default[3]  # compute_log_prob: three forwards, one gather
    assert once[6] and default[6]  # nothing left gathered after the passes
    assert once[7] is True
    assert once[8] == 1 and once[9] == []  # FSDP2 on one rank reads nothing from the device in the loop either
    assert once[0].keys() == default[0].keys() and len(once[0]) > 0
    for name, grad in once[0].items():
        torch.testing.assert_close(grad, default[0][name], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(once[4], default[4], rtol=0, atol=1e-6)
