"""LoRA on the actor (agent_trainer/workers/lora.py) without Ray: only the adapter trains, the reference is the model with the
adapter off, the engines get the merged weights under the plain names, the checkpoint is peft's adapter folder.

The sync to a real vLLM engine and a 2-rank FSDP2 group are checked in tests/workers/test_weight_sync.py (e2e) and
tests/e2e/test_lora_e2e.py."""

from __future__ import annotations

import pytest
import torch

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig, RefConfig
from tests.workers.test_fsdp_workers import _ragged_batch
from agent_trainer.workers.actor import ActorWorker, ReferenceWorker
from agent_trainer.workers.weight_buckets import unpack_bucket
from agent_trainer.workers.weight_sync import iter_weight_buckets, sync_tensor_names

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _batch(seed: int = 0, lengths=(16, 9, 12, 5, 16, 7), T: int = 16) -> TensorBatch:
    return _ragged_batch(list(lengths), T, seed)


def _lora_model(path: str, **overrides) -> ModelConfig:
    return ModelConfig(path=path, **{"lora_rank": 4, "lora_alpha": 8.0, "target_modules": TARGETS, **overrides})


def _actor(path: str, lora: bool = True, ref: RefConfig | None = None, lr: float = 5e-2, seed: int = 3,
           adapter: str | None = None, **actor) -> ActorWorker:
    cfg = ActorConfig(**{"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 2, "grad_clip": 1e9,
                         "optim": OptimConfig(lr=lr, warmup_steps=2), "fsdp": FSDPConfig(world_size=1), **actor})
    model = _lora_model(path, lora_adapter_path=adapter) if lora else ModelConfig(path=path)
    worker = ActorWorker(rank=0, world_size=1, model=model, actor=cfg, device="cpu", ref=ref, seed=seed)
    worker.init_model()
    return worker


def _train(worker: ActorWorker, seed: int) -> dict:
    batch = _batch(seed)
    return worker.update_actor(batch.update(worker.compute_log_prob(batch)))


def test_only_the_adapter_gets_gradients_and_optimizer_state(tiny_model_path):
    worker = _actor(tiny_model_path)
    trained = sorted(n for n, p in worker.model.named_parameters() if p.requires_grad)
    assert trained and all((".lora_A.default." in n or ".lora_B.default." in n) for n in trained)
    assert {n.split(".")[-4] for n in trained} == set(TARGETS)
    names = {id(p): n for n, p in worker.model.named_parameters()}
    assert sorted(names[id(p)] for g in worker.optimizer.param_groups for p in g["params"]) == trained
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    base_lp = _actor(tiny_model_path, lora=False).compute_log_prob(_batch())["old_log_probs"]
    assert torch.equal(worker.compute_log_prob(_batch())["old_log_probs"], base_lp)  # lora_B starts at zero
    for step in range(2):
        metrics = _train(worker, seed=step)
    assert metrics["actor/grad_norm"] > 0
    for name, param in worker.model.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == (name in trained), name  # the base never moves; every adapter matrix does
    assert set(names[id(p)] for p in worker.optimizer.state) == set(trained)
    assert not torch.allclose(worker.compute_log_prob(_batch())["old_log_probs"], base_lp)


def test_the_reference_is_the_model_with_its_adapter_off(tiny_model_path):
    """A colocated reference with LoRA is no second model: the adapter switched off gives the separate
    ReferenceWorker's log-probs (ref.colocate=false: it loads model_path, the base, whatever the lora keys), before
    and after updates that move the policy."""
    ref = RefConfig(log_prob_micro_batch_size_per_gpu=4)
    separate = ReferenceWorker(rank=0, world_size=1, model=_lora_model(tiny_model_path), ref=ref, device="cpu")
    separate.init_model()
    batch = _batch()
    expected = separate.compute_ref_log_prob(batch)["ref_log_prob"]
    assert not any(".lora_" in name for name, _ in separate.model.named_parameters())
    actor = _actor(tiny_model_path, ref=ref, use_kl_loss=True, kl_loss_coef=0.1)
    assert actor.ref_model is None  # no second copy of the weights
    for step in range(2):
        batch = _batch(step)
        batch.update(actor.compute_ref_log_prob(batch))
        metrics = actor.update_actor(batch.update(actor.compute_log_prob(batch)))
    assert metrics["actor/kl_loss"] > 0  # the policy moved away from the reference
    batch = _batch()
    policy = actor.compute_log_prob(batch)["old_log_probs"]
    assert not torch.allclose(policy, expected)
    assert torch.allclose(actor.compute_ref_log_prob(batch)["ref_log_prob"], expected, atol=1e-6)
    assert torch.equal(actor.compute_log_prob(batch)["old_log_probs"], policy)  # the adapter is back on
    assert all(p.requires_grad for n, p in actor.model.named_parameters() if ".lora_" in n)


