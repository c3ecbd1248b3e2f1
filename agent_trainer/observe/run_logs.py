"""Worker logs go to ``<run dir>/logs/workers.log``; each distinct warning reaches the console once.

Ray writes every worker's stdout and stderr (vLLM's, transformers', torch's) to
``worker-*.out``/``.err`` files in its session's log folder. The driver starts Ray with
``log_to_driver=False`` and :class:`WorkerLogRouter` tails those files instead: every line
is appended to ``workers.log`` (prefixed with the worker's file), and a line that is a
warning or an error is printed on the console the first time its text (digits, pids and
timestamps aside) is seen. So vLLM's per-step INFO lines ("Reloading and processing
weights", "Successfully reset prefix cache") stay in the file, and its per-step warning
("RotaryEmbedding: Failed to load weights") stays there too (:data:`QUIET`).

:data:`QUIET` is the one table of third-party start-up warnings that say nothing to a user of this project
(vLLM's, torch's notes on choices the project makes on purpose, or on speed-ups a CPU run does not need): they
go to ``workers.log`` like every line but never to the console. A line that names an error, or a traceback,
is never quiet; the project's own messages match none of the patterns.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

ANSI = re.compile(r"\x1b\[[0-9;]*m")
MATTERS = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b|Traceback|^\w*(Error|Exception):|\[W\d{4}")
"""A line the console shows (once): a logged warning or error, a traceback, torch's C++ warnings."""


@dataclass(frozen=True)
class QuietWarning:
    """A third-party worker warning kept in ``workers.log`` and off the console."""

    source: str
    """The ``file.py:`` it is logged from (vLLM's ``[file.py:N]``, torch's ``[W... file.cpp:N]``), so another
    file's line never matches."""
    text: str
    """A fixed part of its text."""
    reason: str
    """Why it says nothing to a user of this project (one line)."""

    def matches(self, line: str) -> bool:
        return self.text in line and re.search(rf"(?:^|[\[ \t]){re.escape(self.source)}\d+\b", line) is not None


QUIET = (
    QuietWarning("arg_utils.py:", "The global random seed is set to",
                 "the engine is seeded from trainer.seed on purpose, in a Ray worker process of its own"),
    QuietWarning("arg_utils.py:", "does not officially support disabling chunked prefill",
                 "per-request seeds need whole-prompt prefill on CPU, so the engine turns it off "
                 "(agent_trainer/workers/rollout.py)"),
    QuietWarning("vllm.py:", "Enforce eager set, disabling torch.compile",
                 "eager mode is the project's choice for the CPU engine (no compile time per start)"),
    QuietWarning("vllm.py:", "Inductor compilation was disabled by user settings",
                 "follows from eager mode, above"),
    QuietWarning("cpu.py:", "Triton is not installed",
                 "triton-cpu only speeds up some CPU kernels; the engine runs without it"),
    QuietWarning("cpu.py:", "Reset SSM cache type to float32",
                 "about Mamba-style models' cache; the project's models have none"),
    QuietWarning("vllm.py:", "Model Runner V2 requires Triton",
                 "vLLM picks its V1 model runner, which is the one the project is tested with"),
    QuietWarning("cpu_worker.py:", "is not found in LD_PRELOAD",
                 "libtcmalloc / libiomp preloading is a CPU speed-up, not needed to run (vLLM's CPU install docs)"),
    QuietWarning("utils.cpp:", "NUMA binding: Using MEMBIND policy",
                 "torch reports where it binds the engine's memory; nothing to act on"),
    QuietWarning("cpu_worker.py:", "doesn't allow to use `torch.set_num_threads` after the thread binding",
                 "vLLM keeps its own thread binding; nothing to act on"),
    QuietWarning("layerwise.py:", "RotaryEmbedding: Failed to load weights",
                 "at every weight sync: rotary tables are computed, never loaded, so there is nothing to load"),
    QuietWarning("authentication_token_setup.py:", "Token authentication is enabled for this Ray cluster",
                 "Ray's, in the driver at ray.init; the run's dashboard line says how to sign in with the token"),
)
"""The warnings kept off the console (each still in ``workers.log``): vLLM's and torch's start-up notes of a
CPU run, vLLM's per-sync rotary line, and Ray's token line in the driver (:class:`QuietDriverLines`)."""
NEVER_QUIET = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b|Traceback|^\w*(Error|Exception):")
"""A line like this reaches the console whatever :data:`QUIET` says."""


