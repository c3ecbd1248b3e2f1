"""``SyncMultiTurnRollout``: episodes fanned out to Ray env actors and rollout engines.

One call to :meth:`SyncMultiTurnRollout.rollout` plays ``env_groups x
group_size`` episodes for up to ``agent_proxy.max_turn`` turns and returns
one training batch plus metrics::

    reset env actors (one seed per group; es_manager.prefetch_reset: started as the last rollout ended)
    for turn in 1..max_turn, while any episode is active:
        prompts  <- ctx_manager: token ids of each active episode's next turn
        outputs  <- rollout engines: generate(token ids) -> token ids + logprobs
        env actors: parse <answer>, step env, reward, done
    start the next rollout's reset (prefetch_reset), which runs while the step trains
    batch    <- ctx_manager.build_update_batch()

``actor_rollout_ref.rollout.mode=async`` plays the same turns without the barrier between
them: each group's next turn goes to the engines as soon as its own env step returns
(:meth:`SyncMultiTurnRollout._play_without_barrier`, docs/architecture.md).

``ctx_manager.mode`` picks the layout: ``full`` (one growing sequence and one
row per episode, ``agent_trainer.ctx_manager``) or ``condensed`` (a fresh
prompt per turn and one row per turn, ``agent_trainer.condensed_ctx``).
``agent_proxy.agent_cls`` (or ``AgentTrainer(agent_cls=...)``) puts another agent in the
context manager's place (docs/agents.md); every batch an agent builds is checked against the
token-in/token-out contract before it leaves the rollout (``agent_trainer.agents.contract``).

Faults end only what they touch (docs/reliability.md):

- an env actor that dies is reported (``rollout/env_actor_failures``) and its episodes end
  where they are; Ray restarts it (``max_restarts``), so the next reset finds it again;
- an env actor that misses ``es_manager.env_step_timeout_s`` / ``env_reset_timeout_s`` is
  killed and replaced (``agent_trainer.env_pool``); its episodes end with an error
  (``env/<tag>/timeouts``, ``rollout/env_timeouts``);
- an episode whose reset raises or times out is dropped from the step
  (``rollout/reset_failures``); more than ``es_manager.max_failed_reset_fraction`` of the
  split stops the run with an error naming the tag, the seed and the exception;
- an exception from an environment is logged once per (tag, exception type) with its text;
- an episode whose next prompt would not fit ``max_model_len`` ends as truncated
  (``rollout/context_overflow_rate``) and keeps the rewards it earned;
- an engine that dies or misses ``actor_rollout_ref.rollout.generate_timeout_s`` is
  restarted, re-synced and the turn generated once more (``rollout/engine_failures``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from agent_trainer import core_algos, profiling
from agent_trainer.agents.base import Agent
from agent_trainer.agents.contract import check_batch_contract
from agent_trainer.agents.registry import resolve_agent_cls
from agent_trainer.batch import TensorBatch
from agent_trainer.condensed_ctx import SUMMARY_SEED_SALT, CondensedContextManager, CondensedEpisode
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.envs import EnvGroupsConfig
from agent_trainer.config.splits import Split
from agent_trainer.ctx_manager import EpisodeContext
from agent_trainer.env_pool import EnvActorPool, PendingCall
from agent_trainer.es_manager import EnvInput, EpisodeSpec, group_seeds, plan_episodes
from envs.registry import normalize_tags

logger = logging.getLogger(__name__)

SPLITS: tuple[Split, ...] = tuple(Split)
"""Every :class:`~agent_trainer.config.splits.Split`, in the order :func:`episode_seed` numbers them."""


@dataclass
class SamplingParams:
    """How the engines sample one turn."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class RolloutResult:
    """A rollout's training batch, its metrics, and the raw per-episode states."""

    batch: TensorBatch
    metrics: dict[str, float]
    states: list[dict]
    group_seeds: list[int] = field(default_factory=list)
    """The seed each group (``uid``) was reset with; the remax_baseline split replays them."""


