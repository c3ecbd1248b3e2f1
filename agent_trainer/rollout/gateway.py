"""Training an agent written against the ``openai`` client (``agent_proxy.gateway.agent``, docs/gateway.md).

:class:`GatewayRollout` is a :class:`~agent_trainer.rollout.multiturn.MultiTurnRollout` whose episodes are played
by the user's ``async def run(task, client)`` instead of the built-in turn loop. What stays the rollout's: the env
actors and their resets (seeds, faults, prefetch), the engines with their restart-and-retry, the batch's
token-in/token-out check, the metrics. What changes, per rollout (:class:`GatewayLoop`):

- every episode gets a session of the gateway (``agent_trainer.gateway``: FastAPI + uvicorn on 127.0.0.1, the
  run's key, in a Ray actor of its own, ``gateway.host.GatewayHost``, whose engine calls come back here) and an
  ``openai.AsyncOpenAI`` client whose base URL is that session's; the agents of all episodes run at once on one
  event loop, each within ``agent_proxy.gateway.episode_timeout_s`` (a synchronous agent function gets an
  ``openai.OpenAI`` client and runs each episode in a thread of its own);
- the gateway's requests of all episodes go to the engines together (:class:`EngineBatcher`: whatever arrived
  while the engines were busy is the next engine call), at the run's sampling;
- ``task.step`` steps the episode's env actor; its rewards are the episode's. The steps the agents ask at about
  the same moment go out together (:class:`EnvSteps`: one env call per env actor, or per group), and the engine's answers go back to
  the gateway's actor together (:class:`Combined`), so a turn costs the driver a few Ray calls, not a few per
  episode;
- when the agent returns, its session's calls become training rows (``gateway.sessions.episode_rows``): one row
  when each call's prompt extends the row so far exactly (merged), else one row per call (step-wise), in every
  layout; the estimators read an episode's step-wise rows as the one episode they make
  (``core_algos.compute_advantage``). Each step's reward goes on the last token of the reply before it, as the
  built-in agents place a turn's reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agent_trainer.common import profiling
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.agents.ctx_manager import anchor_id
from agent_trainer.agents.gateway import CondensedGatewayAgent, GatewayAgent, GatewayEpisode
from agent_trainer.episode.es_manager import EnvInput
from agent_trainer.gateway.app import eos_ids
from agent_trainer.gateway.host import EngineRequest, GatewayHost, serve_requests
from agent_trainer.gateway.server import new_api_key, session_url
from agent_trainer.gateway.task import EpisodeOver, StepResult, SyncTask, Task, is_sync_agent, resolve_agent_fn
from agent_trainer.rollout.engines import EngineCalls, GatherRule, WaitingCall
from agent_trainer.rollout.multiturn import MultiTurnRollout
from agent_trainer.rollout.results import RolloutFaults, RolloutResult
from agent_trainer.rollout.splits import SamplingParams, sampling_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampled:
    """One continuation, as the gateway records it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int | None = None
    """The policy version that generated it (the engines' after the call; None when the run counts none)."""


GATHER = GatherRule(max_s=1.0, call_fraction=0.0, quiet_s=0.2)
"""The gateway's wait for the other sessions' requests: until every live session asked, 1 s at most, and no longer
once no request has arrived for 0.2 s (agents that step in lockstep share one engine call, as the built-in turn
loop's episodes do; one busy elsewhere, with a slow tool or a long computation, holds the others back 0.2 s)."""


