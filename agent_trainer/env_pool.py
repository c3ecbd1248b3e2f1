"""The env actors of one rollout split: start them, call them with a deadline, replace a stuck one.

Each actor (``workers.env_worker.EnvWorker``, an ``EnvStateManager`` in a Ray actor) hosts a
shard of whole groups of episodes and is named ``env_<split>_<shard>`` in the run's Ray
namespace. A call goes to several actors at once and waits with ``ray.wait(timeout=...)``,
so one hung environment never blocks the others:

- an actor that dies or raises is reported in :attr:`EnvCall.failed` (Ray restarts it,
  ``max_restarts``), its episodes end where they are;
- an actor that misses the deadline is killed and a fresh one with the same name and shard is
  started (:meth:`EnvActorPool.replace`); it is reported in :attr:`EnvCall.timed_out`. The
  fresh actor's episodes are reset by the next rollout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from agent_trainer.es_manager import EpisodeSpec

logger = logging.getLogger(__name__)

NAME_RELEASE_TIMEOUT_S = 30.0
"""How long a replacement waits for Ray to release the killed actor's name."""


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


class EnvActorPool:
    """``len(shards)`` env actors; actor i hosts the episodes ``shards[i]``."""

    def __init__(self, env_worker_cls, split: str, shards: list[list[EpisodeSpec]], actor_kwargs: dict):
        self.env_worker_cls = env_worker_cls
        self.split = split
        self.shards = shards
        self.actor_kwargs = actor_kwargs
        self.actors = [self._start(i) for i in range(len(shards))]
        self.replaced = 0
        """Actors replaced after a timeout, over the pool's life."""

    def name(self, index: int) -> str:
        """The Ray name of actor ``index`` (``env_train_0``, ``env_val_1``, ...)."""
        return f"env_{self.split}_{index}"

    def _start(self, index: int):
        return self.env_worker_cls.options(name=self.name(index)).remote(
            episodes=self.shards[index], **self.actor_kwargs)

    def call(self, method: str, args_by_index: dict[int, object], timeout_s: float) -> EnvCall:
        """Call ``method`` on the given actors at once (arg None: no argument); wait at most ``timeout_s``."""
        refs = {i: (getattr(self.actors[i], method).remote() if arg is None
                    else getattr(self.actors[i], method).remote(arg)) for i, arg in args_by_index.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
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
                call.failed.append(i)
                call.errors[i] = f"env actor {self.name(i)} failed in {method}: {err}"
        for i in call.timed_out:
            logger.error("%s; killing it and starting a fresh one for its episodes (es_manager.env_%s_timeout_s)",
                         call.errors[i], "reset" if method == "reset" else "step")
            self.replace(i)
        for i in call.failed:
            logger.error("%s", call.errors[i])
        return call

    def replace(self, index: int) -> None:
        """Kill actor ``index`` (stuck: its process is ended) and start a fresh one with its name and shard."""
        ray.kill(self.actors[index], no_restart=True)
        deadline = time.monotonic() + NAME_RELEASE_TIMEOUT_S
        while True:
            try:
                self.actors[index] = self._start(index)
                break
            except ValueError:  # the name is released once Ray has marked the killed actor dead
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.replaced += 1
