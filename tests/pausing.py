"""Fault tests kill a run inside a named call: the run's processes are held there by ``pause_point/sitecustomize.py``.

:func:`pause_env` is the environment of a run that holds its first process to make the N-th call of a function;
:func:`held_pid` waits until a process is held and returns its pid.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

PAUSE_POINT = Path(__file__).resolve().parent / "pause_point"


def pause_env(target: str, marker: Path, pythonpath: tuple[Path, ...] = (), base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with the run held at ``target`` (``module:qualname@N``)
    and ``marker`` as the file the held process writes its pid to; ``pythonpath`` goes before the pause point."""
    env = dict(os.environ if base is None else base)
    env["AGENT_TRAINER_TEST_PAUSE"], env["AGENT_TRAINER_TEST_PAUSE_FILE"] = target, str(marker)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*pythonpath, PAUSE_POINT))
    return env


def held_pid(marker: Path, proc: subprocess.Popen, describe=lambda: "", timeout_s: float = 900) -> int:
    """The pid of the process held at the pause point once one is; ``proc`` (the run's driver) must stay alive
    meanwhile (``describe()`` says why it did not: the run's last output)."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, f"the run ended before it reached the pause point: {describe()}"
        assert time.monotonic() < deadline, f"no process reached the pause point within {timeout_s} s"
        time.sleep(0.05)
    return int(marker.read_text())
