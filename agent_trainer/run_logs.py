"""Worker logs go to ``<run dir>/logs/workers.log``; each distinct warning reaches the console once.

Ray writes every worker's stdout and stderr (vLLM's, transformers', torch's) to
``worker-*.out``/``.err`` files in its session's log folder. The driver starts Ray with
``log_to_driver=False`` and :class:`WorkerLogRouter` tails those files instead: every line
is appended to ``workers.log`` (prefixed with the worker's file), and a line that is a
warning or an error is printed on the console the first time its text (digits, pids and
timestamps aside) is seen. So vLLM's per-step INFO lines ("Reloading and processing
weights", "Successfully reset prefix cache") stay in the file, and its per-step warning
("RotaryEmbedding: Failed to load weights") is shown once.
"""

from __future__ import annotations

import atexit
import re
import threading
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

ANSI = re.compile(r"\x1b\[[0-9;]*m")
MATTERS = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b|Traceback|^\w*(Error|Exception):|\[W\d{4}")
"""A line the console shows (once): a logged warning or error, a traceback, torch's C++ warnings."""
_VARYING = re.compile(r"0x[0-9a-f]+|\d+")


def dedup_key(line: str) -> str:
    """The line without what changes between repeats: numbers (times, pids, sizes) and addresses."""
    return _VARYING.sub("#", line.strip())


class WorkerLogRouter:
    """Tails a Ray session's worker logs into one file; echoes each distinct warning once."""

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
        if MATTERS.search(line):
            key = dedup_key(line)
            if key not in self.seen:
                self.seen.add(key)
                self.echo(f"(worker) {line.strip()}")


def route_worker_logs(run_dir: str | Path) -> WorkerLogRouter | None:
    """Start routing this Ray session's worker logs into ``<run_dir>/logs/workers.log`` (needs ``ray.init``).

    Returns None when the session's log folder is not on this machine.
    """
    from ray._private import worker

    node = worker._global_node
    logs = Path(node.get_logs_dir_path()) if node is not None else None
    if logs is None or not logs.is_dir():
        return None
    return WorkerLogRouter(logs, Path(run_dir) / "logs" / "workers.log").start()