class SyncMultiTurnRollout:
    """Plays one split's episodes (:data:`SPLITS`) against the policy's rollout engines.

    ``engines`` are Ray actor handles exposing ``generate(prompts, **sampling)``
    (``workers.rollout``); ``env_worker_cls`` is the ``ray.remote`` env-state
    manager (``workers.env_worker.EnvWorker``), of which ``num_env_actors``
    are started, each hosting a contiguous shard of episodes.

    Each turn of an episode generates at most ``min(max_tokens of its env tag,
    actor_rollout_ref.rollout.response_length)`` tokens (:attr:`turn_budget`): the tag's
    ``max_tokens`` is its per-turn budget, ``response_length`` the global cap (verl/RAGEN).
    """

    def __init__(self, cfg: AgentTrainerConfig, tokenizer, engines: list, env_worker_cls, env_tags: dict,
                 split: Split | str = Split.TRAIN, num_env_actors: int = 2,
                 on_engine_restart: Callable[[], object] | None = None, agent_cls: type[Agent] | None = None):
        self.cfg = cfg
        self.split_cfg = split_config(cfg, split)
        self.split = Split(split)
        self.engines = engines
        self.on_engine_restart = on_engine_restart
        """Called after an engine died (Ray restarts it from the checkpoint on disk): re-sync the weights."""
        tag_cfgs = normalize_tags(env_tags)
        response_length = cfg.actor_rollout_ref.rollout.response_length
        self.turn_budget: dict[str, int] = {tag: min(tag_cfgs[tag].max_tokens, response_length)
                                            for tag in self.split_cfg.tags}
        """Per env tag: the most tokens one turn may generate."""
        self.ctx = make_context_manager(cfg, tokenizer, agent_cls)
        """The agent (``agent_proxy.agent_cls``, docs/agents.md); its batches are checked (``agents.contract``)."""
        self.barrier_free = cfg.actor_rollout_ref.rollout.mode == "async"
        """``rollout.mode=async``: no turn barrier (:meth:`_play_without_barrier`)."""
        self.seed_per_request = self.barrier_free
        """Seed each episode's turn on its own (:func:`episode_seed`); ``rollout.mode=async`` needs it, and
        either turn loop then samples the same episodes. Off: one seed per engine call (:func:`sampling_seed`)."""
        self.episodes: list[EpisodeSpec] = plan_episodes(self.split_cfg)
        # Whole groups per actor, so pass@group and group seeds stay local to one actor.
        group_shards = np.array_split(np.arange(self.split_cfg.env_groups), max(1, num_env_actors))
        shards = [[i for i, e in enumerate(self.episodes) if e.group_id in set(g.tolist())] for g in group_shards]
        shards = [s for s in shards if s]
        es = cfg.es_manager
        self.env_pool = EnvActorPool(
            env_worker_cls, self.split, [[self.episodes[i] for i in shard] for shard in shards],
            dict(tags=env_tags, format_penalty=es.format_penalty, action_sep=es.action_sep,
                 max_actions_per_turn=es.max_actions_per_turn, max_observation_chars=es.max_observation_chars),
            max_concurrency=max(len(g) for g in group_shards) if self.barrier_free else 1)
        self.actor_of_env = {int(self.episodes[i].env_id): a for a, shard in enumerate(shards) for i in shard}
        """env_id -> index of the env actor hosting it."""
        self.logged_errors: set[tuple[str, str]] = set()
        """(env tag, exception type) pairs already logged with their text: each is logged once per run."""
        self.num_resets = 0
        """Resets this split's rollouts have used (a prefetched one counts once its rollout takes it)."""
        self.prefetch_reset = es.prefetch_reset and self.split is Split.TRAIN
        """Reset the env actors for the next rollout as soon as this one is done (``es_manager.prefetch_reset``)."""
        self._pending_reset: tuple[list[int], PendingCall] | None = None
        """The next rollout's reset, started at the end of the last one: (group seeds, the call)."""
        self.reset_was_prefetched = False
        """Whether the last rollout took a prefetched reset (metric ``<prefix>/reset_prefetched``)."""
        self.last_seeds: list[int] = []
        """The group seeds of the last rollout (group id -> seed), for error messages."""
        self.last_generations: dict[int, list[list[int]]] = defaultdict(list)
        """The engine's raw token ids per episode and turn in the last rollout (for checks and debugging)."""

    def sampling_params(self) -> SamplingParams:
        """Training sampling, the ``val_kwargs`` for the val split, greedy for the ReMax baseline."""
        r = self.cfg.actor_rollout_ref.rollout
        if self.split is Split.TRAIN:
            return SamplingParams(max_tokens=r.response_length, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        if self.split is Split.REMAX_BASELINE:
            return SamplingParams(max_tokens=r.response_length, temperature=0.0)
        return SamplingParams(max_tokens=r.response_length, temperature=r.val_kwargs.temperature,
                              top_p=r.val_kwargs.top_p)

    def next_group_seeds(self) -> list[int]:
        """The split's seeds for its next reset (``es_manager.group_seeds``), counted as used."""
        seeds = self.upcoming_group_seeds()
        self.num_resets += 1
        return seeds

    def upcoming_group_seeds(self) -> list[int]:
        """The seeds :meth:`next_group_seeds` returns next, without counting them (a prefetched reset's)."""
        if self.split is Split.REMAX_BASELINE:
            raise ValueError("the remax_baseline split replays the training groups' initial states; "
                             "call rollout(step, seeds=<the training rollout's group_seeds>)")
        return group_seeds(self.split, self.split_cfg.env_groups, self.num_resets, self.cfg.es_manager.seed)

    @property
    def env_actors(self) -> list:
        """The live env actor handles (a replaced actor's handle is swapped for its replacement's)."""
        return self.env_pool.actors

    def describe_episode(self, env_id: int, seeds: list[int] | None = None) -> str:
        """Where an episode came from: tag, env_id, group and group seed (``seeds``: its rollout's group seeds,
        ``batch.meta["group_seeds"]``; default: the last rollout's, which a prefetched rollout has replaced)."""
        spec = next((e for e in self.episodes if e.env_id == env_id), None)
        if spec is None:
            return f"env_id {env_id} ({self.split} split)"
        seeds = self.last_seeds if seeds is None else seeds
        seed = seeds[spec.group_id] if spec.group_id < len(seeds) else "unknown"
        return f"env tag {spec.tag!r}, env_id {env_id}, group {spec.group_id} (group seed {seed}), {self.split} split"

    # -- the turn loop -------------------------------------------------------------------
    def rollout(self, step: int = 0, seeds: list[int] | None = None) -> RolloutResult:
        """Play every episode of the split once; return the batch and metrics.

        ``step`` (the trainer's global step) seeds the engines' sampling together with
        ``trainer.seed``, each turn afresh (:func:`sampling_seed`), so the same step of a
        resumed run samples what the uninterrupted run sampled. ``seeds`` (one per group)
        replays given initial states instead of the split's next ones: the remax_baseline
        split replays the training rollout's ``group_seeds``.

        An episode whose total reward is not finite stops the rollout with an error naming
        it, or is left out of the batch and counted in ``<prefix>/nonfinite_dropped``
        (``algorithm.nonfinite_reward`` = error | drop). Episodes whose reset failed, and
        episodes whose first prompt already overflows ``max_model_len``, have no turn to
        train on and are left out too (``<prefix>/reset_failures``, ``<prefix>/context_overflow_rate``).
        """
        seeds = self.next_group_seeds() if seeds is None else list(seeds)
        self.last_seeds = seeds
        sampling = self.sampling_params()
        self.engine_failures = 0
        self.last_generations = defaultdict(list)
        self.faults = RolloutFaults()
        ctxs = self._reset(seeds)
        if self.barrier_free:
            self._play_without_barrier(ctxs, sampling, step)
        else:
            self._play(ctxs, sampling, step)
        call = self.env_pool.call("get_rollout_states", {i: None for i in range(len(self.env_actors))},
                                  self.cfg.es_manager.env_reset_timeout_s)
        self.faults.actor_failures += len(call.failed)
        self.faults.timeouts += len(call.timed_out)
        if self.prefetch_reset and step < self.cfg.trainer.total_training_steps:
            self._start_next_reset()  # the env actors reset while the batch is built and the step trains
        states = [s for s in call.results if s["env_id"] in ctxs]
        played = [ctxs[k] for k in sorted(ctxs) if ctxs[k].num_turns > 0]
        if not played:
            raise RuntimeError(f"no episode of the {self.split} split played a turn ({len(self.episodes)} episodes, "
                               f"{self.faults.reset_failures} failed to reset, the others' first prompt exceeded "
                               "actor_rollout_ref.rollout.max_model_len minus the turn budget); see the errors above")
        episodes, dropped = screen_nonfinite(played, self.cfg.algorithm.nonfinite_reward, self.describe_episode)
        batch = self.ctx.build_update_batch(episodes)
        check_batch_contract(batch, self.last_generations, type(self.ctx).__qualname__, self.describe_episode)
        batch.meta["temperature"] = sampling.temperature if sampling.temperature > 0 else 1.0
        batch.meta["group_seeds"] = list(seeds)
        prefix = self.split.metric_prefix
        metrics = rollout_metrics(list(ctxs.values()), states, prefix=prefix)
        metrics.update(self.faults.metrics(prefix))
        metrics[f"{prefix}/engine_failures"] = float(self.engine_failures)
        metrics[f"{prefix}/nonfinite_dropped"] = float(dropped)
        metrics[f"{prefix}/reset_prefetched"] = float(self.reset_was_prefetched)
        metrics.update(profiling.rollout_profile(self.cfg, self.ctx, self.turn_timings, played, prefix))
        return RolloutResult(batch=batch, metrics=metrics, states=states, group_seeds=seeds)

    def _reset(self, seeds: list[int]) -> dict[int, EpisodeContext | CondensedEpisode]:
        """Reset every env actor with the group seeds; returns the contexts of the episodes that started.

        A dead actor is reset once more (Ray restarted it); an actor that misses the reset
        deadline was replaced and its episodes sit this rollout out. Episodes whose reset
        raised or whose actor was lost are dropped (:meth:`_check_reset_failures`).
        """
        timeout = self.cfg.es_manager.env_reset_timeout_s
        pending, self._pending_reset = self._pending_reset, None
        self.reset_was_prefetched = pending is not None and pending[0] == list(seeds)
        if self.reset_was_prefetched:
            call = self.env_pool.collect(pending[1])
        else:
            if pending is not None:  # other seeds asked for: the prefetched reset ends before this one starts
                self.env_pool.collect(pending[1])
            call = self.env_pool.collect(self._submit_reset(seeds, range(len(self.env_actors))))
        outputs, lost = list(call.results), dict(call.errors)
        self.faults.actor_failures += len(call.failed)
        self.faults.timeouts += len(call.timed_out)
        timed_out = set(call.timed_out)
        if call.failed:  # Ray restarts a dead env actor (max_restarts); its episodes start again there
            try:
                wait_until_ready([self.env_actors[i] for i in call.failed], timeout_s=timeout)
            except (ActorUnavailableError, RayActorError):
                pass  # still down: the retry below reports it and its episodes are dropped
            retry = self.env_pool.collect(self._submit_reset(seeds, call.failed))
            outputs += retry.results
            lost = {i: text for i, text in lost.items() if i in timed_out} | retry.errors
            timed_out |= set(retry.timed_out)
            self.faults.timeouts += len(retry.timed_out)
        errors = {out.env_id: out.info["error"] for out in outputs if out.info.get("error")}
        for env_id, actor in self.actor_of_env.items():
            if actor in lost:
                errors[env_id] = lost[actor]
                if actor in timed_out:
                    self.faults.tag_timeouts[self._spec(env_id).tag] += 1
        self._check_reset_failures(errors)
        return {out.env_id: self.ctx.start(out) for out in outputs if out.env_id not in errors}

    def _start_next_reset(self) -> None:
        """Start the reset of the split's next group seeds (:meth:`next_group_seeds` draws them when the next
        rollout takes the reset, so a checkpoint saved meanwhile counts only the resets used)."""
        seeds = self.upcoming_group_seeds()
        self._pending_reset = (seeds, self._submit_reset(seeds, range(len(self.env_actors))))

    def _submit_reset(self, seeds: list[int], actors: Iterable[int]) -> PendingCall:
        """Start the reset of ``actors``' episodes, each from its group's seed; the deadline
        (``es_manager.env_reset_timeout_s``) counts from now."""
        seed_of_group, timeout = dict(enumerate(seeds)), self.cfg.es_manager.env_reset_timeout_s
        return self.env_pool.submit("reset", {i: seed_of_group for i in actors}, timeout)

    def _check_reset_failures(self, errors: dict[int, str]) -> None:
        """Log failed resets once per (tag, error type); stop when too many of the split failed."""
        self.faults.reset_failures = len(errors)
        for env_id, error in sorted(errors.items()):
            self._log_env_error(env_id, "reset", error)
        limit = self.cfg.es_manager.max_failed_reset_fraction
        if errors and len(errors) > limit * len(self.episodes):
            env_id, error = min(errors.items())
            raise RuntimeError(
                f"{len(errors)} of {len(self.episodes)} episodes of the {self.split} split failed to reset "
                f"(more than es_manager.max_failed_reset_fraction = {limit:g}); the first: "
                f"{self.describe_episode(env_id)}: {error}. Fix the environment's reset, or raise the fraction")

    def _log_env_error(self, env_id: int, method: str, error: str) -> None:
        """Log an environment's error with its text, once per (tag, exception type) per run."""
        tag = self._spec(env_id).tag
        key = (tag, error.split(":", 1)[0])
        if key not in self.logged_errors:
            self.logged_errors.add(key)
            logger.error("environment %s failed in %s (%s; logged once per tag and error type): %s", tag, method,
                         self.describe_episode(env_id), error)

    def _spec(self, env_id: int) -> EpisodeSpec:
        return self.episodes[[e.env_id for e in self.episodes].index(env_id)]

    def _play(self, ctxs: dict[int, EpisodeContext | CondensedEpisode], sampling: SamplingParams, step: int) -> None:
        """The turn loop: generate for every active episode, step the envs; faults go to ``self.faults``."""
        self.turn_timings = profiling.TurnTimings()
        for turn in range(self.cfg.agent_proxy.max_turn):
            if isinstance(self.ctx, CondensedContextManager):  # text a condenser asked the policy for (context only)
                self.ctx.write_summaries(ctxs.values(), lambda prompts, budgets, temperature: self._generate(
                    prompts, dataclasses.replace(sampling, temperature=temperature),
                    sampling_seed(self.cfg.trainer.seed, self.split, step, turn) ^ SUMMARY_SEED_SALT, budgets=budgets))
            self._end_overflowing(c for c in ctxs.values() if not c.done)
            active = [c for c in ctxs.values() if not c.done]
            if not active:
                break
            seed = sampling_seed(self.cfg.trainer.seed, self.split, step, turn)
            with self.turn_timings.phase("generate", turn):
                generations = self._generate([self.ctx.prompt_ids(c) for c in active], sampling, seed,
                                             budgets=[self.turn_budget[c.tag] for c in active],
                                             prompt_seeds=self._request_seeds(active, step, turn))
            inputs_by_actor: dict = defaultdict(list)
            for ctx, (ids, logprobs) in zip(active, generations):
                self.last_generations[ctx.env_id].append(ids)
                env_input: EnvInput = self.ctx.append_reply(ctx, ids, logprobs)
                inputs_by_actor[self.actor_of_env[ctx.env_id]].append(env_input)
            with self.turn_timings.phase("env_step", turn):
                call = self.env_pool.call("step", inputs_by_actor, self.cfg.es_manager.env_step_timeout_s)
            self.faults.actor_failures += len(call.failed)
            self.faults.timeouts += len(call.timed_out)
            for out in call.results:
                if out.info.get("error"):
                    self._log_env_error(out.env_id, "step", out.info["error"])
                self.ctx.append_env_output(ctxs[out.env_id], out, self.turn_budget[out.tag])
            stepped = {out.env_id for out in call.results}
            for ctx in active:  # episodes whose actor failed or timed out end here, keeping their rewards
                if ctx.env_id not in stepped:
                    ctx.done = True
                    if self.actor_of_env[ctx.env_id] in call.timed_out:
                        self.faults.tag_timeouts[ctx.tag] += 1

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
                  budgets: list[int] | None = None,
                  prompt_seeds: list[int] | None = None) -> list[tuple[list[int], list[float]]]:
        """Split prompts across the engines, generate, keep the order.

        ``budgets[k]`` is prompt k's max new tokens (``sampling.max_tokens`` for all when
        None). Each engine gets one call per distinct budget; call j of engine i samples
        with ``seed + i + j * len(engines)``, so with one budget engine i samples with ``seed + i``.

        An engine that dies mid-turn is restarted by Ray (``max_restarts``) from the
        checkpoint on disk; one that misses ``rollout.generate_timeout_s`` is killed and
        restarted the same way. ``on_engine_restart`` re-syncs the policy weights and the
        turn is generated once more. A second failure raises.

        ``prompt_seeds`` (one per prompt) seeds each request instead (vLLM only): a prompt then
        samples the same tokens whichever prompts share its call (``rollout.mode=async``).
        """
        budgets = budgets or [sampling.max_tokens] * len(prompts)
        calls = []  # (engine, prompt indices, sampling, seed)
        for j, budget in enumerate(sorted(set(budgets))):
            same_budget = [k for k, b in enumerate(budgets) if b == budget]
            for i, chunk in enumerate(np.array_split(same_budget, len(self.engines))):
                if len(chunk):
                    calls.append((self.engines[i], chunk.tolist(), dataclasses.replace(sampling, max_tokens=budget),
                                  seed + i + j * len(self.engines)))
        timeout = self.cfg.actor_rollout_ref.rollout.generate_timeout_s
        for attempt in range(2):
            refs = [engine.generate.remote([prompts[k] for k in chunk], **vars(params), seed=call_seed,
                                           **({} if prompt_seeds is None else
                                              dict(seeds=[prompt_seeds[k] for k in chunk])))
                    for engine, chunk, params, call_seed in calls]
            try:
                outputs = get_or_kill(refs, [c[0] for c in calls], timeout)
                break
            except (RayActorError, ActorUnavailableError, GetTimeoutError) as err:
                if attempt == 1 or self.on_engine_restart is None:
                    raise
                self.engine_failures += 1
                logger.error("rollout engine failed (%s); re-syncing weights into its restart and retrying", err)
                wait_until_ready(self.engines)
                self.on_engine_restart()
        results: list = [None] * len(prompts)
        for (_, chunk, _, _), chunk_outputs in zip(calls, outputs):
            for k, out in zip(chunk, chunk_outputs):
                results[k] = (list(out.token_ids), list(out.logprobs))
        return results

    # -- without a turn barrier (rollout.mode=async) ----------------------------------------
    def _play_without_barrier(self, ctxs: dict[int, EpisodeContext | CondensedEpisode], sampling: SamplingParams,
                              step: int) -> None:
        """The turn loop without a barrier: each group (a :class:`Lane`) runs its own turns.

        A lane's next turn is queued for the engines as soon as its own env step returns;
        whatever lanes are queued while the engines are busy go out together in the next
        ``_generate`` call (so the engines keep their batch full and there is one engine call
        at a time, which keeps ``_generate``'s restart-and-retry as it is). Env steps run in
        threads, one call per lane, at once across lanes and env actors (threaded actors).
        Every episode's sampling is seeded per request by (trainer.seed, split, step, env_id,
        turn) (:func:`episode_seed`), so the batch does not depend on which lanes shared a call.
        The context manager is used from this thread only.
        """
        self.turn_timings = profiling.TurnTimings()
        self._engine_lock = threading.Lock()
        lanes = [lane for lane in self._lanes(ctxs) if self._start_lane_turn(lane, sampling, step)]
        timeout = self.cfg.es_manager.env_step_timeout_s
        self._lanes_now = lanes
        queued, running = list(lanes), {}
        with ThreadPoolExecutor(max_workers=len(lanes) + 1, thread_name_prefix="rollout-lane") as pool:
            while queued or running:
                if queued and not any(kind == "generate" for kind, _ in running.values()):
                    sent = [(lane, lane.active()) for lane in queued if lane.active()]  # (a lost actor's: none)
                    if sent:
                        running[self._submit_generation(pool, sent, sampling, step)] = ("generate", sent)
                    queued = []
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in finished:
                    kind, payload = running.pop(future)
                    if kind == "generate":
                        for lane, stepped, env_inputs in self._take_replies(payload, future.result()):
                            call = pool.submit(self._timed, "env_step", lane.turn, self.env_pool.call, "step",
                                               {lane.actor: env_inputs}, timeout)
                            running[call] = ("step", (lane, stepped))
                    else:
                        lane, stepped = payload
                        self._take_env_outputs(lane, stepped, future.result())
                        lane.turn += 1
                        if self._start_lane_turn(lane, sampling, step):
                            queued.append(lane)

    def _lanes(self, ctxs: dict[int, EpisodeContext | CondensedEpisode]) -> list[Lane]:
        """One lane per group (a group's episodes live on one env actor), in env_id order."""
        by_group: dict[int, Lane] = {}
        for env_id in sorted(ctxs):
            ctx = ctxs[env_id]
            lane = by_group.setdefault(ctx.group_id, Lane(actor=self.actor_of_env[env_id]))
            lane.episodes.append(ctx)
        return list(by_group.values())

    def _start_lane_turn(self, lane: Lane, sampling: SamplingParams, step: int) -> bool:
        """Prepare a lane's next turn (summaries, context overflow); False when the lane is finished."""
        if lane.turn >= self.cfg.agent_proxy.max_turn:
            return False
        if isinstance(self.ctx, CondensedContextManager):  # text a condenser asked the policy for (context only)
            salt = episode_seed(self.cfg.trainer.seed, self.split, step, lane.episodes[0].env_id, lane.turn)
            self.ctx.write_summaries(lane.episodes, lambda prompts, budgets, temperature: self._generate_alone(
                prompts, dataclasses.replace(sampling, temperature=temperature), salt ^ SUMMARY_SEED_SALT,
                budgets=budgets, prompt_seeds=[(salt ^ SUMMARY_SEED_SALT) + k for k in range(len(prompts))]))
        self._end_overflowing(lane.active())
        return bool(lane.active())

    def _end_overflowing(self, episodes) -> None:
        """End (as truncated, ``context_overflow``) each episode whose next prompt leaves no room for its turn."""
        max_model_len = self.cfg.actor_rollout_ref.rollout.max_model_len
        for ctx in episodes:
            if len(self.ctx.prompt_ids(ctx)) + self.turn_budget[ctx.tag] > max_model_len:
                ctx.done = ctx.truncated = ctx.context_overflow = True

    def _request_seeds(self, episodes: list, step: int, turn: int) -> list[int] | None:
        """Each episode's seed for ``turn`` (:func:`episode_seed`), or None when seeding per engine call."""
        if not self.seed_per_request:
            return None
        return [episode_seed(self.cfg.trainer.seed, self.split, step, ctx.env_id, turn) for ctx in episodes]

    def _submit_generation(self, pool: ThreadPoolExecutor, sent: list[tuple[Lane, list]], sampling: SamplingParams,
                           step: int) -> Future:
        """One ``_generate`` call for the given (lane, episodes) pairs, each episode seeded per request."""
        episodes = [ctx for _, ctxs in sent for ctx in ctxs]
        prompts = [self.ctx.prompt_ids(ctx) for ctx in episodes]
        seeds = [seed for lane, ctxs in sent for seed in self._request_seeds(ctxs, step, lane.turn)]
        budgets = [self.turn_budget[ctx.tag] for ctx in episodes]
        turn = min(lane.turn for lane, _ in sent)
        return pool.submit(self._timed, "generate", turn, self._generate_alone, prompts, sampling, seeds[0], budgets,
                           seeds)

    def _generate_alone(self, *args, **kwargs) -> list[tuple[list[int], list[float]]]:
        """``_generate`` while no other lane thread is in it: an engine restart re-syncs the weights once."""
        with self._engine_lock:
            return self._generate(*args, **kwargs)

    def _timed(self, phase: str, turn: int, fn: Callable, *args):
        """``fn(*args)`` (in a lane thread) timed as ``phase`` of ``turn``; lanes overlap, so the phases add
        up to more than the rollout's wall time."""
        with self.turn_timings.phase(phase, turn):
            return fn(*args)

    def _take_replies(self, sent: list[tuple[Lane, list]], generations: list) -> list[tuple[Lane, list, list]]:
        """Append each reply to the episode it was generated for; returns, per lane with an episode still
        active (its actor may have been lost meanwhile), the episodes to step and their env inputs."""
        replies = iter(generations)
        out = []
        for lane, ctxs in sent:
            inputs = []
            for ctx in ctxs:
                ids, logprobs = next(replies)
                self.last_generations[ctx.env_id].append(ids)
                inputs.append(self.ctx.append_reply(ctx, ids, logprobs))
            stepped = [(ctx, env_input) for ctx, env_input in zip(ctxs, inputs) if not ctx.done]
            if stepped:
                out.append((lane, [ctx for ctx, _ in stepped], [env_input for _, env_input in stepped]))
        return out

    def _take_env_outputs(self, lane: Lane, stepped: list, call) -> None:
        """Append the env outputs of a lane's ``stepped`` episodes. When the call lost the lane's actor (died or
        timed out), every active episode of that actor ends where it is, as in the sync loop."""
        self.faults.actor_failures += len(call.failed)
        self.faults.timeouts += len(call.timed_out)
        if call.failed or call.timed_out:
            for ctx in (c for other in self._lanes_now if other.actor == lane.actor for c in other.active()):
                ctx.done = True
                self.faults.tag_timeouts[ctx.tag] += int(bool(call.timed_out))
            return
        by_env = {out.env_id: out for out in call.results}
        for ctx in stepped:
            out = by_env.get(ctx.env_id)
            if ctx.done or out is None:  # ended meanwhile: another lane lost their actor
                ctx.done = True
                continue
            if out.info.get("error"):
                self._log_env_error(out.env_id, "step", out.info["error"])
            self.ctx.append_env_output(ctx, out, self.turn_budget[out.tag])


