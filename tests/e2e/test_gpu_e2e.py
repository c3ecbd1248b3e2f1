"""GPU path: one training step with FSDP2 over NCCL and CUDA vLLM, in both layouts.

- One GPU: the colocated layout (``actor_rollout_ref.hybrid_engine=true``, actor world size 1): the engine shares
  the actor rank's GPU and sleeps while the step trains (sleep mode on by default there).
- Two GPUs: separate engines (the actor rank on one GPU, the vLLM engine on the other).

Skipped without CUDA devices; never run on the development machines (no GPU). It is here so that a GPU
machine checks the same entry point with `make install-gpu && .venv/bin/python -m pytest -m gpu`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]


def one_grpo_step(model_path: str, run_dir: Path, *overrides: str) -> dict:
    """One GRPO step through the command line; returns its metrics."""
    cmd = [sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake_grpo",
           f"model_path={model_path}", f"trainer.default_local_dir={run_dir}", "trainer.device=cuda",
           "trainer.total_training_steps=1", "trainer.test_freq=0", "actor_rollout_ref.actor.use_kl_loss=false",
           "actor_rollout_ref.actor.fsdp.world_size=1", "agent_proxy.max_turn=2", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_one_grpo_step_colocated_on_one_gpu(tiny_model_path, tmp_path):
    record = one_grpo_step(tiny_model_path, tmp_path / "gpu1", "actor_rollout_ref.hybrid_engine=true")
    assert record["actor/rollout_vs_actor_logprob_diff"] < 1e-2  # bf16/tf32 kernels differ more than CPU fp32
    assert "timing_s/engine_sleep" in record  # the engine slept while the step trained (sleep mode on)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (actor rank + vLLM engine)")
def test_one_grpo_step_with_a_separate_engine_on_two_gpus(tiny_model_path, tmp_path):
    record = one_grpo_step(tiny_model_path, tmp_path / "gpu2")
    assert record["actor/rollout_vs_actor_logprob_diff"] < 1e-2
