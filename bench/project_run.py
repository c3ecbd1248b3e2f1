"""Run the project's trainer (``agent_trainer.main``) for a few steps and collect what the bench needs.

One run = one subprocess with its own local Ray cluster, so runs never share warm
caches. Returned: the per-step metrics (``metrics.jsonl``), the steady-state median
of every phase (steps 2..N), the peak RSS of the whole process tree (driver, GCS,
raylet, every Ray worker) and, on request, the trajectory sample of the last step.
``code_dir`` runs another checkout (a ``git worktree`` of an earlier commit) with the
same interpreter: its directory goes first on ``PYTHONPATH``, which Ray's workers inherit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from results import steady_median
from rss import PeakRSS

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "log_prob", "ref", "values", "adv", "update_critic", "update_actor", "wait_prefetch", "sync",
          "step")
"""``wait_prefetch``: trainer.max_off_policy_steps 1 only (the wait for the next step's rollout); 0 otherwise."""


@dataclass
class RunSpec:
    """What to train: a config name, overrides, steps, and which checkout."""

    label: str
    config: str = "frozenlake"
    overrides: list[str] = field(default_factory=list)
    steps: int = 4
    code_dir: Path = REPO
    keep_trajectories: bool = False
    """Log every episode of the last step (P2 reuses the prompts)."""
    every_step: bool = False
    """With ``keep_trajectories``: log every step's episodes, not only the last's (P1 replays steps 2..N)."""
    save_last: bool = False
    """Save a checkpoint at the last step (its size goes to ``RunResult.checkpoint_bytes``)."""


@dataclass
class RunResult:
    """Steady-state numbers of one run (medians over steps 2..N)."""

    label: str
    command: str
    steps: int
    phases: dict[str, float]
    generated_tokens: float
    total_tokens: float
    peak_rss_bytes: int
    peak_pss_bytes: int
    """Peak of the tree's summed PSS: shared pages counted once (bench/rss.py)."""
    peak_processes: int
    peak_rss_by_kind: dict[str, list[int]]
    """At the RSS peak: process kind (driver, ActorWorker, VLLMRolloutWorker, dashboard, ...) -> [processes, RSS
    bytes, PSS bytes]."""
    wall_seconds: float
    mean_load_1m: float | None
    """The machine's mean 1-minute load average during the run (2 cores: above 2 means queued work)."""
    step_seconds: list[float]
    history: list[dict[str, float]]
    """Every training step's metrics, in order (``history[k]`` is step k + 1)."""
    trajectories: dict[int, list[dict]] = field(default_factory=dict)
    """Step -> its logged episodes (the last step's, or every step's with ``RunSpec.every_step``)."""
    checkpoint_bytes: dict[str, int] = field(default_factory=dict)
    """With ``RunSpec.save_last``: bytes on disk of the last checkpoint, in all and per part (``actor``,
    ``actor/shards``, ``critic``, ...)."""

    @property
    def last_episodes(self) -> list[dict]:
        """The episodes of the last logged step."""
        return self.trajectories[max(self.trajectories)]

    def to_json(self) -> dict:
        """Everything but the trajectories and per-step metrics (large)."""
        out = asdict(self)
        out.pop("trajectories")
        out.pop("history")
        return out


def command(spec: RunSpec, run_dir: str) -> list[str]:
    """The trainer's command line for ``spec``, writing to ``run_dir``."""
    cmd = [sys.executable, "-m", "agent_trainer.main", "--config-name", spec.config,
           f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={spec.steps}",
           "trainer.test_freq=0", "trainer.progress_bar=false", f"trainer.save_freq={spec.steps if spec.save_last else -1}"]
    if spec.keep_trajectories:  # written at the last step only, or at every step
        cmd += [f"trainer.log_trajectories_freq={1 if spec.every_step else spec.steps}",
                "trainer.log_trajectories_per_tag=1000"]
    else:
        cmd += ["trainer.log_trajectories_freq=0"]
    return cmd + list(spec.overrides)


def run(spec: RunSpec, log_dir: Path) -> RunResult:
    """Train ``spec`` in a subprocess; raise with the log's tail when it fails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.label}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(spec.code_dir), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="bench-run-") as run_dir:
        cmd = command(spec, run_dir)
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=spec.code_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
            with PeakRSS(proc.pid) as rss:
                code = proc.wait()
        wall = time.perf_counter() - start
        if code != 0:
            raise RuntimeError(f"{spec.label}: trainer exited {code}; log {log_path}:\n{log_tail(log_path)}")
        history = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        saved = checkpoint_sizes(Path(run_dir) / f"global_step_{spec.steps}") if spec.save_last else {}
        trajectories = {}
        if spec.keep_trajectories:
            for step in range(1 if spec.every_step else spec.steps, spec.steps + 1):
                sample = Path(run_dir) / "trajectories" / f"step_{step}.jsonl"
                trajectories[step] = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    shown = " ".join(c if c != sys.executable else "python" for c in cmd)
    result = summarize(spec, history, shown, rss, wall, trajectories)
    result.checkpoint_bytes = saved
    return result


def checkpoint_sizes(folder: Path) -> dict[str, int]:
    """Bytes of a checkpoint folder: ``total``, each top-level part and each part's sub-folders."""
    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    sizes = {"total": size(folder)}
    for part in sorted(p for p in folder.iterdir() if p.is_dir()):
        sizes[part.name] = size(part)
        sizes.update({f"{part.name}/{sub.name}": size(sub) for sub in sorted(part.iterdir()) if sub.is_dir()})
    return sizes


def log_tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log, for an error message."""
    return "\n".join(path.read_text().splitlines()[-lines:])


def summarize(spec: RunSpec, history: list[dict], cmd: str, rss: PeakRSS, wall: float,
              trajectories: dict[int, list[dict]]) -> RunResult:
    """Medians over steps 2..N of every phase and of the token counts."""
    train = [h for h in history if "timing_s/step" in h]
    phases = {p: steady_median([h.get(f"timing_s/{p}", 0.0) for h in train]) for p in PHASES}
    return RunResult(
        label=spec.label, command=cmd, steps=len(train), phases=phases,
        generated_tokens=steady_median([h["perf/generated_tokens"] for h in train]),
        total_tokens=steady_median([h["perf/total_tokens"] for h in train]),
        peak_rss_bytes=rss.peak_bytes, peak_pss_bytes=rss.peak_pss_bytes, peak_processes=rss.peak_processes,
        peak_rss_by_kind=rss.peak_by_kind,
        wall_seconds=wall,
        mean_load_1m=rss.mean_load,
        step_seconds=[h["timing_s/step"] for h in train], history=train, trajectories=trajectories,
    )