@dataclass
class Lane:
    """The episodes of one group: they take their turns together, apart from other groups (rollout.mode=async)."""

    actor: int
    """Index of the env actor hosting the group."""
    episodes: list = field(default_factory=list)
    turn: int = 0
    """The lane's next turn (0-based)."""

    def active(self) -> list:
        return [c for c in self.episodes if not c.done]


@dataclass
class RolloutFaults:
    """What went wrong in one rollout, for its metrics (docs/reliability.md)."""

    actor_failures: int = 0
    """Env actor calls that died or raised."""
    timeouts: int = 0
    """Env actor calls that missed their deadline (the actor was replaced)."""
    reset_failures: int = 0
    """Episodes dropped because their reset raised or their actor was lost."""
    tag_timeouts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per env tag: episodes ended by an env actor timeout."""

    def metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/env_actor_failures``, ``env_timeouts``, ``reset_failures`` and ``env/<tag>/timeouts``."""
        env_prefix = "env" if prefix == "rollout" else f"{prefix}/env"
        m = {f"{prefix}/env_actor_failures": float(self.actor_failures),
             f"{prefix}/env_timeouts": float(self.timeouts),
             f"{prefix}/reset_failures": float(self.reset_failures)}
        m.update({f"{env_prefix}/{tag}/timeouts": float(n) for tag, n in self.tag_timeouts.items()})
        return m


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


