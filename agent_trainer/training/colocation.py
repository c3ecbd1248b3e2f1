"""Engines and FSDP ranks taking turns on the same GPUs (``actor_rollout_ref.hybrid_engine``).

verl's hybrid engine, written out as one small state machine the fit loop drives. The engines start awake
and the actor's state on its GPU; then, per training step::

    rollout                                       engines awake (weights + KV cache), actor offloaded
    to_training():  engines sleep(level=1)        weights to CPU RAM, KV cache freed
                    actor reload_to_device()      parameters / optimizer state back (fsdp.*_offload)
    log_prob, ref, values, update                 the GPU is the trainer's
    to_rollout(sync):
                    engines wake_up(["weights"])  weights back, no KV cache yet
                    sync()                        the actor's new weights into them
                    actor offload_to_cpu()        (fsdp.param_offload / optimizer_offload)
                    engines wake_up(["kv_cache"]) the memory the actor gave up
    validate / the next rollout

A checkpoint is saved inside :meth:`ColocatedMemory.training` (the actor's state on its device, the engines
asleep). Sleep mode exists only on GPUs (vLLM has none on CPU; the config refuses it there), so on CPU every call
here is skipped by construction (``sleep`` and ``offload`` false), not by engines that ignore them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray

ROLLOUT, TRAINING = "rollout", "training"


class ColocatedMemory:
    """Moves the GPU between the engines (``rollout``) and the FSDP ranks (``training``); see the module docstring.

    ``engines``: Ray handles with ``sleep(level)`` and ``wake_up(tags)``; ``actor``: the actor's worker group
    (``execute_all("offload_to_cpu")`` / ``execute_all("reload_to_device")``). ``sleep``: the engines were created
    with sleep mode; ``offload``: the actor offloads its parameters or optimizer state while the engines run.
    """

    def __init__(self, engines: list, actor: Any, *, sleep: bool, offload: bool) -> None:
        self.engines, self.actor = engines, actor
        self.sleep, self.offload = sleep, offload
        self.state = ROLLOUT
        """The engines are created awake, the actor on its device."""
        self.actor_offloaded = False

    @property
    def active(self) -> bool:
        """Whether any call is made at all (a CPU run, or GPUs without colocation: never)."""
        return self.sleep or self.offload

    def to_training(self) -> None:
        """After a rollout: the engines sleep, the actor's state comes back to its device."""
        if self.state == TRAINING:
            return
        if self.sleep:
            ray.get([e.sleep.remote(1) for e in self.engines])
        if self.actor_offloaded:
            self.actor.execute_all("reload_to_device")
            self.actor_offloaded = False
        self.state = TRAINING

    def to_rollout(self, sync: Callable[[], Any] | None = None) -> Any:
        """Before the next rollout: wake the weights, ``sync()`` (returns its result), offload the actor, wake the
        KV cache. Without ``sync`` the weights the engines slept with come back (level 1 keeps them in CPU RAM)."""
        waking = self.sleep and self.state == TRAINING
        if waking:
            ray.get([e.wake_up.remote(["weights"]) for e in self.engines])
        result = sync() if sync is not None else None
        if self.offload and not self.actor_offloaded:
            self.actor.execute_all("offload_to_cpu")
            self.actor_offloaded = True
        if waking:
            ray.get([e.wake_up.remote(["kv_cache"]) for e in self.engines])
        self.state = ROLLOUT
        return result

    def resync(self, sync: Callable[[], Any]) -> Any:
        """A restarted engine needs the weights mid-rollout: the actor comes back for the gather, then goes again."""
        if not self.actor_offloaded:
            return sync()
        self.actor.execute_all("reload_to_device")
        try:
            return sync()
        finally:
            self.actor.execute_all("offload_to_cpu")

    @contextmanager
    def training(self) -> Iterator[None]:
        """The actor's state on its device for a while (a checkpoint), then back to where the loop was."""
        state = self.state
        self.to_training()
        try:
            yield
        finally:
            if state == ROLLOUT:
                self.to_rollout()
