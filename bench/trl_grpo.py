"""TRL's side of the P2/P5 comparison: GRPOTrainer steps on the same model and prompts.

Runs inside ``bench/.venv-trl`` (``bench/trl_venv.py``), never in the project's venv.
The work matches the project's GRPO step: ``rows`` completions = rows / group_size
prompts x group_size, at most ``max_new_tokens`` new tokens, one optimizer step per
generation (micro-batch ``micro_batch`` x gradient accumulation rows / micro_batch),
KL coefficient ``beta`` against a reference model, HF ``generate`` (TRL's default).
The reward is a format check (cost negligible on both sides). Writes JSON: the seconds
of every optimizer step (generation included) and the peak RSS of this process tree.

    bench/.venv-trl/bin/python bench/trl_grpo.py --model models/tiny-qwen2 --prompts p.json --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rss import PeakRSS  # noqa: E402


def format_reward(completions, **kwargs) -> list[float]:
    """1 for a reply with an <answer>..</answer> span, else 0."""
    return [float("<answer>" in c and "</answer>" in c) for c in completions]


def main() -> None:
    """Train ``--steps`` GRPO steps and write the timings (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompt strings (chat template applied)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--beta", type=float, default=0.001)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16=True (torch.autocast; its default), else float32")
    a = p.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)

    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation, ref and policy passes, update)."""

        def __init__(self):
            self.seconds: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._t0)

    prompts = json.loads(Path(a.prompts).read_text())
    per_step = a.rows // a.group_size
    data = Dataset.from_list([{"prompt": prompts[i % len(prompts)]} for i in range(per_step * (a.steps + 1))])
    config = trl.GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(a.out)), "trl_out"),
        per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.rows // a.micro_batch,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens, beta=a.beta,
        learning_rate=a.lr, max_steps=a.steps, num_iterations=1, temperature=1.0, use_vllm=False,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**6, disable_tqdm=True,
        seed=0, shuffle_dataset=False, bf16=a.bf16,
        # GRPOConfig turns activation checkpointing on by default; the project's default is off
        # (model.enable_gradient_checkpointing), so matched work means off here too.
        gradient_checkpointing=False,
    )
    timer = StepTimer()
    with PeakRSS(os.getpid()) as rss:
        tokenizer = AutoTokenizer.from_pretrained(a.model)
        trainer = trl.GRPOTrainer(model=a.model, reward_funcs=format_reward, args=config, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    Path(a.out).write_text(json.dumps({
        "step_seconds": timer.seconds, "peak_rss_bytes": rss.peak_bytes,
        "peak_pss_bytes": rss.peak_pss_bytes, "processes": rss.peak_processes,
        "mean_load_1m": rss.mean_load,
        "trl": trl.__version__, "threads": __import__("torch").get_num_threads(),
        "n_params": sum(t.numel() for t in trainer.model.parameters()),
    }, indent=2))


if __name__ == "__main__":
    main()