def _synced_model(worker: ActorWorker, path: str, limit: int = 64 * 1024):
    """A plain HF model holding what a sync sends (the engines' view), and the names and shapes sent."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sent = {}
    for bucket in iter_weight_buckets(worker.model, True, limit, torch.float32):
        names, tensors = unpack_bucket(bucket.specs, bucket.flat)
        sent.update((n, t.clone()) for n, t in zip(names, tensors))
    plain.load_state_dict(sent, strict=False)
    return plain, sent


def test_a_sync_sends_the_merged_weights_under_the_plain_names(tiny_model_path):
    """The engines get exactly the names and shapes of a full-model sync, adapted weights merged: a plain model
    loaded with them gives the LoRA actor's log-probs."""
    from agent_trainer.workers.fsdp_base import ModelInputs, target_logits

    worker = _actor(tiny_model_path)
    for step in range(2):
        _train(worker, seed=step)
    plain_actor = _actor(tiny_model_path, lora=False)
    assert sync_tensor_names(worker.model) == sync_tensor_names(plain_actor.model)
    plain, sent = _synced_model(worker, tiny_model_path)
    reference = {n: t.shape for n, t in plain_actor.model.state_dict().items() if n != "lm_head.weight"}
    assert {n: t.shape for n, t in sent.items()} == reference
    merged = sent["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(merged, plain_actor.model.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sent["model.layers.0.self_attn.k_proj.weight"],
                       plain_actor.model.state_dict()["model.layers.0.self_attn.k_proj.weight"])  # not adapted
    batch = _batch(5)
    mask = batch["attention_mask"].bool()
    inputs = ModelInputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    with torch.no_grad():
        engine_view = target_logits(plain, inputs, batch["attention_mask"]).log_probs()
    actor_view = worker.compute_log_prob(TensorBatch({**batch.tensors, "response_mask": batch["attention_mask"]}))
    assert (engine_view[mask] - actor_view["old_log_probs"][mask]).abs().max() < 1e-4


def test_the_checkpoint_is_the_adapter_in_peft_layout_and_resumes_bit_exactly(tiny_model_path, tmp_path):
    """Save after two updates: the shards hold the adapter and its AdamW state only, the folder is peft's
    (PeftModel.from_pretrained onto the base model gives the actor's log-probs), and a fresh actor loading it
    continues with identical weights, moments and learning rate."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agent_trainer.workers import sharded_checkpoint
    from agent_trainer.workers.fsdp_base import ModelInputs, target_logits

    original = _actor(tiny_model_path)
    for step in range(2):
        _train(original, seed=step)
    folder = tmp_path / "actor"
    original.save_checkpoint(str(folder))
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    index = sharded_checkpoint.read_index(folder / "shards")
    trained = {n for n, p in original.model.named_parameters() if p.requires_grad}
    assert {e["key"] for k, e in index["tensors"].items() if k.startswith("model/")} == trained
    assert set(load_file(str(folder / "adapter_model.safetensors"))) == {
        "base_model.model." + n.replace(".default.", ".") for n in trained}
    with pytest.raises(ValueError, match="LoRA adapter only"):
        sharded_checkpoint.write_hf_weights(folder / "shards", tmp_path / "export")

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(folder))
    batch = _batch(7)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        peft_lp = target_logits(peft_model.eval(), ModelInputs(batch["input_ids"], batch["attention_mask"],
                                                               batch["position_ids"]), batch["attention_mask"])
    actor_lp = original.compute_log_prob(TensorBatch({**batch.tensors, "response_mask": batch["attention_mask"]}))
    assert (peft_lp.log_probs()[mask] - actor_lp["old_log_probs"][mask]).abs().max() < 1e-5

    resumed = _actor(tiny_model_path)
    resumed.load_checkpoint(str(folder))
    assert resumed.lr_scheduler.last_epoch == original.lr_scheduler.last_epoch == 2
    for worker in (original, resumed):
        _train(worker, seed=5)
    for key, value in original.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    orig_state, res_state = original.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert len(orig_state) == len(trained)
    for pid, entries in orig_state.items():
        for name, value in entries.items():
            assert torch.equal(value, res_state[pid][name]), (pid, name)
    with pytest.raises(ValueError, match="holds a LoRA adapter but this run trains a full model"):
        _actor(tiny_model_path, lora=False).load_checkpoint(str(folder))


@pytest.mark.parametrize("option", ["gradient_checkpointing", "bf16"])
def test_the_adapter_trains_with_gradient_checkpointing_and_under_bf16(tiny_model_path, option):
    """Activation checkpointing (frozen embeddings: their output is made to require grad) and bf16 compute
    (autocast without a process group) still give the adapter gradients, and the base stays put."""
    cfg = ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                      optim=OptimConfig(lr=5e-2),
                      fsdp=FSDPConfig(world_size=1, mixed_precision="bf16" if option == "bf16" else "none"))
    model = _lora_model(tiny_model_path, enable_gradient_checkpointing=option == "gradient_checkpointing")
    worker = ActorWorker(rank=0, world_size=1, model=model, actor=cfg, device="cpu", seed=3)
    worker.init_model()
    assert worker.model.is_gradient_checkpointing == (option == "gradient_checkpointing")
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    for step in range(2):
        assert _train(worker, seed=step)["actor/grad_norm"] > 0
    for name, param in worker.model.named_parameters():
        assert torch.equal(param, before[name]) != param.requires_grad, name


def test_the_decoder_layers_are_found_in_place_and_inside_a_peft_wrapper(tiny_model_path):
    """FSDP2's units: the actor's in-place adapter leaves the layers where they were; a ``PeftModel`` hides them
    two levels down (``base_model.model``), where ``_decoder_layers`` looks too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agent_trainer.workers.fsdp_base import decoder_layers as _decoder_layers

    worker = _actor(tiny_model_path)
    assert len(_decoder_layers(worker.model)) == 2
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                             LoraConfig(r=2, target_modules=["q_proj"]))
    layers = _decoder_layers(wrapped)
    assert len(layers) == 2 and layers[0] is wrapped.get_base_model().model.layers[0]