class EngineBatcher:
    """The gateway's ``generate`` in a rollout: the requests of all sessions batched onto the run's engines.

    Whatever requests arrive while the engines are busy go out together in the next engine call (an
    :class:`~agent_trainer.rollout.engines.EngineCalls` of its own, by :data:`GATHER`; each call through the
    rollout's ``_generate``: restart-and-retry, the failure count). Every call samples at the split's sampling
    (``actor_rollout_ref.rollout.temperature`` / ``top_p``, ``val_kwargs`` in validation) and a seed of the run's;
    a request asking for another temperature, top_p or seed is counted in ``gateway_sampling_overridden``.
    A request's ``max_tokens`` is capped by ``actor_rollout_ref.rollout.response_length`` (the gateway's app
    caps it already, and to the context left after the prompt; this keeps the engine call within it regardless).
    """

    def __init__(self, rollout: MultiTurnRollout, sampling: SamplingParams, step: int,
                 live: Callable[[], int] = lambda: 1):
        self.rollout, self.sampling, self.step = rollout, sampling, step
        self.eos_ids = eos_ids(rollout.ctx.tokenizer)
        self.engine_calls = self.requests = self.overridden = 0
        self.batch_sizes: list[int] = []
        """Requests per engine call, in order."""
        self.calls = EngineCalls(rule=GATHER, joins=lambda request, leader: True, expected=live)
        """Every request joins the next call (:meth:`_send` splits it by stop ids); the leader waits for every live
        session's request."""
        self._count = threading.Lock()
        self.waiting = 0
        """Requests waiting for their engine call or in one now (their agents wait for the answer)."""

    def __call__(self, prompts: list[list[int]], *, max_tokens: int, temperature: float, top_p: float,
                 stop_token_ids: list[int] | None, seed: int | None) -> list[Sampled]:
        cap = self.rollout.cfg.actor_rollout_ref.rollout.response_length
        stops = sorted(set(stop_token_ids or ()))
        with self._count:
            self.requests += 1
            asked = (temperature, top_p)  # the defaults (1, 1) are what a request that asks nothing sends
            if seed is not None or asked not in ((1.0, 1.0), (self.sampling.temperature, self.sampling.top_p)):
                self.overridden += 1
        size = min(max_tokens, cap)
        request = WaitingCall(object(), prompts, dataclasses.replace(self.sampling, stop_token_ids=stops or None),
                              seed=0, budgets=[size] * len(prompts), prompt_seeds=None)  # its seed: the call's
        with self._count:
            self.waiting += 1
        try:
            return self.calls.call(request, self._send)
        finally:
            with self._count:
                self.waiting -= 1

    def wake(self) -> None:
        """A session ended: the request waiting for it need not wait any longer."""
        self.calls.wake()

    def _send(self, batch: list[WaitingCall]) -> list:
        """One engine call per stop-id set of ``batch``; each request's samples, or the error of its call (500 for
        its session; the others are unaffected)."""
        r = self.rollout
        self.batch_sizes.append(len(batch))
        results: dict[int, list | BaseException] = {}
        for stops in sorted({tuple(req.sampling.stop_token_ids or ()) for req in batch}):
            group = [req for req in batch if tuple(req.sampling.stop_token_ids or ()) == stops]
            try:
                seed = sampling_seed(r.cfg.trainer.seed, r.split, self.step, 1 + self.engine_calls)
                self.engine_calls += 1
                generations = r._generate([p for req in group for p in req.prompts], group[0].sampling, seed,
                                          budgets=[b for req in group for b in req.budgets])
                outputs = iter(generations)
                ends = self.eos_ids | set(stops)
                for req in group:
                    results[id(req)] = [Sampled(ids, logprobs, "stop" if ids and ids[-1] in ends else "length",
                                                generations.version)
                                        for ids, logprobs in (next(outputs) for _ in req.prompts)]
            except Exception as err:  # noqa: BLE001 - every request of the call fails with it; the others do not
                for req in group:
                    results[id(req)] = err
        return [results[id(req)] for req in batch]


