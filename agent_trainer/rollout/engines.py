"""The rollout engines, called from the turn loops: one turn's prompts fanned out over the engines
(:func:`generate`), an engine that dies or stalls restarted and the turn generated once more; the engine calls of
several rollouts in flight sent together (:class:`EngineCalls`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from agent_trainer.rollout.splits import SamplingParams
from agent_trainer.workers.weight_sync import synced_tag
from agent_trainer.workers.worker_group import wait_until_ready

logger = logging.getLogger(__name__)


def generate(engines: list, prompts: list[list[int]], sampling: SamplingParams, seed: int, timeout_s: float,
             on_engine_restart: Callable[[], object] | None, on_failure: Callable[[], object],
             budgets: list[int] | None = None,
             prompt_seeds: list[int] | None = None) -> list[tuple[list[int], list[float]]]:
    """Split prompts across the engines, generate, keep the order.

    ``budgets[k]`` is prompt k's max new tokens (``sampling.max_tokens`` for all when
    None). Each engine gets one call per distinct budget; call j of engine i samples
    with ``seed + i + j * len(engines)``, so with one budget engine i samples with ``seed + i``.

    An engine that dies mid-turn is restarted by Ray (``max_restarts``) from the
    checkpoint on disk; one that misses ``timeout_s`` (``rollout.generate_timeout_s``) is killed and
    restarted the same way. One that died and was restarted between two turns answers with the weights it
    started from (its :meth:`~agent_trainer.workers.engines.base.RolloutEngine.weights_tag` is not the last
    sync's): its outputs are dropped. ``on_failure`` counts each, ``on_engine_restart`` re-syncs the policy
    weights and the turn is generated once more. A second failure raises.

    ``prompt_seeds`` (one per prompt) seeds each request instead (vLLM only): a prompt then
    samples the same tokens whichever prompts share its call (``rollout.mode=async``).
    """
    budgets = budgets or [sampling.max_tokens] * len(prompts)
    calls = []  # (engine, prompt indices, sampling, seed)
    for j, budget in enumerate(sorted(set(budgets))):
        same_budget = [k for k, b in enumerate(budgets) if b == budget]
        for i, chunk in enumerate(np.array_split(same_budget, len(engines))):
            if len(chunk):
                calls.append((engines[i], chunk.tolist(), dataclasses.replace(sampling, max_tokens=budget),
                              seed + i + j * len(engines)))
    for attempt in range(2):
        tags = _ask_weights_tags([c[0] for c in calls])  # before the calls: an engine answers them in order
        refs = [engine.generate.remote([prompts[k] for k in chunk], **vars(params), seed=call_seed,
                                       **({} if prompt_seeds is None else
                                          dict(seeds=[prompt_seeds[k] for k in chunk])))
                for engine, chunk, params, call_seed in calls]
        try:
            outputs = get_or_kill(refs, [c[0] for c in calls], timeout_s)
            _check_weights_tags(tags)
            break
        except (RayActorError, ActorUnavailableError, GetTimeoutError, StaleEngine) as err:
            if attempt == 1 or on_engine_restart is None:
                raise
            on_failure()
            logger.error("rollout engine failed (%s); re-syncing weights into its restart and retrying", err)
            wait_until_ready(engines)
            on_engine_restart()
    results: list = [None] * len(prompts)
    for (_, chunk, _, _), chunk_outputs in zip(calls, outputs):
        for k, out in zip(chunk, chunk_outputs):
            results[k] = (list(out.token_ids), list(out.logprobs))
    return results


class StaleEngine(RuntimeError):
    """An engine answered with weights other than the last sync's: Ray restarted it between two turns."""


def _ask_weights_tags(engines: list) -> list[tuple[object, str, object]]:
    """(engine, the tag its last sync left, the engine's answer) for every engine this process has synced."""
    asked, out = set(), []
    for engine in engines:
        expected = synced_tag(engine)
        if expected is not None and id(engine) not in asked:
            asked.add(id(engine))
            out.append((engine, expected, engine.weights_tag.remote()))
    return out


def _check_weights_tags(tags: list[tuple[object, str, object]]) -> None:
    """Raise :class:`StaleEngine` when an engine held other weights than the last sync's while it generated."""
    answers = ray.get([ref for _, _, ref in tags])
    stale = [i for i, ((_, expected, _), got) in enumerate(zip(tags, answers)) if got != expected]
    if stale:
        raise StaleEngine(f"{len(stale)} rollout engine(s) were restarted by Ray since the last weight sync and "
                          "generated from the checkpoint they started from")


def get_or_kill(refs: list, engines: list, timeout_s: float) -> list:
    """``ray.get(refs)`` within ``timeout_s``; on a timeout, kill the engines still busy (Ray restarts them)."""
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        stuck = {id(engines[refs.index(r)]): engines[refs.index(r)] for r in pending}
        for engine in stuck.values():
            ray.kill(engine, no_restart=False)
        raise GetTimeoutError(f"{len(stuck)} rollout engine(s) did not finish a turn within {timeout_s:g} s "
                              "(actor_rollout_ref.rollout.generate_timeout_s); killed them for a restart")
    return ray.get(refs)


def engine_ids(owner) -> list:
    """The engines a rollout generates on, by Ray actor id (handles of one actor may be distinct objects)."""
    return [getattr(e, "_actor_id", None) or id(e) for e in getattr(owner, "engines", [])]


@dataclass(eq=False)
class WaitingCall:
    """One rollout's engine call waiting for the engines (:meth:`EngineCalls.call`)."""

    owner: object
    """The rollout asking: requests of different owners may share a call."""
    prompts: list[list[int]]
    sampling: SamplingParams
    seed: int
    budgets: list[int]
    """Each prompt's max new tokens."""
    prompt_seeds: list[int] | None
    """Each prompt's own seed; None (one seed for the call) never shares a call: sharing would change its draws."""
    outputs: list | None = None
    error: BaseException | None = None
    done: bool = False
    shared: bool = False
    """Sent in one call with another rollout's request."""

    def joins(self, other: WaitingCall) -> bool:
        """Whether this request may go in ``other``'s call: both seeded per prompt, sampled alike (but for the
        per-prompt budgets) and for the same engines."""
        alike = dataclasses.replace(self.sampling, max_tokens=0) == dataclasses.replace(other.sampling, max_tokens=0)
        return (self.prompt_seeds is not None and other.prompt_seeds is not None and alike
                and engine_ids(self.owner) == engine_ids(other.owner))


@dataclass(frozen=True)
class GatherRule:
    """How long the leader of an engine call waits for other requests to join it (:meth:`EngineCalls._gather`).

    It never waits once every asker it expects has a request waiting."""

    max_s: float = 0.05
    """At most this long (and this long for the first call, whose time is not known yet)."""
    call_fraction: float = 0.25
    """... and at most this share of the last calls' time (smoothed); 0: :attr:`max_s` alone."""
    quiet_s: float | None = None
    """... and no longer once no request has arrived for this long (None: not used)."""

    def deadline(self, start: float, call_s: float) -> float:
        return start + (min(self.max_s, call_s * self.call_fraction) if self.call_fraction and call_s
                        else self.max_s)


@dataclass(eq=False)
class EngineCalls:
    """The engines as their askers share them: one call at a time (:attr:`lock`), and the requests that wait for
    the engines meanwhile sent together in one call. The askers are the rollouts in flight
    (``trainer.rollouts_in_flight``) on the run's engines, and a gateway rollout's sessions
    (``agent_trainer.rollout.gateway.EngineBatcher``, with a rule of its own).

    The first waiting request to take the lock leads: it takes every waiting request that joins it
    (:attr:`joins`), sends them in one call and hands each its outputs. An asker whose call just ended takes a
    moment to step its replies and ask again, so the leader waits for the others' requests by :attr:`rule` (for
    rollouts: up to a quarter of the last calls' time, at most 50 ms, which the first call waits), and no longer
    once every expected asker (:attr:`expected`, default the rollouts playing) has a request waiting.
    Rollouts' prompts keep their own seeds, so a prompt samples the same tokens whichever requests share its call."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    """Held around each engine call and the weight sync before it: a sync finds no call in flight, and the version
    read after a call is the one that generated it."""
    share: bool = True
    """False: each call carries the leader's request alone (``trainer.share_engine_calls=false``)."""
    rule: GatherRule = GatherRule()
    joins: Callable[[WaitingCall, WaitingCall], bool] = WaitingCall.joins
    """(a waiting request, the leader) -> whether it may go in the leader's call (the rollouts': seeded per prompt,
    sampled alike, the same engines)."""
    expected: Callable[[], int] | None = None
    """How many askers may have a request waiting now (None: :attr:`playing`)."""
    playing: int = 0
    """Rollouts playing now (:meth:`play`)."""
    _waiting: list[WaitingCall] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _call_s: float = 0.0
    """The last call's duration (smoothed)."""
    _last_arrival: float = 0.0

    @contextmanager
    def play(self) -> Iterator[None]:
        """Around a rollout's turns: while it plays, a leader may wait for its requests."""
        with self._changed:
            self.playing += 1
        try:
            yield
        finally:
            with self._changed:
                self.playing -= 1
                self._changed.notify_all()

    def wake(self) -> None:
        """The expected askers changed (an asker ended): a leader waiting for their requests looks again."""
        with self._changed:
            self._changed.notify_all()

    def call(self, request: WaitingCall, send: Callable[[list[WaitingCall]], list]) -> list:
        """``request``'s outputs, from a call that ``send`` makes for it and the requests that joined it (each
        request's outputs in order, or an exception for that request alone), or from another request's call that it
        joined. ``send``'s error is raised in every request of its call."""
        with self._changed:
            self._waiting.append(request)
            self._last_arrival = time.perf_counter()
            self._changed.notify_all()
        with self.lock:
            if not request.done:
                batch = self._gather(request)
                start = time.perf_counter()
                try:
                    for req, outputs in zip(batch, send(batch), strict=True):
                        if isinstance(outputs, BaseException):
                            req.error = outputs
                        else:
                            req.outputs = outputs
                except BaseException as err:  # noqa: BLE001 - raised again in every request's own thread
                    for req in batch:
                        req.error = err
                finally:
                    self._call_s = 0.5 * self._call_s + 0.5 * (time.perf_counter() - start)
                    shared = len({id(r.owner) for r in batch}) > 1
                    for req in batch:
                        req.shared, req.done = shared, True
        if request.error is not None:
            raise request.error
        return request.outputs

    def _gather(self, leader: WaitingCall) -> list[WaitingCall]:
        """The leader and the waiting requests that join it, after waiting for the other expected askers'."""
        now = time.perf_counter()
        may_share = self.share and self.joins(leader, leader)  # a request that joins nothing does not wait
        deadline = self.rule.deadline(now, self._call_s) if may_share else now
        with self._changed:
            while True:
                batch = [leader] + [r for r in self._waiting
                                    if r is not leader and self.share and self.joins(r, leader)]
                now = time.perf_counter()
                until = deadline if self.rule.quiet_s is None else min(deadline, self._last_arrival + self.rule.quiet_s)
                expected = self.playing if self.expected is None else self.expected()
                if now >= until or len({id(r.owner) for r in [leader, *self._waiting]}) >= expected:
                    break
                self._changed.wait(until - now)
            self._waiting = [r for r in self._waiting if r not in batch]
        return batch
