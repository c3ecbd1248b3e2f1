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


def tree_memory(pid: int, by_kind: dict[str, list[int]] | None = None, with_pss: bool = True) -> tuple[int, int, int]:
    """(summed RSS, summed PSS, number of processes) of ``pid`` and all its descendants, in bytes.

    RSS counts a page shared by several processes (torch's libraries, a forkserver's children) once
    per process; PSS (Linux's proportional set size) splits it among them, so the PSS sum is the
    physical memory the tree occupies (RSS where the OS gives no PSS). PSS costs the kernel a walk of
    every mapping (about 70 ms of CPU for the main job's 27 processes, against 0.2 ms for RSS), so
    ``with_pss=False`` skips it and returns 0 for it. ``by_kind``, when given, is filled with
    kind -> [processes, RSS bytes, PSS bytes] (:func:`process_kind`).
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0
    total = total_pss = count = 0
    for proc in procs:
        try:
            mem = proc.memory_full_info() if with_pss else proc.memory_info()
            pss = getattr(mem, "pss", mem.rss) if with_pss else 0
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
    """Context manager sampling :func:`tree_memory` in a thread; keeps the peaks.

    RSS every ``interval`` seconds; PSS and the split by process kind every ``pss_every``-th sample
    (2 s by default): at 0.25 s the PSS walk alone took 28% of a core of the 2 the measured run has.
    Training memory sits on plateaus of several seconds, which a 2 s sample finds. Also samples the
    machine's 1-minute load average, so every measurement says how busy the (shared) machine was.
    """

    def __init__(self, pid: int, interval: float = 0.25, pss_every: int = 8):
        self.pid, self.interval, self.pss_every = pid, interval, max(1, pss_every)
        self.peak_bytes = self.peak_pss_bytes = self.peak_processes = 0
        self.peak_by_kind: dict[str, list[int]] = {}
        """At the PSS sample with the largest RSS total: process kind -> [processes, RSS bytes, PSS bytes]."""
        self._peak_pss_sample_rss = 0
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sample = 0
        while not self._stop.is_set():
            full = sample % self.pss_every == 0
            by_kind: dict[str, list[int]] | None = {} if full else None
            rss, pss, count = tree_memory(self.pid, by_kind, with_pss=full)
            if full and rss >= self._peak_pss_sample_rss:
                self._peak_pss_sample_rss, self.peak_by_kind = rss, by_kind
            self.peak_bytes = max(self.peak_bytes, rss)
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            self.peak_processes = max(self.peak_processes, count)
            sample += 1
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