def trainer_splits(cfg: AgentTrainerConfig) -> tuple[Split, ...]:
    """The splits a training run plays, each with env actors of its own: train; val only when the run validates
    (``trainer.test_freq`` > 0), so a run that never validates starts no val env actors; the greedy baseline split
    when the estimator reads ``reward_baselines`` (ReMax)."""
    return ((Split.TRAIN,) + ((Split.VAL,) if cfg.trainer.test_freq > 0 else ())
            + ((Split.REMAX_BASELINE,) if core_algos.estimator_spec(core_algos.estimator(cfg.algorithm)).greedy_baseline
               else ()))


def split_config(cfg: AgentTrainerConfig, split: Split | str) -> EnvGroupsConfig:
    """The groups a split plays; remax_baseline: the training groups with one episode each."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if split == Split.REMAX_BASELINE:
        return dataclasses.replace(cfg.es_manager.train, group_size=1)
    return cfg.es_manager.train if split == Split.TRAIN else cfg.es_manager.val


def screen_nonfinite(episodes: list, policy: str, describe: Callable[[int], str]) -> tuple[list, int]:
    """Keep the episodes whose total reward is finite; returns them and how many were dropped.

    An episode's total reward is finite exactly when every turn's reward is (a NaN or inf
    anywhere makes the sum NaN or inf). ``policy`` "error" raises naming the first such
    episode (``describe(env_id)``); "drop" leaves them out (all rows of the episode).
    """
    bad = [e for e in episodes if not math.isfinite(e.total_reward)]
    if not bad:
        return episodes, 0
    if policy != "drop":
        raise RuntimeError(
            f"non-finite episode reward {bad[0].total_reward} in {describe(bad[0].env_id)} ({len(bad)} of "
            f"{len(episodes)} episodes); the environment returned it: fix the env's reward, or set "
            "algorithm.nonfinite_reward=drop to leave such episodes out of training")
    kept = [e for e in episodes if math.isfinite(e.total_reward)]
    if not kept:
        raise RuntimeError(f"all {len(episodes)} episodes of the rollout had a non-finite reward (first: "
                           f"{describe(bad[0].env_id)}); nothing is left to train on: fix the env's reward")
    logger.warning("dropped %d episode(s) with a non-finite reward, first: %s", len(bad), describe(bad[0].env_id))
    return kept, len(bad)


def make_context_manager(cfg: AgentTrainerConfig, tokenizer, agent_cls: type[Agent] | None = None) -> Agent:
    """The run's agent (``agent_cls``, else ``agent_proxy.agent_cls``; docs/agents.md), by default the context
    manager of ``ctx_manager.mode``: full (one row per episode) or condensed (one row per turn)."""
    return resolve_agent_cls(cfg, agent_cls).from_config(cfg, tokenizer)


def sampling_seed(base_seed: int, split: Split | str, step: int, turn: int) -> int:
    """The engines' sampling seed for one turn: a pure function of (base seed, split, step, turn)."""
    key = [base_seed, 0 if split == Split.TRAIN else 1, step, turn]
    return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x3FFFFFFF)


