"""Exact resume through the real command line: kill -9 a run mid-save, start the same command, compare.

Run A trains 3 steps uninterrupted. Run B, started beside it, is the same command in another folder; it is
SIGKILLed (its whole process group: driver and the Ray cluster it started) while it writes
step 2's checkpoint, after step 1's is complete. Starting the same command again resumes at
step 2 from global_step_1 and must end where A ended.

Tolerance: exact equality. On CPU every phase is deterministic given its inputs: the engine
samples from a seed that is a pure function of (trainer.seed, step, turn), the environments
are seeded by (es_manager.seed, reset count), FSDP2's gloo all-reduce sums in a fixed order,
one torch thread per worker, and the checkpoint restores weights, Adam moments, the LR
schedule, RNG states and env seed counters bit for bit (each rank's shards in safetensors, JSON). B runs
with ``trainer.save_hf_model=false``: it resumes from the shards alone, and its final weights, exported
with ``python -m agent_trainer.export``, are A's Hugging Face weights. Only wall-clock
metrics (``timing_s/*`` and the ``*_per_s`` rates) may differ, and ``rollout/reset_prefetched``:
a resumed run's first step resets its envs itself, from the same seeds, where A's took the reset
prefetched during step 1 (``es_manager.prefetch_reset``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pausing import held_pid, pause_env
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
WALL_CLOCK_PREFIX, WALL_CLOCK_SUFFIX = "timing_s/", "_per_s"
"""Metrics measured in wall-clock time (phase seconds, tokens/s, env steps/s): they may differ."""
PREFETCHED = "rollout/reset_prefetched"
"""How a step's reset ran, not what it computed: compared on its own."""


def _command(model_path: str, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake",
            f"model_path={model_path}", f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.test_freq=0",
            "trainer.progress_bar=false", "agent_proxy.max_turn=2",
            "es_manager.train.env_groups=2", "es_manager.train.group_size=4",
            "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]", "es_manager.train.env_configs.n_groups=[1,1]",
            "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.response_length=16", "actor_rollout_ref.actor.optim.lr=1e-3", *overrides]


