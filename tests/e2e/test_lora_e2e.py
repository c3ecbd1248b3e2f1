"""LoRA end to end on the tiny model: a local Ray cluster, 2 FSDP2 actor ranks training a peft adapter, the reference
as the actor's model with its adapter off (use_kl_loss), 1 vLLM CPU engine fed the merged weights, env actors.
Two GRPO steps; the checkpoint is the adapter in peft's layout."""

import pytest
import ray
import torch

from e2e_runs import started
from test_train_e2e import SMALL

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

LORA = [
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
    "actor_rollout_ref.actor.optim.lr=2e-2",  # an adapter starts at zero and moves by lr per step
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
]


def _is_adapter(name: str) -> bool:
    return ".lora_A.default." in name or ".lora_B.default." in name


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory):
    with started("frozenlake", tiny_model_path, tmp_path_factory.mktemp("lora_run"), *SMALL, *LORA) as trainer:
        before = ray.get(trainer.actor_wg.execute_all_async("full_state_dict"))[0]
        history = trainer.fit()
        yield trainer, history, before


def test_only_the_adapter_trains(trained):
    trainer, history, before = trained
    assert len(history) == 2 and all(h["actor/grad_norm"] > 0 for h in history)
    assert all("actor/kl_loss" in h for h in history)  # the reference (adapter off) fed the KL loss
    after = ray.get(trainer.actor_wg.execute_all_async("full_state_dict"))[0]
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    adapter = sorted(k for k in before if _is_adapter(k))
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 modules in each of 2 layers
    assert changed and all(_is_adapter(k) for k in changed), changed[:4]
    assert all(not torch.equal(after[k], torch.zeros_like(after[k])) for k in adapter if ".lora_B." in k)


def test_the_engine_samples_with_the_merged_weights(trained):
    trainer, history, _ = trained
    for metrics in history:
        assert metrics["actor/rollout_vs_actor_logprob_diff"] < 1e-3  # as the full-model run (test_train_e2e.py)
    tok = trainer.tokenizer
    seqs = [tok.encode(t, add_special_tokens=False) for t in ("<think>go down</think><answer>Down</answer>",
                                                              "Observation:\nP_O\n__G")]
    vllm_lp = ray.get(trainer.engines[0].prompt_logprobs.remote(seqs))
    from agent_trainer.common.batch import TensorBatch

    T = max(len(s) for s in seqs)
    ids, mask = torch.zeros(len(seqs), T, dtype=torch.long), torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    batch = TensorBatch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
    actor_lp = trainer.actor_wg.dp_compute("compute_log_prob", batch)["old_log_probs"]
    for i, s in enumerate(seqs):
        assert (torch.tensor(vllm_lp[i][1:]) - actor_lp[i, 1: len(s)]).abs().max().item() < 1e-3, i


def test_the_checkpoint_is_the_adapter(trained, tiny_model_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer, _, _ = trained
    path = trainer.save_checkpoint() / "actor"
    assert (path / "adapter_config.json").is_file() and not (path / "model.safetensors").exists()
    weights = load_file(str(path / "adapter_model.safetensors"))
    assert weights and all(k.startswith("base_model.model.") and ".lora_" in k for k in weights)
    state = ray.get(trainer.actor_wg.execute_all_async("full_state_dict"))[0]
    for key, value in weights.items():
        assert torch.equal(value, state[key.removeprefix("base_model.model.").replace(".weight", ".default.weight")])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(path))
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) == sum(map(torch.numel,
                                                                                        weights.values()))