def episode_seed(base_seed: int, split: Split | str, step: int, env_id: int, turn: int) -> int:
    """One episode's sampling seed for one turn (``rollout.mode=async``): a pure function of its arguments."""
    key = [base_seed, SPLITS.index(split), step, turn, env_id]
    return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x3FFFFFFF)


def wait_until_ready(actors: list, timeout_s: float = 600.0) -> None:
    """Block until every actor answers (a restarting actor raises ActorUnavailableError until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get([a.__ray_ready__.remote() for a in actors])
            return
        except (ActorUnavailableError, RayActorError):  # restarting (a killed actor may still be dying)
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def rollout_metrics(episodes: list[EpisodeContext | CondensedEpisode], states: list[dict],
                    prefix: str) -> dict[str, float]:
    """Episode-level metrics: success, reward, turns, lengths, format errors; per-tag env metrics.

    ``sequence_length_mean`` is the mean over episodes of the longest training
    row: the whole episode in full mode, one turn's prompt + reply in condensed mode.
    """
    m: dict[str, float] = {}
    rewards = [e.total_reward for e in episodes]
    gen_lens = [e.num_generated_tokens for e in episodes]
    turns = [e.num_turns for e in episodes]
    m[f"{prefix}/episode_reward_mean"] = float(np.mean(rewards))
    m[f"{prefix}/episode_reward_max"] = float(np.max(rewards))
    m[f"{prefix}/num_turns_mean"] = float(np.mean(turns))
    m[f"{prefix}/response_length_mean"] = float(np.mean(gen_lens)) / max(1.0, float(np.mean(turns)))
    m[f"{prefix}/sequence_length_mean"] = float(np.mean([e.longest_row for e in episodes]))
    m[f"{prefix}/truncated_rate"] = float(np.mean([e.truncated for e in episodes]))
    m[f"{prefix}/context_overflow_rate"] = float(np.mean([e.context_overflow for e in episodes]))
    m[f"{prefix}/format_error_rate"] = float(sum(e.format_errors for e in episodes) / max(1, sum(turns)))
    success = [bool(s.get("metrics", {}).get("success", False)) for s in states]
    m[f"{prefix}/success_rate"] = float(np.mean(success)) if success else 0.0
    by_tag: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in states:
        for key, value in s.get("metrics", {}).items():
            if isinstance(value, (bool, int, float)):
                by_tag[s["tag"]][key].append(float(value))
    env_prefix = "env" if prefix == "rollout" else f"{prefix}/env"
    for tag, values in by_tag.items():
        for key, vals in values.items():
            m[f"{env_prefix}/{tag}/{key}"] = float(np.mean(vals))
    return m
