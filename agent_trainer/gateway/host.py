"""The gateway in a Ray actor of its own (:class:`GatewayHost`), as the trainer runs it.

The app, its uvicorn server and the sessions' records live in the actor's process, on the driver's node (the
agents run in the driver and reach it on ``agent_proxy.gateway.host``); it shows on the Ray dashboard as
``GatewayHost``, and in the trainer's error lines as ``gateway (<split>)``. The engines stay the rollout's: a request the app cannot answer from its own state becomes
an :class:`EngineRequest` that the driver takes (:meth:`GatewayHost.take`), generates through the rollout's
batched engine calls (restart and retry included) and hands back (:meth:`GatewayHost.deliver`). Only typed
objects cross: requests, the sampled continuations, the sessions' :class:`~agent_trainer.gateway.sessions.CallRecord` s.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agent_trainer.gateway.app import Gateway, create_app
from agent_trainer.gateway.server import GatewayServer
from agent_trainer.gateway.sessions import CallRecord, SessionStore


@dataclass(frozen=True)
class EngineRequest:
    """One chat completion's engine call, as the app asks it: ``n`` prompts (the same ids) and the sampling."""

    request_id: int
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: list[int] | None
    seed: int | None

    def sampling(self) -> dict[str, Any]:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    stop_token_ids=self.stop_token_ids, seed=self.seed)


@dataclass
class _Waiting:
    request: EngineRequest
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list | None = None
    error: str = ""


class GatewayHost:
    """The body of the gateway's Ray actor (threaded: the HTTP server's calls wait while the driver serves them)."""

    def __init__(self, tokenizer, *, api_key: str, model: str, max_model_len: int, host: str, port: int,
                 response_length: int | None = None):
        self.policy_version = 0
        self.gateway = Gateway(tokenizer=tokenizer, generate=self._generate,
                               store=SessionStore(), api_key=api_key, model=model, max_model_len=max_model_len,
                               response_length=response_length, policy_version=lambda: self.policy_version,
                               engine_lock=None)
        self._ids = itertools.count()
        self._waiting: dict[int, _Waiting] = {}
        self._untaken: list[int] = []
        self._cv = threading.Condition()
        self.server = GatewayServer(create_app(self.gateway), host=host, port=port)

    def address(self) -> tuple[str, int]:
        return self.server.host, self.server.port

    # ------------------------------------------------------------------ sessions (the driver's episodes)
    def open_session(self, policy_version: int) -> str:
        return self.open_sessions(policy_version, 1)[0]

    def open_sessions(self, policy_version: int, n: int) -> list[str]:
        """``n`` new sessions (a rollout's episodes, in one call), recorded from ``policy_version`` on."""
        self.policy_version = policy_version
        return [self.gateway.store.open() for _ in range(n)]

    def close_session(self, session_id: str) -> list[CallRecord]:
        return self.gateway.store.close(session_id)

    def before_step(self, session_id: str) -> tuple[int, list[int]]:
        """What an env step of the session needs: how many requests the session has made, and the sampled ids of
        its last recorded call ([] before any)."""
        records = self.gateway.store.records(session_id)
        return self.gateway.store.requests(session_id), list(records[-1].completion_ids) if records else []

    def before_steps(self, session_ids: list[str]) -> list[tuple[int, list[int]]]:
        """:meth:`before_step` of several sessions in one call (the env steps the driver sends together)."""
        return [self.before_step(s) for s in session_ids]

    # ------------------------------------------------------------------ engine calls (served by the driver)
    def take(self, wait_s: float, quiet_s: float = 0.002) -> list[EngineRequest]:
        """The requests not yet taken; waits up to ``wait_s`` for one when there are none, then, while more keep
        arriving, until none has for ``quiet_s`` (``wait_s`` at most): the requests of agents answered by one engine
        call arrive within moments of each other, and go to the driver in one call."""
        with self._cv:
            if not self._untaken:
                self._cv.wait(wait_s)
            deadline = time.monotonic() + wait_s
            while self._untaken and time.monotonic() < deadline:
                seen = len(self._untaken)
                self._cv.wait(quiet_s)
                if len(self._untaken) == seen:
                    break
            taken, self._untaken = self._untaken, []
            return [self._waiting[i].request for i in taken if i in self._waiting]

    def deliver(self, request_id: int, outputs: list | None, error: str = "") -> None:
        """The engine's continuations of a request (``Sampled`` s), or why there are none."""
        self.deliver_many([(request_id, outputs, error)])

    def deliver_many(self, delivered: list[tuple[int, list | None, str]]) -> None:
        """:meth:`deliver` for several requests in one call: (request id, outputs, error) each."""
        with self._cv:
            waiting = [(self._waiting.pop(request_id, None), outputs, error)
                       for request_id, outputs, error in delivered]
        for w, outputs, error in waiting:
            if w is not None:
                w.outputs, w.error = outputs, error
                w.done.set()

    def fail_waiting(self, reason: str) -> int:
        """End every request still waiting (the rollout that would serve them is over); returns how many."""
        with self._cv:
            waiting, self._waiting, self._untaken = list(self._waiting.values()), {}, []
        for w in waiting:
            w.error = reason
            w.done.set()
        return len(waiting)

    def _generate(self, prompts: list[list[int]], **sampling) -> list:
        with self._cv:
            request = EngineRequest(request_id=next(self._ids), prompts=prompts, **sampling)
            waiting = self._waiting[request.request_id] = _Waiting(request)
            self._untaken.append(request.request_id)
            self._cv.notify_all()
        waiting.done.wait()
        if waiting.outputs is None:
            raise RuntimeError(waiting.error or "the engine call was not served")
        return waiting.outputs

    def stop(self) -> None:
        self.fail_waiting("the gateway is stopping")
        self.server.stop()


def serve_requests(take: Callable[[], list[EngineRequest]], serve: Callable[[EngineRequest], None],
                   stopped: threading.Event, max_workers: int) -> None:
    """The driver's side: until ``stopped``, take the host's requests and serve each in a thread of its own
    (``serve`` blocks while the batcher gathers the other sessions' requests into one engine call)."""
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gateway-engine") as pool:
        while not stopped.is_set():
            for request in take():
                pool.submit(serve, request)
