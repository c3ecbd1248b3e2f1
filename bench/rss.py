"""Peak resident memory (RSS and PSS) of a whole process tree, sampled in a background thread (psutil).

Used on both sides of the P5 comparison: around the trainer's subprocess (the
driver plus Ray's GCS, raylet and every worker, which all descend from it) and
inside the TRL script (its own process and any children).
"""

from __future__ import annotations

import os
import statistics
import threading

import psutil


def process_kind(name: str, cmdline: str) -> str:
    """What a process of the tree is, from its title: Ray workers by actor class, Ray's own daemons by name."""
    if name.startswith("ray::") or cmdline.startswith("ray::"):
        title = name if name.startswith("ray::") else cmdline.split()[0]
        return title[len("ray::"):].split(".")[0] or "ray worker"
    if name.startswith("ray-dashboard") or "dashboard/dashboard.py" in cmdline:
        return "dashboard"
    for marker, kind in (("agent_trainer.main", "driver"), ("log_monitor", "log_monitor"), ("monitor.py", "monitor"),
                         ("gcs_server", "gcs_server"), ("raylet", "raylet")):
        if marker in cmdline or marker == name:
            return kind
    return name


def tree_memory(pid: int, by_kind: dict[str, list[int]] | None = None) -> tuple[int, int, int]:
    """(summed RSS, summed PSS, number of processes) of ``pid`` and all its descendants, in bytes.

    RSS counts a page shared by several processes (torch's libraries, a forkserver's children) once
    per process; PSS (Linux's proportional set size) splits it among them, so the PSS sum is the
    physical memory the tree occupies (RSS where the OS gives no PSS). ``by_kind``, when given, is
    filled with kind -> [processes, RSS bytes, PSS bytes] (:func:`process_kind`).
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0
    total = total_pss = count = 0
    for proc in procs:
        try:
            mem = proc.memory_full_info()
            pss = getattr(mem, "pss", mem.rss)
            if by_kind is not None:
                entry = by_kind.setdefault(process_kind(proc.name(), " ".join(proc.cmdline())), [0, 0, 0])
                entry[0] += 1
                entry[1] += mem.rss
                entry[2] += pss
            total += mem.rss
            total_pss += pss
            count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total, total_pss, count


class PeakRSS:
    """Context manager sampling :func:`tree_memory` every ``interval`` seconds; keeps the peak.

    Also samples the machine's 1-minute load average, so every measurement says how busy the
    (shared) machine was while it ran.
    """

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.peak_bytes = self.peak_pss_bytes = self.peak_processes = 0
        self.peak_by_kind: dict[str, list[int]] = {}
        """At the sample with the largest RSS total: process kind -> [processes, RSS bytes, PSS bytes]."""
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            by_kind: dict[str, list[int]] = {}
            rss, pss, count = tree_memory(self.pid, by_kind)
            if rss > self.peak_bytes:
                self.peak_by_kind = by_kind
            self.peak_bytes = max(self.peak_bytes, rss)
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
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