class GatewayLoop:
    """One gateway rollout: every episode's agent run at once against its own session (module docstring)."""

    def __init__(self, rollout: GatewayRollout, sampling: SamplingParams, step: int, faults: RolloutFaults):
        self.rollout, self.sampling, self.step, self.faults = rollout, sampling, step, faults
        self.timings = profiling.TurnTimings()
        self.running = 0
        """Agents not yet returned (the batcher waits for their requests)."""
        self.batcher = EngineBatcher(rollout, sampling, step, live=lambda: self.running)
        self.agent_errors: Counter[str] = Counter()
        self.agent_timeouts = 0
        self.episodes: list[GatewayEpisode] = []
        self.sync = is_sync_agent(rollout.agent_fn)
        """A synchronous agent function: each episode runs in a thread of its own (:func:`in_thread`)."""
        self.deliveries = Combined(lambda items: rollout.host().deliver_many.remote(items))
        """The engine's answers, back to the gateway's actor: those of one engine call in one or two Ray calls."""
        self.env_steps = EnvSteps(self)
        """The agents' env steps, sent together (:class:`EnvSteps`)."""
        self.sessions: list[str] = []
        """The gateway sessions opened for the rollout's episodes (one call), one taken by each episode."""

    def play(self, ctxs: dict[int, GatewayEpisode]) -> None:
        r = self.rollout
        self.episodes = list(ctxs.values())
        host = r.host()
        stopped = threading.Event()

        def take() -> list[EngineRequest]:
            try:
                return ray.get(host.take.remote(0.05))
            except ray.exceptions.RayActorError:  # the gateway's actor died: the episodes' session calls raise it
                stopped.set()
                return []

        pump = threading.Thread(target=serve_requests, args=(take, self._serve, stopped, 2 * len(ctxs) + 8),
                                name="gateway-pump", daemon=True)
        pump.start()
        try:
            asyncio.run(self._play_all(self.episodes))
            ray.get(host.fail_waiting.remote("the rollout is over"))  # calls of agents cancelled at their deadline
        finally:  # a dead gateway actor raises here: a dead worker, as the trainer reports any (trainer.max_restarts)
            stopped.set()
            pump.join()
        for ctx in ctxs.values():
            ctx.finish()
            calls = _calls_in_row_order(ctx)
            r.last_generations[ctx.env_id] = [list(c.completion_ids) for c in calls]
            r.last_versions[ctx.env_id] = [c.policy_version for c in calls]

    def _serve(self, request: EngineRequest) -> None:
        """One request of the gateway's actor through the batched engine calls; its result goes back to it."""
        try:
            outputs, error = self.batcher(request.prompts, **request.sampling()), ""
        except Exception as err:  # the request fails (500 to its agent); the others are unaffected
            outputs, error = None, f"{type(err).__name__}: {err}"
        self.deliveries.put((request.request_id, outputs, error))

    async def _play_all(self, episodes: list[GatewayEpisode]) -> None:
        loop = asyncio.get_running_loop()
        # every episode's env step may wait on its env actor at once (asyncio's default pool has cpu + 4 threads)
        loop.set_default_executor(ThreadPoolExecutor(max_workers=len(episodes) + 4, thread_name_prefix="gateway-env"))
        self.running = len(episodes)
        self.sessions = await self.rollout.host().open_sessions.remote(self.step, len(episodes))
        # one HTTP client under every episode's openai client: a client of its own each would build an SSL context
        # each (the CA bundle read again: most of a 64-episode rollout's driver time when measured)
        timeout = self.rollout.cfg.agent_proxy.gateway.episode_timeout_s
        if self.sync:  # a synchronous agent: each episode in a thread of its own, so their calls batch as async ones'
            http = openai.DefaultHttpxClient(timeout=timeout)
        else:
            http = openai.DefaultAsyncHttpxClient(timeout=timeout)
        try:
            await asyncio.gather(*(self._episode(http, ctx) for ctx in episodes))
        finally:
            if self.sync:  # an agent past its deadline cannot be stopped: its thread is left to end on its own
                http.close()
            else:
                await http.aclose()

    async def _episode(self, http, ctx: GatewayEpisode) -> None:
        r, cfg = self.rollout, self.rollout.cfg
        timeout = cfg.agent_proxy.gateway.episode_timeout_s
        host = r.host()
        session = self.sessions.pop()
        client = (openai.OpenAI if self.sync else openai.AsyncOpenAI)(
            base_url=session_url(*r.address(), session), api_key=r.api_key, max_retries=0, timeout=timeout,
            http_client=http)

        async def step(actions: list[str], response: str) -> StepResult:
            return await self._env_step(ctx, session, actions, response)

        loop = asyncio.get_running_loop()
        fields = dict(instruction=ctx.instruction, observation=ctx.observation, tag=ctx.tag, env_id=ctx.env_id,
                      group_id=ctx.group_id, model=r.model_name, max_turns=cfg.agent_proxy.max_turn, _step=step)
        if self.sync:
            running = in_thread(loop, r.agent_fn, SyncTask(**fields, _loop=loop), client,
                                name=f"gateway-agent-{ctx.env_id}")
        else:
            running = asyncio.ensure_future(r.agent_fn(Task(**fields), client))
        try:
            done, _ = await asyncio.wait({running}, timeout=timeout)
            if not done:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                self.agent_timeouts += 1
                ctx.truncated = True
            else:
                self._take_result(ctx, running)
        finally:
            self.running -= 1
            self.batcher.wake()
            ctx.done = True
            ctx.records = await host.close_session.remote(session)

    def _take_result(self, ctx: GatewayEpisode, running: asyncio.Future) -> None:
        err = running.exception()
        if err is None:
            result = running.result()
            if result is None:
                return
            if isinstance(result, (int, float)) and not isinstance(result, bool):
                ctx.returned_reward = float(result)  # a non-finite one is screened by algorithm.nonfinite_reward
                return
            if inspect.iscoroutine(result):  # a plain function that returned an async one's coroutine
                result.close()
                err = TypeError("the agent returned a coroutine: declare the function `async def`")
            else:
                err = TypeError(f"the agent returned {type(result).__name__}; return a float reward or None")
        if isinstance(err, openai.BadRequestError) and getattr(err, "code", None) == "context_length_exceeded":
            ctx.truncated = ctx.context_overflow = True  # as the built-in agents end an overflowing episode
            return
        if isinstance(err, EpisodeOver) and ctx.truncated:  # its env actor was lost: counted there
            return
        kind = type(err).__name__
        if kind not in self.agent_errors:
            logger.error("gateway agent %s raised in %s (logged once per exception type and rollout): %s: %s",
                         self.rollout.cfg.agent_proxy.gateway.agent, self.rollout.describe_episode(ctx.env_id), kind,
                         err)
        self.agent_errors[kind] += 1

    async def _env_step(self, ctx: GatewayEpisode, session: str, actions: list[str], response: str) -> StepResult:
        return await self.env_steps.step(ctx, session, actions, response)

    def metrics(self, prefix: str, episodes: list[GatewayEpisode]) -> dict[str, float]:
        m = {"rows": sum(e.row_metrics.rows for e in episodes), "merges": sum(e.row_metrics.merges for e in episodes),
             "breaks": sum(e.row_metrics.breaks for e in episodes),
             "calls": sum(e.num_replies for e in episodes),
             "engine_calls": self.batcher.engine_calls, "env_calls": self.env_steps.calls,
             "sampling_overridden": self.batcher.overridden,
             "agent_errors": sum(self.agent_errors.values()), "agent_timeouts": self.agent_timeouts,
             "merged": sum(len(e.rows) == 1 for e in episodes),
             "stepwise": sum(e.row_metrics.stepwise for e in episodes)}
        calls_mean = sum(e.num_replies for e in episodes) / max(1, len(episodes))
        return {f"{prefix}/gateway_{k}": float(v) for k, v in m.items()} | {f"{prefix}/num_calls_mean": calls_mean}


