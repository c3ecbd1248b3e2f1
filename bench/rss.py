"""Peak resident memory of a whole process tree, sampled in a background thread (psutil).

Used on both sides of the P5 comparison: around the trainer's subprocess (the
driver plus Ray's GCS, raylet and every worker, which all descend from it) and
inside the TRL script (its own process and any children).
"""

from __future__ import annotations

import os
import statistics
import threading

import psutil


def tree_rss(pid: int) -> tuple[int, int]:
    """(summed RSS in bytes, number of processes) of ``pid`` and all its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = count = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
            count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total, count


class PeakRSS:
    """Context manager sampling :func:`tree_rss` every ``interval`` seconds; keeps the peak.

    Also samples the machine's 1-minute load average, so every measurement says how busy the
    (shared) machine was while it ran.
    """

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.peak_bytes = self.peak_processes = 0
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, count = tree_rss(self.pid)
            self.peak_bytes = max(self.peak_bytes, rss)
            self.peak_processes = max(self.peak_processes, count)
            self.loads.append(os.getloadavg()[0])
            self._stop.wait(self.interval)

    @property
    def mean_load(self) -> float | None:
        """Mean 1-minute load average over the samples (None before the first)."""
        return statistics.mean(self.loads) if self.loads else None

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
