"""How a run stops: signals on the driver, dead workers, and tearing every worker down.

* SIGINT/SIGTERM (:class:`StopSignal`): the first one asks the fit loop to stop at the next step
  boundary (saving a checkpoint first with ``trainer.save_on_signal``); a second one raises
  :class:`Interrupted` at once. Either way the driver kills every worker, ends Ray and exits
  ``128 + signal`` (130 for SIGINT, 143 for SIGTERM).
* A worker that dies mid-call raises ``agent_trainer.workers.worker_group.WorkerDied`` (or Ray's
  ``RayActorError`` where a call is not made through a group); :func:`describe_death` names the
  worker either way.

Heavy imports stay out: this module only needs Ray.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Iterable

import ray
from ray.exceptions import GetTimeoutError

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The driver was told to stop by a signal; a BaseException so no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.signum


class WorkerLost(RuntimeError):
    """A worker died and ``trainer.max_restarts`` restarts are used up; the message names it and Ray's cause."""


class StopSignal:
    """Catches SIGINT/SIGTERM while the run is in the ``with`` block; restores the old handlers on exit.

    The first signal only sets :attr:`signum` (the fit loop stops at the next step boundary);
    a second raises :class:`Interrupted` in the main thread wherever it is. Outside the main
    thread (signals cannot be caught there) it does nothing and :attr:`signum` stays None.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        logger.warning("%s received: stopping after the current step (a second signal stops at once)",
                       signal.Signals(signum).name)


def describe_death(err: BaseException, named: dict[str, Iterable]) -> str:
    """One line naming the worker of a ``RayActorError`` (``named``: worker name -> its actor handles)."""
    dead = getattr(err, "actor_id", None)
    who = "a worker"
    for name, handles in named.items():
        for handle in handles:
            if dead is not None and handle._actor_id.hex() == dead:
                who = name
    text = " ".join(str(err).split())
    cut = text.rfind(". ", 0, 600) if len(text) > 600 else -1
    return f"{who} died: {text[:cut + 1] if cut > 0 else text[:600]}"


def kill_actors(handles: Iterable, wait_s: float = 30.0) -> None:
    """Kill Ray actors at once (no restart) and wait until Ray reports them dead, so their names are free."""
    handles = list(handles)
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception as err:  # noqa: BLE001 - an actor that is already gone is what we want
            logger.debug("ray.kill(%s): %s", handle, err)
    deadline = time.monotonic() + wait_s
    for handle in handles:
        while time.monotonic() < deadline:
            try:
                ray.get(handle.__ray_ready__.remote(), timeout=1.0)
            except GetTimeoutError:
                continue  # busy or being killed: ask again
            except Exception:  # noqa: BLE001 - RayActorError (or any error): it no longer answers
                break
            time.sleep(0.2)  # still answering: the kill has not landed yet