class Combined:
    """Items put from many threads, sent in as few calls as they allow: the thread that finds no send under way
    sends everything put until then, again until nothing is left (the others only add theirs)."""

    def __init__(self, send: Callable[[list], object]):
        self.send = send
        self._items: list = []
        self._sending = False
        self._lock = threading.Lock()

    def put(self, item) -> None:
        with self._lock:
            self._items.append(item)
            if self._sending:
                return
            self._sending = True
        while True:
            with self._lock:
                items, self._items = self._items, []
                if not items:
                    self._sending = False
                    return
            try:
                self.send(items)
            except BaseException:
                with self._lock:
                    self._sending = False
                raise


@dataclass
class _Step:
    ctx: GatewayEpisode
    session: str
    actions: list[str]
    response: str
    result: asyncio.Future


class EnvSteps:
    """The agents' env steps, sent together as the built-in agents' are: one env call per env actor (per group with
    ``rollout.mode=async``, whose threaded env actors run the groups' calls side by side, as the barrier-free
    loop's lanes), and one call to the gateway's actor for the sessions' calls so far. The steps go out as soon as
    every agent still playing waits, for its step or for an engine answer; else once none has been asked for
    :attr:`QUIET_S` (an agent busy elsewhere), :attr:`MAX_WAIT_S` after the first at most. A lost or timed-out env
    actor ends each episode of its call (:class:`~agent_trainer.gateway.task.EpisodeOver`)."""

    QUIET_S = 0.005
    MAX_WAIT_S = 0.05

    def __init__(self, loop: GatewayLoop):
        self.owner = loop
        self.pending: list[_Step] = []
        self._first = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._sends: set[asyncio.Task] = set()
        self.steps = self.calls = 0
        """Env steps asked, env actor calls that made them."""

    async def step(self, ctx: GatewayEpisode, session: str, actions: list[str], response: str) -> StepResult:
        loop = asyncio.get_running_loop()
        if not self.pending:
            self._first = loop.time()
        self.pending.append(_Step(ctx, session, actions, response, loop.create_future()))
        result = self.pending[-1].result
        if self._timer is not None:
            self._timer.cancel()
        if len(self.pending) + self.owner.batcher.waiting >= self.owner.running:  # nobody else will ask now
            self._flush()
        else:
            self._timer = loop.call_at(min(loop.time() + self.QUIET_S, self._first + self.MAX_WAIT_S), self._flush)
        return await result

    def _flush(self) -> None:
        self._timer = None
        steps, self.pending = self.pending, []
        task = asyncio.ensure_future(self._send(steps))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(self, steps: list[_Step]) -> None:
        try:
            befores = await self.owner.rollout.host().before_steps.remote([s.session for s in steps])
            r = self.owner.rollout
            groups: dict[tuple[int, int], list[tuple[_Step, tuple[int, list[int]]]]] = {}
            for s, before in zip(steps, befores):
                key = (r.actor_of_env[s.ctx.env_id], s.ctx.group_id if r.barrier_free else -1)
                groups.setdefault(key, []).append((s, before))
            await asyncio.gather(*(self._step_group(group) for group in groups.values()))
        except BaseException as err:  # noqa: BLE001 - each agent's step raises it (the gateway's actor died: as before)
            for s in steps:
                if not s.result.done():
                    s.result.set_exception(err)

    async def _step_group(self, group: list[tuple[_Step, tuple[int, list[int]]]]) -> None:
        r, faults = self.owner.rollout, self.owner.faults
        actor = r.actor_of_env[group[0][0].ctx.env_id]
        inputs = []
        for s, (_, last) in group:
            text = s.response or r.ctx.tokenizer.decode(last, skip_special_tokens=True)
            inputs.append(EnvInput(s.ctx.env_id, text, s.actions))
        self.steps, self.calls = self.steps + len(inputs), self.calls + 1
        call = await asyncio.to_thread(r.env_pool.call, "step", {actor: inputs}, r.cfg.es_manager.env_step_timeout_s)
        faults.count_call(call)
        by_env = {out.env_id: out for out in call.results}
        for s, (before, _) in group:
            ctx, out = s.ctx, by_env.get(s.ctx.env_id)
            if out is None:  # the actor died or timed out: the episode ends, left out of the batch and its group
                ctx.truncated = ctx.env_actor_lost = True  # (infrastructure, not the policy: never scored)
                if actor in call.timed_out:
                    faults.tag_timeouts[ctx.tag] += 1
                error = EpisodeOver(f"the environment of this episode was lost: {call.errors.get(actor, 'no result')}")
                if not s.result.done():
                    s.result.set_exception(error)
                continue
            if not s.actions:
                ctx.format_errors += 1
            ctx.steps.append((before, float(out.reward), anchor_id(out.observation)))
            if out.done:
                ctx.done = True
            if not s.result.done():  # (an agent cancelled at its deadline no longer waits)
                s.result.set_result(StepResult(observation=out.observation, reward=float(out.reward),
                                               done=bool(out.done), info=dict(out.info)))


