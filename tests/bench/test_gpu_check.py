"""bench/gpu_check.py, the torch-level GPU checks, run here on CPU over gloo (``--cpu``) with the tiny model's
shape: every part runs and reports (the LoRA and gateway parts too), so the script a GPU session runs has not rotted since
the last GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_every_part_on_cpu(tiny_model_path, tmp_path):
    out = tmp_path / "record.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu", "--shape", tiny_model_path, "--rows", "4", "--micro-rows",
         "2", "--seq", "64", "--prompt", "16", "--steps", "1", "--gen-prompts", "4", "--gen-tokens", "8",
         "--sweep", "--lora", "8", "--gateway", tiny_model_path, "--gateway-episodes", "3", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert {"device", "model", "load", "log_probs", "actor_update", "offload", "hf_generate",
            "engine_vs_actor_before_update", "weight_sync", "engine_vs_actor_after_sync",
            "actor_update_micro8_ckpt", "actor_update_micro2_nockpt", "actor_update_micro4_nockpt",
            "plain_update_micro8_ckpt_full", "plain_update_micro2_nockpt_chunked"} <= set(record)
    for layout in ("micro2_ckpt", "micro8_ckpt", "micro2_nockpt", "micro4_nockpt"):  # the plain loop beside each
        versus = record[f"project_vs_plain_{layout}"]
        assert versus["project_over_plain"] > 0 and versus["project_over_plain_chunked"] > 0
    assert record["actor_update"]["all_finite"] and record["actor_update"]["tokens"] == 4 * 64
    assert record["weight_sync"]["engine_changed"]  # the update moved the weights and the sync carried them
    before = record["engine_vs_actor_before_update"]
    # one bf16 CPU engine agrees with itself: well under bf16's resolution (7.8e-3), on any model build
    assert before["engine_sampled_vs_its_full_forward"] < 2e-3
    assert record["engine_vs_actor_after_sync"]["mean_abs"] < 1e-2
    lora = record["lora_update"]
    assert 0 < lora["trained_parameters"] < lora["of"] / 4  # only the adapter trains
    assert lora["reference_equals_policy_at_start_max_abs"] == 0.0  # lora_B starts at 0: adapter off == on
    assert lora["policy_moved"] > 0 and lora["reference_unchanged_max_abs"] == 0.0
    assert record["lora_sync"]["engine_vs_actor_mean_abs"] < 1e-2  # the merged weights reached the engine
    gateway = record["gateway"]  # the example agent through HTTP: what the client got is what trains
    assert gateway["calls"] >= 3 and gateway["client_got_what_sessions_recorded"]
    assert gateway["trained_tokens_equal_sampled"] and gateway["engine_vs_actor_mean_abs"] < 1e-4
