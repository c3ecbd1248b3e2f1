"""Metric sinks (console, JSONL, TensorBoard, wandb, Ray metrics), the phase timer, and the run's outputs.

Metric names carry their group as a prefix: ``rollout/``, ``env/<tag>/``,
``actor/``, ``critic/``, ``timing_s/``, ``perf/``, ``val/``. The console gets one
aligned line per step (:func:`format_metrics`); JSONL, TensorBoard and wandb get every
metric; a running Ray cluster gets the live gauges of ``agent_trainer.observe.metrics_export``.
With a config, :meth:`Tracking.record_step` also writes trajectory samples
(``agent_trainer.observe.trajectories``) and :meth:`Tracking.close` the learning curves
(``agent_trainer.observe.viewer.plots``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from agent_trainer.common.checkpoint import truncate_metrics
from agent_trainer.config.splits import Split
from agent_trainer.observe.metrics_export import RayMetrics, rollout_rates
from agent_trainer.observe.trajectories import write_step
from agent_trainer.observe.viewer.plots import write_curves

if TYPE_CHECKING:
    from agent_trainer.common.batch import TensorBatch
    from agent_trainer.config import AgentTrainerConfig
    from agent_trainer.rollout import RolloutResult

logger = logging.getLogger(__name__)

WANDB_RUN_FILE = "wandb_run.json"
"""In the run directory: the wandb run id, so a resumed run continues the same wandb run."""


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

    def __init__(self, run_dir: str | Path, loggers: list[str], resume_step: int = 0,
                 cfg: AgentTrainerConfig | None = None, tokenizer=None):
        """Open the sinks; ``resume_step`` > 0 continues a run whose steps up to it are logged.

        On resume, JSONL lines of later steps (logged by the killed run after its last
        checkpoint) are dropped, and TensorBoard purges its events after ``resume_step``,
        so no step appears twice. ``cfg`` and ``tokenizer`` (the RL trainer's) turn on the
        wandb run's name and config, trajectory samples and the total step count on the console.
        """
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = list(loggers)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._tb = None
        self.rewind(resume_step)
        self._wandb = self._open_wandb() if "wandb" in self.loggers else None
        self._ray_metrics = None
        self.validity = ValidityWatch(cfg.envs_file if cfg is not None else "",
                                      cfg.trainer.total_training_steps if cfg is not None else None)

    def rewind(self, step: int) -> None:
        """Forget what was logged after ``step``: the steps a resumed or restarted run trains again.

        JSONL lines of later steps are dropped and TensorBoard is reopened with ``purge_step``,
        so no step appears twice (wandb's resumed run overwrites by step itself).
        """
        if step:
            truncate_metrics(self.jsonl_path, step)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            if self._tb is not None:
                self._tb.close()
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=step + 1 if step else None)

    def _open_wandb(self):
        """Start (or, with the id in ``wandb_run.json``, continue) the run's wandb run."""
        import dataclasses

        import wandb

        id_file = self.run_dir / WANDB_RUN_FILE
        run_id = json.loads(id_file.read_text())["id"] if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(json.dumps({"id": run_id}))
        trainer = self.cfg.trainer if self.cfg is not None else None
        return wandb.init(project=trainer.project_name if trainer else "agent_trainer",
                          name=trainer.experiment_name if trainer else self.run_dir.name, id=run_id, resume="allow",
                          dir=str(self.run_dir), config=dataclasses.asdict(self.cfg) if self.cfg else None)

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
        """Write one step's metrics to every sink (and warn once when the first steps' actions are mostly invalid)."""
        warning = self.validity.observe(step, metrics)
        if warning:
            logger.warning(warning)
        if "jsonl" in self.loggers:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if "console" in self.loggers:
            total = self.cfg.trainer.total_training_steps if self.cfg is not None else None
            tqdm.write(format_metrics(metrics, step, total))
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        self._export_to_ray(metrics, step)

    def _export_to_ray(self, metrics: dict[str, float], step: int) -> None:
        """Set the run's live Ray gauges (once Ray is up; the SFT trainer and unit tests have none)."""
        import ray

        if not ray.is_initialized():
            return
        if self._ray_metrics is None:
            name = self.cfg.trainer.experiment_name if self.cfg is not None else self.run_dir.name
            self._ray_metrics = RayMetrics(name)
        self._ray_metrics.export(metrics, step)

    def record_step(self, step: int, result: RolloutResult, batch: TensorBatch, metrics: dict[str, float]) -> None:
        """After a training step: add per-tag rewards and throughput to ``metrics``; write trajectories when due.

        Due every ``trainer.log_trajectories_freq`` steps and at the last step (0: never).
        """
        metrics.update(rollout_rates(result, metrics))
        trainer = self.cfg.trainer if self.cfg is not None else None
        freq = trainer.log_trajectories_freq if trainer else 0
        if freq > 0 and (step % freq == 0 or step == trainer.total_training_steps):
            with timer("trajectories", metrics):
                write_step(self.run_dir, step, Split.TRAIN, result.states, batch, self.tokenizer,
                           trainer.log_trajectories_per_tag, fallback=result.batch, judge=result.judge)

    def close(self) -> None:
        """Flush and close the sinks; draw the learning curves of ``metrics.jsonl`` into ``plots/``."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self.cfg is not None and self.jsonl_path.exists():
            write_curves(self.jsonl_path, self.run_dir / "plots")


CONSOLE_COLUMNS = (
    ("rollout/success_rate", "succ", "{:5.3f}"), ("rollout/episode_reward_mean", "rew", "{:+6.3f}"),
    ("rollout/valid_action_rate", "valid", "{:4.2f}"),
    ("rollout/num_turns_mean", "turns", "{:3.1f}"), ("rollout/num_calls_mean", "calls", "{:3.1f}"),
    ("rollout/gateway_merged", "merged", "{:3.0f}"), ("rollout/gateway_stepwise", "stepwise", "{:3.0f}"),
    ("rollout/format_error_rate", "fmt_err", "{:4.2f}"),
    ("rollout/in_flight_episodes", "inflight", "{:3.0f}"), ("rollout/versions_in_batch", "vers", "{:2.0f}"),
    ("rollout/set_aside_groups", "aside", "{:3.0f}"),
    ("actor/pg_loss", "pg", "{:+8.1e}"), ("actor/ppo_kl", "ppo_kl", "{:+8.1e}"),
    ("actor/grad_norm", "grad", "{:6.3g}"),
    ("critic/vf_loss", "vf", "{:6.3g}"), ("sft/loss", "sft_loss", "{:6.4f}"), ("sft/token_acc", "tok_acc", "{:5.3f}"),
    ("val/sft_loss", "val_loss", "{:6.4f}"), ("val/success_rate", "val_succ", "{:5.3f}"),
    ("timing_s/step", "s", "{:5.1f}"),
)
"""The console line's columns: metric, label, fixed-width format (the full set goes to JSONL/TensorBoard/wandb).
docs/operations.md, "Console and logs", says what each one is."""


def format_metrics(metrics: dict[str, float], step: int, total_steps: int | None = None) -> str:
    """One aligned console line with the headline metrics present (all of them go to JSONL)."""
    width = len(str(total_steps)) if total_steps else 3
    head = f"step {step:>{width}}" + (f"/{total_steps}" if total_steps else "")
    parts = [head] + [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in CONSOLE_COLUMNS if key in metrics]
    return "  ".join(parts)


SHIPPED_ENVS_FILE = Path(__file__).resolve().parents[1] / "config" / "envs.yaml"

LOW_VALIDITY = 0.1
"""A valid-action rate (``rollout/valid_action_rate``) under this in each of the run's first steps is warned about."""
LOW_VALIDITY_STEPS = 3
"""How many first steps (fewer when the run is shorter) must all stay under :data:`LOW_VALIDITY` for the warning."""


class ValidityWatch:
    """The one warning of a run whose actions are mostly invalid from the start: steps 1 to
    :data:`LOW_VALIDITY_STEPS` (or to the last step of a shorter run) all under :data:`LOW_VALIDITY`. Its likely
    cause is a model that does not know the env's words (its action names, the answer format), which RL cannot
    teach: ``make model ENVS=`` builds one that does (docs/writing_an_environment.md)."""

    def __init__(self, envs_file: str = "", total_steps: int | None = None):
        self.envs_file = envs_file
        self.steps = min(LOW_VALIDITY_STEPS, total_steps or LOW_VALIDITY_STEPS)
        self.low: list[float] = []
        self.done = False

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning's text at the step that completes the low streak; None otherwise (and once it was given,
        a step was valid enough, or a step came after the first ones, as in a resumed run)."""
        rate = metrics.get("rollout/valid_action_rate")
        if self.done or rate is None:
            return None
        if rate >= LOW_VALIDITY or step != len(self.low) + 1:
            self.done = True
            return None
        self.low.append(rate)
        if len(self.low) < self.steps:
            return None
        self.done = True
        tags = sorted(key.split("/")[1] for key, value in metrics.items()
                      if key.startswith("env/") and key.endswith("/action_is_valid") and value < LOW_VALIDITY)
        users = self.envs_file and Path(self.envs_file).resolve() != SHIPPED_ENVS_FILE
        envs = f"make model ENVS={Path(self.envs_file).resolve()}" if users else "make model ENVS=/abs/path/my_envs.yaml"
        return (f"the valid-action rate stayed under {LOW_VALIDITY} for the first {len(self.low)} step(s) "
                f"({', '.join(f'{r:.2f}' for r in self.low)}; tags {tags}): the model most likely does not know the "
                f"env's words (its action names, the <answer> format), and RL cannot teach them. Build a model whose "
                f"corpus holds the env ({envs} in the repository, ENVS_MODEL=<folder> to name it) and train with "
                "model_path=<that folder> (docs/writing_an_environment.md, \"Build a model that knows it\")")