def is_quiet(line: str) -> bool:
    """``line`` is one of the :data:`QUIET` warnings (and names no error)."""
    return not NEVER_QUIET.search(line.strip()) and any(q.matches(line) for q in QUIET)


_VARYING = re.compile(r"0x[0-9a-f]+|\d+")


def dedup_key(line: str) -> str:
    """The line without what changes between repeats: numbers (times, pids, sizes) and addresses."""
    return _VARYING.sub("#", line.strip())


class WorkerLogRouter:
    """Tails a Ray session's worker logs into one file; echoes each distinct warning once (none of :data:`QUIET`)."""

    def __init__(self, session_logs: Path, out_file: Path, echo: Callable[[str], None] = tqdm.write,
                 interval_s: float = 1.0):
        self.session_logs = Path(session_logs)
        self.out_file = Path(out_file)
        self.out_file.parent.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.interval_s = interval_s
        self.offsets: dict[Path, int] = {}
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="worker-log-router", daemon=True)

    def start(self) -> WorkerLogRouter:
        """Start the tailing thread; a final pass runs at exit."""
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stop the thread after one last pass over the files."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """Read what every worker log gained since the last pass."""
        with self._lock:
            files = sorted(self.session_logs.glob("worker-*.out")) + sorted(self.session_logs.glob("worker-*.err"))
            try:
                out = self.out_file.open("a", encoding="utf-8")
            except OSError:  # the run directory is gone (removed after the run): nothing left to route to
                self._stop.set()
                return
            with out:
                for path in files:
                    for line in self._new_lines(path):
                        out.write(f"[{path.name}] {line}\n")
                        self._maybe_echo(line)

    def _new_lines(self, path: Path) -> list[str]:
        """Complete lines added to ``path`` since the last read."""
        try:
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offsets[path] = self.offsets.get(path, 0) + end
        text = ANSI.sub("", data[:end].decode("utf-8", errors="replace"))
        return [line for line in text.splitlines() if line.strip() and not line.startswith(":job_id:")]

    def _maybe_echo(self, line: str) -> None:
        if MATTERS.search(line) and not is_quiet(line):
            key = dedup_key(line)
            if key not in self.seen:
                self.seen.add(key)
                self.echo(f"(worker) {line.strip()}")


class QuietDriverLines(logging.Filter):
    """On the driver's handlers of a third-party logger (Ray's): holds its :data:`QUIET` lines back from the
    console; :func:`route_worker_logs` writes them into ``workers.log`` (prefixed ``[driver]``)."""

    def __init__(self):
        super().__init__()
        self.held: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        line = f"{record.levelname} {record.filename}:{record.lineno} -- {record.getMessage()}"
        if record.levelno >= logging.ERROR or not is_quiet(line):
            return True
        self.held.append(line)
        return False


DRIVER_FILTER = QuietDriverLines()
"""The one filter of this process (:func:`quiet_driver_loggers`)."""
DRIVER_LOGGERS = ("ray",)
"""Third-party loggers with handlers of their own in the driver (Ray's does not propagate to the root logger)."""


def quiet_driver_loggers() -> None:
    """Put :data:`DRIVER_FILTER` on the handlers of :data:`DRIVER_LOGGERS` (once; call after importing them)."""
    for name in DRIVER_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if DRIVER_FILTER not in handler.filters:
                handler.addFilter(DRIVER_FILTER)


def route_worker_logs(run_dir: str | Path) -> WorkerLogRouter | None:
    """Start routing this Ray session's worker logs into ``<run_dir>/logs/workers.log`` (needs ``ray.init``); the
    driver's quiet lines held so far go there first.

    Returns None when the session's log folder is not on this machine.
    """
    from ray._private import worker

    out_file = Path(run_dir) / "logs" / "workers.log"
    if DRIVER_FILTER.held:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        with out_file.open("a", encoding="utf-8") as out:
            out.write("".join(f"[driver] {line}\n" for line in DRIVER_FILTER.held))
        DRIVER_FILTER.held.clear()
    node = worker._global_node
    logs = Path(node.get_logs_dir_path()) if node is not None else None
    if logs is None or not logs.is_dir():
        return None
    return WorkerLogRouter(logs, out_file).start()
