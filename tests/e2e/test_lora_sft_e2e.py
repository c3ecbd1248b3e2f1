"""SFT with LoRA, then RL from its adapter, end to end on the tiny model: the SFT entry point trains a peft adapter
for 2 steps (2 FSDP2 actor ranks, Ray) and links it as ``final`` (a peft adapter folder); an RL run with
``model_path`` = the base and ``actor_rollout_ref.model.lora_adapter_path`` = that folder starts its actor from the
SFT's adapter (not fresh weights) and its engine samples step 0 with it merged. With ``trainer.merge_lora`` the SFT
links ``final`` to the build with the adapter merged in instead."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from e2e_runs import started
from test_train_e2e import SMALL

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]"]


def sft_with_lora(model: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Two LoRA SFT steps at a high learning rate (the adapter moves visibly), no env evaluation."""
    cmd = [sys.executable, "-m", "agent_trainer.sft", "--config-name", "sft_frozenlake",
           f"model_path={model}", f"trainer.default_local_dir={run_dir}", f"rl_overrides={json.dumps(LORA)}",
           "data.num_episodes=24", "train.max_steps=2", "train.batch_size=8", "train.optim.lr=2e-2",
           "train.optim.warmup_steps=0", "eval.env_success=false", "eval.test_freq=0", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_sft_with_lora_saves_an_adapter_that_starts_rl(tiny_model_path, tmp_path):
    run_dir = tmp_path / "sft"
    sft_with_lora(tiny_model_path, run_dir, "eval.val_before_train=true")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    # the adapter moved the model (a frozen or unsaved adapter leaves the loss exactly as it was); two steps at this
    # learning rate may overshoot, so the direction is not asserted
    assert records[-1]["val/sft_loss"] != records[0]["val/sft_loss"]
    final = run_dir / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    saved = load_file(str(final / "adapter_model.safetensors"))
    assert len(saved) == 2 * 3 * 2 and any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in saved.items())

    overrides = [*SMALL, *LORA, "trainer.total_training_steps=1", f"actor_rollout_ref.model.lora_adapter_path={final}",
                 "algorithm.adv_estimator=grpo"]
    with started("frozenlake", tiny_model_path, tmp_path / "rl", *overrides) as trainer:
        state = ray.get(trainer.actor_wg.execute_all_async("full_state_dict"))[0]
        adapter = {k: v for k, v in state.items() if ".lora_A.default." in k or ".lora_B.default." in k}
        assert {"base_model.model." + k.replace(".default.", "."): v for k, v in adapter.items()}.keys() == saved.keys()
        for name, value in adapter.items():  # the SFT's adapter, not fresh weights (fresh lora_B is zero)
            assert torch.equal(value, saved["base_model.model." + name.replace(".default.", ".")]), name
        history = trainer.fit()
    assert len(history) == 1
    # step 0's samples came from the engine holding base + the SFT adapter, merged: the actor (same adapter) agrees
    assert history[0]["actor/rollout_vs_actor_logprob_diff"] < 1e-3


def test_sft_with_merge_lora_links_final_to_the_build_with_the_adapter_merged_in(tiny_model_path, tmp_path):
    """trainer.merge_lora (the LoRA warm start of docs/tiny_model.md's pilots): final is a full model, W + (alpha /
    r) B A on every adapted layer and the build's weights elsewhere, loaded by a plain model_path; the adapter stays
    beside it."""
    run_dir = tmp_path / "sft"
    proc = sft_with_lora(tiny_model_path, run_dir, "eval.val_before_train=false", "trainer.merge_lora=true")
    final = (run_dir / "final").resolve()
    assert final.name == "merged" and f"model: {run_dir / 'final'}" in proc.stdout
    adapter = load_file(str(final.parent / "actor" / "adapter_model.safetensors"))
    base = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    merged = load_file(str(final / "model.safetensors"))
    assert merged.keys() == base.keys()
    adapted = 0
    for key, weight in base.items():
        stem = "base_model.model." + key.removesuffix(".weight")
        if f"{stem}.lora_A.weight" not in adapter:
            assert torch.equal(merged[key], weight), key
            continue
        delta = (16 / 8) * adapter[f"{stem}.lora_B.weight"].float() @ adapter[f"{stem}.lora_A.weight"].float()
        assert delta.abs().max() > 0, key
        torch.testing.assert_close(merged[key].float(), weight.float() + delta, rtol=1e-5, atol=1e-6)
        adapted += 1
    assert adapted == 2 * 3  # q_proj, v_proj and down_proj of both layers
    assert (final / "tokenizer_config.json").is_file()