def _peft_log_probs(base_path: str, folder, batch: TensorBatch) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agent_trainer.workers.fsdp_base import ModelInputs, target_logits

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), str(folder))
    with torch.no_grad():
        return target_logits(peft_model.eval(), ModelInputs(batch["input_ids"], batch["attention_mask"],
                                                            batch["position_ids"]), batch["attention_mask"]).log_probs()


def test_an_actor_started_from_a_saved_adapter_gives_the_saving_actors_log_probs(tiny_model_path, tmp_path):
    """lora_adapter_path: a fresh actor (another seed, so other fresh weights) loads the adapter folder another
    actor saved and computes its log-probs, which are also peft's own for that folder on the base model; the
    adapter keeps training from there (only it moves)."""
    original = _actor(tiny_model_path)
    for step in range(2):
        _train(original, seed=step)
    folder = tmp_path / "actor"
    original.save_checkpoint(str(folder))
    started = _actor(tiny_model_path, seed=11, adapter=str(folder))
    fresh = _actor(tiny_model_path, seed=11)
    batch = _batch(7)
    batch = TensorBatch({**batch.tensors, "response_mask": batch["attention_mask"]})
    mask = batch["attention_mask"].bool()
    expected = original.compute_log_prob(batch)["old_log_probs"]
    got = started.compute_log_prob(batch)["old_log_probs"]
    assert torch.equal(got, expected)
    assert not torch.allclose(fresh.compute_log_prob(batch)["old_log_probs"], expected)  # the folder mattered
    assert (_peft_log_probs(tiny_model_path, folder, batch)[mask] - got[mask]).abs().max() < 1e-5
    for name, value in original.model.state_dict().items():
        assert torch.equal(value, started.model.state_dict()[name]), name
    assert _train(started, seed=3)["actor/grad_norm"] > 0


def test_an_adapter_saved_by_peft_itself_starts_the_actor(tiny_model_path, tmp_path):
    """Any peft folder (PeftModel.save_pretrained of get_peft_model with random B) loads: same log-probs as peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                             LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    wrapped.save_pretrained(str(tmp_path / "peft"))
    started = _actor(tiny_model_path, adapter=str(tmp_path / "peft"))
    batch = _batch(2)
    batch = TensorBatch({**batch.tensors, "response_mask": batch["attention_mask"]})
    mask = batch["attention_mask"].bool()
    got = started.compute_log_prob(batch)["old_log_probs"]
    assert (_peft_log_probs(tiny_model_path, tmp_path / "peft", batch)[mask] - got[mask]).abs().max() < 1e-5
    assert not torch.allclose(got, _actor(tiny_model_path, lora=False).compute_log_prob(batch)["old_log_probs"])


def test_an_adapter_folder_of_another_shape_is_refused_when_loading(tiny_model_path, tmp_path):
    """The worker's own check (the config check before Ray compares adapter_config.json; this is the weights)."""
    original = _actor(tiny_model_path)
    original.save_checkpoint(str(tmp_path / "actor"))
    cfg = ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, fsdp=FSDPConfig(world_size=1))
    model = _lora_model(tiny_model_path, target_modules=["q_proj"], lora_adapter_path=str(tmp_path / "actor"))
    worker = ActorWorker(rank=0, world_size=1, model=model, actor=cfg, device="cpu", seed=3)
    with pytest.raises(ValueError, match="does not fit this run's adapter"):
        worker.init_model()
