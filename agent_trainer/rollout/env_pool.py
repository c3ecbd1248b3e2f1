"""The env actors of one rollout split: start them, call them with a deadline, replace a stuck one.

Each actor (``agent_trainer.workers.env_worker.EnvWorker``, an ``EnvStateManager`` in a Ray actor) hosts a
shard of whole groups of episodes and is named ``env_<split>_<shard>`` in the run's Ray
namespace. A call goes to several actors at once and waits with ``ray.wait(timeout=...)``,
so one hung environment never blocks the others:

- an actor that dies or raises is reported in :attr:`EnvCall.failed` (Ray restarts it,
  ``max_restarts``), its episodes end where they are; the next call to it waits for the restart;
- an actor that misses the deadline is killed and a fresh one with the same name and shard is
  started (:meth:`EnvActorPool.replace`); it is reported in :attr:`EnvCall.timed_out`. The
  fresh actor's episodes are reset by the next rollout.

With ``max_concurrency`` > 1 (``rollout.mode=async``) each actor is a threaded Ray actor:
calls for different episodes of one actor run at once, and a timeout seen by several of
them replaces the actor once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorAlreadyExistsError, ActorUnavailableError, RayActorError, RayTaskError

from agent_trainer.episode.es_manager import EpisodeSpec

logger = logging.getLogger(__name__)

NAME_RELEASE_TIMEOUT_S = 30.0
"""How long a replacement waits for Ray to release the killed actor's name."""
START_TIMEOUT_S = 120.0
"""How long a call waits for its actors to finish starting (process, imports, envs built) before its own deadline
(``es_manager.env_*_timeout_s``) begins: that deadline measures the call, not a process start on a busy machine."""


@dataclass
class EnvCall:
    """What one call to several env actors gave: the outputs, and which actors (by index) failed."""

    results: list = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    """Actors that died or raised."""
    timed_out: list[int] = field(default_factory=list)
    """Actors that missed the deadline (killed and replaced by fresh ones)."""
    errors: dict[int, str] = field(default_factory=dict)
    """Per failed or timed-out actor: what happened, for error messages."""


@dataclass
class PendingCall:
    """A call :meth:`EnvActorPool.submit` started: collect it with :meth:`EnvActorPool.collect`."""

    method: str
    called: dict
    """Actor index -> the handle called (a replacement later gets a new handle)."""
    refs: dict
    """Actor index -> the call's object ref."""
    timeout_s: float
    deadline: float
    """``time.monotonic()`` past which an unfinished actor has missed the deadline."""


