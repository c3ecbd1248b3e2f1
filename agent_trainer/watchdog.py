"""Watchdog of a local run: when the driver dies, even by SIGKILL, every Ray process it started dies too.

Ray shares the fate of gcs and raylet with the driver that started them, but after a hard kill
of the driver its dashboard and runtime-env agents, and worker subprocesses such as vLLM's
engine core, linger for a minute or more (the agents first try to report the raylet's death to
the dead GCS). ``python -m agent_trainer.watchdog <driver pid>`` runs in its own session, notes
every process of the Ray cluster the driver started (its direct children whose command line
names Ray, and all of their descendants), and once the driver is gone kills those still alive.
It never touches a process that is not below one of those Ray processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict

import psutil

POLL_S = 0.5


def is_ray_process(cmdline: list[str]) -> bool:
    """A process Ray started: its program or script lies in Ray's package (``.../ray/...``), or a ``ray::`` title."""
    head = cmdline[:2]
    return any(f"{os.sep}ray{os.sep}" in part for part in head) or bool(head and head[0].startswith("ray::"))


def ray_processes(driver: psutil.Process) -> list[psutil.Process]:
    """The driver's Ray processes (gcs, raylet, dashboard, ...) and all of their descendants.

    One pass over the process table per call (``psutil.Process.children`` reads all of it once per process
    asked, which cost a run's watchdog about 4% of a core with a dozen Ray processes).
    """
    children: dict[int, list[psutil.Process]] = defaultdict(list)
    for proc in psutil.process_iter(["ppid"]):
        children[proc.info["ppid"]].append(proc)
    found = []
    for child in children.get(driver.pid, []):
        try:
            if not is_ray_process(child.cmdline()):
                continue
        except psutil.Error:
            continue
        below = [child]
        while below:
            proc = below.pop()
            found.append(proc)
            below += children.get(proc.pid, [])
    return found


def watch(driver_pid: int, seen_file: str | None = None) -> int:
    """Follow the driver until it exits, then kill what is left of its Ray cluster; returns how many.

    ``seen_file``: written once the watchdog has noted at least one Ray process (a test waits for it
    instead of guessing how long a loaded machine takes to start this process)."""
    try:
        driver = psutil.Process(driver_pid)
    except psutil.Error:
        return 0
    known: dict[int, psutil.Process] = {}
    while True:
        try:
            if not driver.is_running() or driver.status() == psutil.STATUS_ZOMBIE:
                break
            for proc in ray_processes(driver):
                known.setdefault(proc.pid, proc)
            if seen_file and known:
                with open(seen_file, "w") as fh:
                    fh.write(" ".join(str(pid) for pid in sorted(known)))
                seen_file = None
            if known and not any(p.is_running() for p in known.values()):
                return 0  # the driver ended its cluster (ray.shutdown) and lives on: nothing left to guard
        except psutil.Error:
            break
        time.sleep(POLL_S)
    killed = 0
    for proc in known.values():
        try:
            if proc.is_running() and proc.pid != os.getpid():  # is_running also checks the pid was not reused
                proc.kill()
                killed += 1
        except psutil.Error:
            continue
    return killed


def start(driver_pid: int | None = None, seen_file: str | None = None) -> subprocess.Popen:
    """Start the watchdog of this (or ``driver_pid``'s) local Ray cluster in its own session."""
    return subprocess.Popen([sys.executable, "-m", "agent_trainer.watchdog", str(driver_pid or os.getpid()),
                             *([seen_file] if seen_file else [])],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