def _start(cmd: list[str], log: Path, own_session: bool = False, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` (a run and the local cluster it starts), its output to ``log``; ``own_session``: in a
    session of its own, so ``os.killpg`` reaches every process of it."""
    with log.open("w") as sink:
        return subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=own_session,
                                env=env)


def _finish(proc: subprocess.Popen, log: Path) -> str:
    """Wait for a run started by :func:`_start`; its output."""
    assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    return log.read_text()


def _kill_during_save(cmd: list[str], run_dir: Path, step: int) -> None:
    """Start ``cmd`` in its own session; SIGKILL the session during step ``step``'s save.

    The driver is held (``tests/pause_point``) in the save's last act, the rename of the finished
    ``.tmp_global_step_<step>`` into place: every part is written, none is committed. The runs save every step,
    so the ``step``-th commit is step ``step``'s. (A poll for the folder missed saves that took a few
    milliseconds on a fast machine.)"""
    log = run_dir.parent / f"{run_dir.name}.killed.log"
    marker = run_dir.parent / f"{run_dir.name}.held"
    proc = _start(cmd, log, own_session=True,
                  env=pause_env(f"agent_trainer.common.checkpoint:commit_save@{step}", marker))
    assert held_pid(marker, proc, lambda: log.read_text()[-3000:]) == proc.pid  # the driver commits
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    # the kill landed mid-save: the partial folder is there, the step's checkpoint is not
    assert (run_dir / f".tmp_global_step_{step}").exists() and not (run_dir / f"global_step_{step}").exists()


def _beside_a_kill_b_and_resume(command_a: list[str], command_b: list[str], run_b: Path, tmp_path: Path,
                                after_kill=lambda: None) -> str:
    """Run A uninterrupted beside B; SIGKILL B mid-save of step 2 (step 1's checkpoint complete), call
    ``after_kill()``, start B's command again; wait for both. Returns the resumed run's output."""
    proc_a = _start(command_a, tmp_path / "a.log")
    try:
        _kill_during_save(command_b, run_b, step=2)
        assert (run_b / "latest_checkpointed_iteration.txt").read_text() == "1"
        after_kill()
        resumed_log = tmp_path / "b.resumed.log"
        resumed = _finish(_start(command_b, resumed_log), resumed_log)
        _finish(proc_a, tmp_path / "a.log")
    finally:
        if proc_a.poll() is None:
            proc_a.kill()
    return resumed


def _metrics(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in lines]
    assert steps == sorted(set(steps)), f"duplicate or unordered steps: {steps}"
    exact = {k for m in lines for k in m
             if not (k.startswith(WALL_CLOCK_PREFIX) or k.endswith(WALL_CLOCK_SUFFIX) or k == PREFETCHED)}
    return {m["step"]: {k: v for k, v in m.items() if k in exact} for m in lines}


def test_sigkill_mid_save_then_resume_equals_the_uninterrupted_run(tiny_model_path, tmp_path):
    """A runs beside B and B's resumed run (each run is deterministic whatever else shares the cores)."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"

    def b_saved_only_shards() -> None:
        for part in ("actor", "critic"):  # B saves only the ranks' shards: a resume needs no HF weights
            assert (run_b / "global_step_1" / part / "shards" / "index.json").is_file()
            assert not list((run_b / "global_step_1" / part).glob("model*.safetensors"))

    resumed = _beside_a_kill_b_and_resume(_command(tiny_model_path, run_a),
                                          _command(tiny_model_path, run_b, "trainer.save_hf_model=false"), run_b,
                                          tmp_path, after_kill=b_saved_only_shards)
    assert f"resumed from {run_b / 'global_step_1'}" in resumed
    assert not list(run_b.glob(".tmp_*"))

    a, b = _metrics(run_a), _metrics(run_b)
    prefetched = {name: [json.loads(line)[PREFETCHED] for line in (run / "metrics.jsonl").read_text().splitlines()]
                  for name, run in (("a", run_a), ("b", run_b))}
    assert prefetched == {"a": [0.0, 1.0, 1.0], "b": [0.0, 0.0, 1.0]}  # B's step 2: the resumed run's first
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in (2, 3):
        assert a[step] == b[step], {k: (a[step][k], b[step].get(k)) for k in a[step] if a[step][k] != b[step].get(k)}
    for part in ("actor", "critic"):  # A's HF weights (trainer.save_hf_model) and B's exported from its shards
        exported = tmp_path / f"b_{part}"
        export = subprocess.run([sys.executable, "-m", "agent_trainer.export", str(run_b / "global_step_3"),
                                 "--part", part, "--out", str(exported)], cwd=REPO, capture_output=True, text=True,
                                timeout=300)
        assert export.returncode == 0, export.stderr
        final_a = load_file(str(run_a / "global_step_3" / part / "model.safetensors"))
        final_b = load_file(str(exported / "model.safetensors"))
        assert final_a.keys() == final_b.keys()
        assert all((final_a[k] == final_b[k]).all() for k in final_a), part
        shards = sorted(p.name for p in (run_a / "global_step_3" / part / "shards").glob("*.safetensors"))
        assert shards == [f"{kind}-rank0000{r}-of-00002.safetensors" for kind in ("model", "optim") for r in (0, 1)]
        for name in shards:  # each rank's weights, Adam moments and steps
            shard_a = load_file(str(run_a / "global_step_3" / part / "shards" / name))
            shard_b = load_file(str(run_b / "global_step_3" / part / "shards" / name))
            assert shard_a.keys() == shard_b.keys() and all((shard_a[k] == shard_b[k]).all() for k in shard_a), name
    state = json.loads((run_b / "global_step_3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["env_resets"]["train"] == 3