def in_thread(loop: asyncio.AbstractEventLoop, fn: Callable, *args, name: str) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread of its own; its result or exception lands in the returned future of
    ``loop``. A daemon thread, not a pool's: a synchronous agent that never returns (it cannot be cancelled) must
    not keep the driver process from exiting; one past its deadline finds its future cancelled (or the loop
    closed) and its result is dropped."""
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        result = error = None
        try:
            result = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the episode, as an async agent's exception is
            error = err
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the rollout is over (its loop closed): nobody waits for this episode any more
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    return future


def _calls_in_row_order(ctx: GatewayEpisode) -> list:
    """The episode's recorded calls (``CallRecord`` s) in the order its rows hold them (the contract check's turns,
    each with the policy version that sampled it), then any call no row holds (which the check then reports)."""
    by_call = {(r.request_index, r.choice_index): r for r in ctx.records}
    ordered = [call for row in ctx.rows for call in row.calls]
    return [by_call[c] for c in ordered] + [r for c, r in sorted(by_call.items()) if c not in set(ordered)]


class GatewayRollout(MultiTurnRollout):
    """The rollout of a run with ``agent_proxy.gateway.agent``: a user's agent function plays each episode through
    the OpenAI-compatible gateway (module docstring). The gateway starts with the first rollout and serves every
    rollout of this split; :meth:`close` stops it."""

    concurrent_env_steps = True

    def __init__(self, cfg: AgentTrainerConfig, tokenizer, engines: list, env_worker_cls, env_tags: dict, **kwargs):
        kwargs.pop("agent_cls", None)
        agent = CondensedGatewayAgent if cfg.ctx_manager.mode == "condensed" else GatewayAgent
        super().__init__(cfg, tokenizer, engines, env_worker_cls, env_tags, agent_cls=agent, **kwargs)
        self.agent_fn = resolve_agent_fn(cfg)
        self.api_key = new_api_key()
        """The run's key: every request to the gateway must send it."""
        self.model_name = served_model_name(cfg)
        self._host = None
        self._address: tuple[str, int] | None = None
        self.loop: GatewayLoop | None = None
        for name in ("httpx", "httpx2"):  # the openai client's HTTP library logs every request at INFO
            logging.getLogger(name).setLevel(logging.WARNING)

    def host(self):
        """The gateway's Ray actor (:class:`~agent_trainer.gateway.host.GatewayHost`), started on first use on this
        (the driver's) node, serving on ``agent_proxy.gateway.host`` / ``port``."""
        if self._host is None:
            g = self.cfg.agent_proxy.gateway
            actor = ray.remote(num_cpus=0, max_concurrency=HOST_CONCURRENCY, max_restarts=0)(GatewayHost)
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            rollout = self.cfg.actor_rollout_ref.rollout
            self._host = actor.options(scheduling_strategy=here).remote(
                self.ctx.tokenizer, api_key=self.api_key, model=self.model_name, max_model_len=rollout.max_model_len,
                response_length=rollout.response_length, host=g.host, port=g.port)
            self._address = tuple(ray.get(self._host.address.remote(), timeout=HOST_START_TIMEOUT_S))
            logger.info("gateway of the %s split listening on http://%s:%d (Ray actor GatewayHost)", self.split,
                        *self._address)
        return self._host

    def address(self) -> tuple[str, int]:
        """(host, port) the gateway listens on (starts it)."""
        self.host()
        return self._address

    def named_actors(self) -> dict[str, list]:
        return {**super().named_actors(), **({f"gateway ({self.split})": [self._host]} if self._host else {})}

    def make_loop(self, sampling: SamplingParams, step: int, faults: RolloutFaults) -> GatewayLoop:
        self.loop = GatewayLoop(self, sampling, step, faults)
        return self.loop

    def rollout(self, step: int = 0, seeds: list[int] | None = None) -> RolloutResult:
        result = super().rollout(step, seeds)
        prefix = self.split.metric_prefix
        result.metrics.update(self.loop.metrics(prefix, self.loop.episodes))
        played = {e.env_id: e for e in self.loop.episodes}
        for state in result.states:  # per episode in the trajectories and the viewer
            e = played.get(int(state.env_id))
            if e is not None:
                state.metrics.update(gateway_rows=float(e.row_metrics.rows), gateway_breaks=float(e.row_metrics.breaks))
                state.turn_replies = e.step_calls() if len(e.steps) == len(state.history) else None
        return result

    def close(self) -> None:
        if self._host is not None:
            try:
                ray.get(self._host.stop.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # already gone
            ray.kill(self._host)
            self._host, self._address = None, None


HOST_CONCURRENCY = 64
"""Ray calls the gateway's actor serves at once (the driver's session calls and its wait for requests; the HTTP
requests themselves are uvicorn's, up to ``Gateway.max_concurrent_requests``)."""
HOST_START_TIMEOUT_S = 120.0


def served_model_name(cfg: AgentTrainerConfig) -> str:
    """The name the gateway serves the policy under: the model folder's name."""
    return Path(str(cfg.actor_rollout_ref.model.path)).name or "policy"