class EnvActorPool:
    """``len(shards)`` env actors; actor i hosts the episodes ``shards[i]``."""

    def __init__(self, env_worker_cls, name: str, shards: list[list[EpisodeSpec]], actor_kwargs: dict,
                 max_concurrency: int = 1):
        self.env_worker_cls = env_worker_cls
        self.pool_name = name
        """The split, or the label of a further rollout of it (``train-2``): names the actors."""
        self.shards = shards
        self.actor_kwargs = actor_kwargs
        self.max_concurrency = max(1, int(max_concurrency))
        """Calls one actor runs at once (1: Ray's default, one call after the other)."""
        self._replace_lock = threading.Lock()
        self._killed_for_timeout: list = []
        """Handles killed after a timeout: a concurrent call that dies with one timed out too."""
        self.actors = [self._start(i) for i in range(len(shards))]
        self._started: set[int] = set()
        """Actors known to have started (:meth:`_wait_started`); a replacement starts anew."""
        self.replaced = 0
        """Actors replaced after a timeout, over the pool's life."""

    def name(self, index: int) -> str:
        """The Ray name of actor ``index`` (``env_train_0``, ``env_val_1``, ``env_train-2_0``, ...)."""
        return f"env_{self.pool_name}_{index}"

    def _start(self, index: int):
        """Start actor ``index``; waits up to NAME_RELEASE_TIMEOUT_S while an ended actor still holds its name
        (a replaced actor, or the last pool of the same split in this namespace, killed moments ago)."""
        options = dict(name=self.name(index))
        if self.max_concurrency > 1:
            options["max_concurrency"] = self.max_concurrency
        deadline = time.monotonic() + NAME_RELEASE_TIMEOUT_S
        while True:
            try:
                return self.env_worker_cls.options(**options).remote(episodes=self.shards[index], **self.actor_kwargs)
            except ActorAlreadyExistsError:  # the name is released once Ray has marked the ended actor dead
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def call(self, method: str, args_by_index: dict[int, object], timeout_s: float) -> EnvCall:
        """Call ``method`` on the given actors at once (arg None: no argument); wait at most ``timeout_s``."""
        return self.collect(self.submit(method, args_by_index, timeout_s))

    def submit(self, method: str, args_by_index: dict[int, object], timeout_s: float) -> PendingCall:
        """Start the call without waiting for it; :meth:`collect` waits until ``timeout_s`` after now."""
        self._wait_started(list(args_by_index))
        called = {i: self.actors[i] for i in args_by_index}
        refs = {i: (getattr(called[i], method).remote() if arg is None
                    else getattr(called[i], method).remote(arg)) for i, arg in args_by_index.items()}
        return PendingCall(method, called, refs, timeout_s, time.monotonic() + timeout_s)

    def collect(self, pending: PendingCall) -> EnvCall:
        """Wait for a submitted call until its deadline; replace the actors that missed it."""
        method, called, refs = pending.method, pending.called, pending.refs
        timeout_s = pending.timeout_s
        remaining = max(0.0, pending.deadline - time.monotonic())
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=remaining)
        ready_set = set(ready)
        call = EnvCall()
        for i, ref in refs.items():
            if ref not in ready_set:
                call.timed_out.append(i)
                call.errors[i] = f"env actor {self.name(i)} did not finish {method} within {timeout_s:g} s"
                continue
            try:
                call.results.extend(ray.get(ref))
            except (RayActorError, RayTaskError, ActorUnavailableError) as err:
                if any(handle is called[i] for handle in self._killed_for_timeout):
                    call.timed_out.append(i)  # another call's timeout killed it (max_concurrency > 1)
                    call.errors[i] = f"env actor {self.name(i)} was replaced after a timeout during {method}"
                    continue
                call.failed.append(i)
                call.errors[i] = f"env actor {self.name(i)} failed in {method}: {err}"
                if isinstance(err, RayActorError):  # died: Ray restarts it, the next call waits for that
                    self._started.discard(i)
        for i in call.timed_out:
            logger.error("%s; killing it and starting a fresh one for its episodes (es_manager.env_%s_timeout_s)",
                         call.errors[i], "reset" if method == "reset" else "step")
            self.replace(i, called[i])
        for i in call.failed:
            logger.error("%s", call.errors[i])
        return call

    def _wait_started(self, indices: list[int]) -> None:
        """Wait at most START_TIMEOUT_S for the given actors' first start, their start after a replacement, or
        Ray's restart of one that died; one still starting then gets the call anyway, and its deadline."""
        waiting = [i for i in indices if i not in self._started]
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            pending = {self.actors[i].__ray_ready__.remote(): i for i in waiting}
            ready, _ = ray.wait(list(pending), num_returns=len(pending),
                                timeout=max(0.0, deadline - time.monotonic()))
            waiting = []
            for ref in ready:
                try:
                    ray.get(ref)
                except ActorUnavailableError:  # Ray is restarting it: ask again
                    waiting.append(pending[ref])
                    continue
                except RayActorError:  # dead for good: the call reports it
                    pass
                self._started.add(pending[ref])
            if waiting and time.monotonic() < deadline:
                time.sleep(0.5)
            elif waiting:
                break

    def replace(self, index: int, stuck=None) -> None:
        """Kill actor ``index`` (stuck: its process is ended) and start a fresh one with its name and shard.

        ``stuck`` is the handle that missed its deadline: when another caller already replaced
        it (concurrent calls, ``max_concurrency`` > 1), the fresh actor is kept.
        """
        with self._replace_lock:
            if stuck is None or self.actors[index] is stuck:
                self._killed_for_timeout.append(self.actors[index])
                self._replace(index)

    def _replace(self, index: int) -> None:
        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._start(index)
        self._started.discard(index)
        self.replaced += 1
