"""Metric sinks (console, JSONL, TensorBoard) and the phase timer.

Metric names carry their group as a prefix: ``rollout/``, ``env/<tag>/``,
``actor/``, ``critic/``, ``timing_s/``, ``perf/``, ``val/``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from agent_trainer.checkpoint import truncate_metrics


@contextmanager
def timer(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to ``metrics['timing_s/<name>']``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


class Tracking:
    """Fans one ``log(metrics, step)`` call out to the configured sinks."""

    def __init__(self, run_dir: str | Path, loggers: list[str], resume_step: int = 0):
        """Open the sinks; ``resume_step`` > 0 continues a run whose steps up to it are logged.

        On resume, JSONL lines of later steps (logged by the killed run after its last
        checkpoint) are dropped, and TensorBoard purges its events after ``resume_step``,
        so no step appears twice.
        """
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = list(loggers)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        if resume_step:
            truncate_metrics(self.jsonl_path, resume_step)
        self._tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                     purge_step=resume_step + 1 if resume_step else None)

    def logged_steps(self) -> set[int]:
        """Steps present in the JSONL file."""
        if not self.jsonl_path.exists():
            return set()
        return {json.loads(line)["step"] for line in self.jsonl_path.read_text().splitlines() if line.strip()}

    def ensure_logged(self, metrics: dict[str, float], step: int) -> None:
        """Log ``step`` unless the JSONL file has it already (a resumed run's last saved step)."""
        if "jsonl" in self.loggers and step not in self.logged_steps():
            self.log(metrics, step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write one step's metrics to every sink."""
        if "jsonl" in self.loggers:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if "console" in self.loggers:
            tqdm.write(format_metrics(metrics, step))
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the sinks."""
        if self._tb is not None:
            self._tb.close()


_CONSOLE_KEYS = (
    "rollout/success_rate", "rollout/episode_reward_mean", "rollout/num_turns_mean", "rollout/format_error_rate",
    "rollout/response_length_mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
    "critic/vf_loss", "sft/loss", "sft/token_acc", "val/sft_loss", "val/success_rate", "val/episode_reward_mean",
    "timing_s/step",
)


def format_metrics(metrics: dict[str, float], step: int) -> str:
    """One console line with the headline metrics (all of them go to JSONL)."""
    parts = [f"step {step}"]
    for key in _CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{key}={metrics[key]:.4g}")
    return " | ".join(parts)
