"""Hold one process of a run inside a named call, so a fault test kills it exactly there (tests only).

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one. A test puts
this folder on a run's ``PYTHONPATH``; the driver passes ``PYTHONPATH`` on to every Ray worker
(``ray_cluster.worker_pythonpath``), so the file is imported by the driver and by each worker. Without
``AGENT_TRAINER_TEST_PAUSE`` it does nothing.

``AGENT_TRAINER_TEST_PAUSE="module:qualname@N"`` (say ``agent_trainer.workers.actor:ActorWorker.update_actor@3``)
wraps that function when its module is first imported. The first process of the run to make its N-th call
links ``AGENT_TRAINER_TEST_PAUSE_FILE`` into place, holding its pid (a link is created whole or not at all, and
only once: one process of a run is held, once, even when a restarted worker counts its calls from 1 again). It then
sleeps inside the call while that file exists: the call's process title stays Ray's ``ray::Class.method``, and
SIGTERM and SIGKILL act on it as on any busy worker. The test reads the pid and kills the process, or the run,
at that point; deleting the file lets the call go on. A poll of the file system could miss a call that lasts a
few milliseconds on a fast machine; this cannot.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import time

SPEC = os.environ.get("AGENT_TRAINER_TEST_PAUSE", "")
MARKER = os.environ.get("AGENT_TRAINER_TEST_PAUSE_FILE", "")
HOLD_S = 900.0


def _claim() -> bool:
    """Create the marker holding this pid, atomically; False when another process (or call) already did."""
    tmp = f"{MARKER}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    try:
        os.link(tmp, MARKER)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _pausing(fn, nth: int):
    calls = 0

    @functools.wraps(fn)
    def held(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth and _claim():
            deadline = time.monotonic() + HOLD_S
            while os.path.exists(MARKER) and time.monotonic() < deadline:
                time.sleep(0.05)
        return fn(*args, **kwargs)

    return held


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds the target module with the other finders, then wraps the function once the module has run."""

    def __init__(self, module: str, qualname: str, nth: int):
        self.module, self.qualname, self.nth = module, qualname, nth

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)  # the real finders locate it; the module is imported once, so this is final
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            *owner_path, attr = self.qualname.split(".")
            owner = module
            for part in owner_path:
                owner = getattr(owner, part)
            setattr(owner, attr, _pausing(getattr(owner, attr), self.nth))

        spec.loader.exec_module = exec_module
        return spec


if SPEC and MARKER:
    _target, _, _nth = SPEC.rpartition("@")
    _module, _, _qualname = _target.partition(":")
    sys.meta_path.insert(0, _WrapOnImport(_module, _qualname, int(_nth)))
