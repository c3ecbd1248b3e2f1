"""GPU path: one training step with FSDP2 over NCCL and CUDA vLLM. Skipped without 2 CUDA devices.

Never run on the development machines (no GPU); it is here so that a GPU machine checks the
same entry point with `make install-gpu && .venv/bin/python -m pytest -m gpu`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (actor rank + vLLM engine)"),
]


def test_one_grpo_step_on_gpu(tiny_model_path, tmp_path):
    run_dir = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake_grpo",
           f"model_path={tiny_model_path}", f"trainer.default_local_dir={run_dir}", "trainer.device=cuda",
           "trainer.total_training_steps=1", "trainer.test_freq=0", "actor_rollout_ref.actor.use_kl_loss=false",
           "actor_rollout_ref.actor.fsdp.world_size=1", "agent_proxy.max_turn=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["actor/rollout_vs_actor_logprob_diff"] < 1e-2  # bf16/tf32 kernels differ more than CPU fp32
