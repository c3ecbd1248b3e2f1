"""``MultiTurnRollout`` (``SyncMultiTurnRollout``): one split's episodes played against the policy's engines.

It holds what lives across rollouts (the agent, the env actors and their episodes, the seed counter, the logged
errors) and hands one rollout's work to its parts: the resets (:mod:`.resets`), a turn loop (:mod:`.turns`, or
:mod:`.lanes` without a turn barrier), the engines (:mod:`.engines`) and the result (:mod:`.results`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from agent_trainer.agents.base import Agent
from agent_trainer.agents.registry import resolve_agent_cls
from agent_trainer.config import AgentTrainerConfig, split_config
from agent_trainer.config.splits import Split
from agent_trainer.rollout.env_pool import EnvActorPool
from agent_trainer.episode.es_manager import EpisodeSpec, plan_episodes
from agent_trainer.rollout.engines import EngineCalls, WaitingCall, generate
from agent_trainer.rollout.lanes import BarrierFreeLoop
from agent_trainer.rollout.resets import EnvResets
from agent_trainer.rollout.results import RolloutFaults, RolloutResult, assemble, check_env_errors
from agent_trainer.rollout.splits import SamplingParams, sampling_params
from agent_trainer.rollout.turns import TurnLoop
from envs.registry import normalize_tags

logger = logging.getLogger(__name__)


class MultiTurnRollout:
    """Plays one split's episodes (:data:`~agent_trainer.rollout.splits.SPLITS`) against the policy's rollout
    engines, turn-synchronously (:class:`~agent_trainer.rollout.turns.TurnLoop`) or, with
    ``rollout.mode=async``, without a barrier between turns (:class:`~agent_trainer.rollout.lanes.BarrierFreeLoop`).

    ``engines`` are Ray actor handles exposing ``generate(prompts, **sampling)``
    (``agent_trainer.workers.rollout``); ``env_worker_cls`` is the ``ray.remote`` env-state
    manager (``agent_trainer.workers.env_worker.EnvWorker``), of which ``num_env_actors``
    are started, each hosting a contiguous shard of episodes.

    Each turn of an episode generates at most ``min(max_tokens of its env tag,
    actor_rollout_ref.rollout.response_length)`` tokens (:attr:`turn_budget`): the tag's
    ``max_tokens`` is its per-turn budget, ``response_length`` the global cap (verl/RAGEN).
    """

    concurrent_env_steps = False
    """Steps of several episodes of one env actor may run at once (threaded env actors); ``rollout.mode=async``
    turns it on too."""

    def __init__(self, cfg: AgentTrainerConfig, tokenizer, engines: list, env_worker_cls, env_tags: dict,
                 split: Split | str = Split.TRAIN, num_env_actors: int = 2,
                 on_engine_restart: Callable[[], object] | None = None, agent_cls: type[Agent] | None = None,
                 label: str | None = None):
        self.cfg = cfg
        self.split_cfg = split_config(cfg, split)
        self.split = Split(split)
        self.label = label or str(self.split)
        """How error messages and Ray name this rollout's env actors (``env actor 0 (train)``, ``env_train_0``);
        a further rollout of the same split running at once has its own (``train-2``:
        ``trainer.rollouts_in_flight``)."""
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
        """``rollout.mode=async``: no turn barrier (:class:`~agent_trainer.rollout.lanes.BarrierFreeLoop`)."""
        self.seed_per_request = self.barrier_free
        """Seed each episode's turn on its own (``episode_seed``); ``rollout.mode=async`` needs it, and
        either turn loop then samples the same episodes. Off: one seed per engine call (``sampling_seed``)."""
        self.episodes: list[EpisodeSpec] = plan_episodes(self.split_cfg)
        # Whole groups per actor, so pass@group and group seeds stay local to one actor.
        group_shards = np.array_split(np.arange(self.split_cfg.env_groups), max(1, num_env_actors))
        shards = [[i for i, e in enumerate(self.episodes) if e.group_id in set(g.tolist())] for g in group_shards]
        shards = [s for s in shards if s]
        es = cfg.es_manager
        self.env_pool = EnvActorPool(
            env_worker_cls, self.label, [[self.episodes[i] for i in shard] for shard in shards],
            dict(tags=env_tags, format_penalty=es.format_penalty, action_sep=es.action_sep,
                 max_actions_per_turn=es.max_actions_per_turn, max_observation_chars=es.max_observation_chars),
            max_concurrency=max(len(g) for g in group_shards) if self.barrier_free or self.concurrent_env_steps else 1)
        self.actor_of_env = {int(self.episodes[i].env_id): a for a, shard in enumerate(shards) for i in shard}
        """env_id -> index of the env actor hosting it."""
        self.resets = EnvResets(cfg, self.split, self.split_cfg.env_groups, self.env_pool, self.episodes,
                                self.actor_of_env, self.describe_episode, self.log_env_error)
        """The split's env resets, its seed counter and the prefetched next reset."""
        self.logged_errors: set[tuple[str, str]] = set()
        """(env tag, exception type) pairs already logged with their text: each is logged once per run."""
        self.last_generations: dict[int, list[list[int]]] = defaultdict(list)
        """The engine's raw token ids per episode and turn in the last rollout (for checks and debugging)."""
        self.faults = RolloutFaults()
        """What went wrong in the last (or the running) rollout."""
        self.engine_version: Callable[[], int] | None = None
        """Set by the trainer when it counts policy versions: the version the engines hold. Read after each engine
        call, it tags the call's tokens (:attr:`last_versions`, the batch's ``token_versions``)."""
        self.in_flight_sync: Callable[[], object] | None = None
        """``trainer.async_mode=continuous``: called before each engine call, a safe point (no call of this rollout
        in flight), to bring the engines to the actor's newest weights; the episodes go on under them."""
        self.last_versions: dict[int, list[int]] = defaultdict(list)
        """With :attr:`engine_version`: the policy version of each episode's turns in the last rollout (one per
        entry of :attr:`last_generations`)."""
        self.engine_calls = EngineCalls()
        """The engines as this rollout shares them (:class:`~agent_trainer.rollout.engines.EngineCalls`): one call
        at a time. Rollouts that run at once (``trainer.rollouts_in_flight``) share one, so a weight sync at a safe
        point finds no call of any of them in flight, and their waiting calls go to the engines together."""
        self.engine_call_counts = [0, 0]
        """Engine calls of the last (or the running) rollout, and those of them shared with another rollout."""

    @property
    def num_resets(self) -> int:
        """Resets this split's rollouts have used: the env seed counter a checkpoint saves and a resume sets."""
        return self.resets.num_resets

    @num_resets.setter
    def num_resets(self, value: int) -> None:
        self.resets.num_resets = value

    @property
    def env_actors(self) -> list:
        """The live env actor handles (a replaced actor's handle is swapped for its replacement's)."""
        return self.env_pool.actors

    def named_actors(self) -> dict[str, list]:
        """The rollout's own Ray actors by the name an error message gives them (``env actor 0 (train)``)."""
        return {f"env actor {i} ({self.label})": [a] for i, a in enumerate(self.env_actors)}

    def sampling_params(self) -> SamplingParams:
        """Training sampling, the ``val_kwargs`` for the val split, greedy for the ReMax baseline."""
        return sampling_params(self.cfg, self.split)

    def next_group_seeds(self) -> list[int]:
        """The split's seeds for its next reset (``es_manager.group_seeds``), counted as used."""
        return self.resets.next_group_seeds()

    def describe_episode(self, env_id: int, seeds: list[int] | None = None) -> str:
        """Where an episode came from: tag, env_id, group and group seed (``seeds``: its rollout's group seeds,
        ``batch.meta.group_seeds``; default: the last rollout's, which a prefetched rollout has replaced)."""
        spec = next((e for e in self.episodes if e.env_id == env_id), None)
        if spec is None:
            return f"env_id {env_id} ({self.split} split)"
        seeds = self.resets.last_seeds if seeds is None else seeds
        seed = seeds[spec.group_id] if spec.group_id < len(seeds) else "unknown"
        return f"env tag {spec.tag!r}, env_id {env_id}, group {spec.group_id} (group seed {seed}), {self.split} split"

    def rollout(self, step: int = 0, seeds: list[int] | None = None) -> RolloutResult:
        """Play every episode of the split once; return the batch and metrics.

        ``step`` (the trainer's global step) seeds the engines' sampling together with
        ``trainer.seed``, each turn afresh (``sampling_seed``), so the same step of a
        resumed run samples what the uninterrupted run sampled. ``seeds`` (one per group)
        replays given initial states instead of the split's next ones: the remax_baseline
        split replays the training rollout's ``group_seeds``.

        An episode whose total reward is not finite stops the rollout with an error naming
        it, or is left out of the batch and counted in ``<prefix>/nonfinite_dropped``
        (``algorithm.nonfinite_reward`` = error | drop). Episodes whose reset failed, and
        episodes whose first prompt already overflows ``max_model_len``, have no turn to
        train on and are left out too (``<prefix>/reset_failures``, ``<prefix>/context_overflow_rate``).
        """
        self.resets.cfg = self.cfg  # the config as it is now (a caller may have swapped it since the last rollout)
        seeds = self.next_group_seeds() if seeds is None else list(seeds)
        sampling = self.sampling_params()
        self.last_generations, self.last_versions = defaultdict(list), defaultdict(list)
        faults = self.faults = RolloutFaults()
        self.engine_call_counts = [0, 0]
        ctxs = {out.env_id: self.ctx.start(out) for out in self.resets.reset(seeds, faults)}
        loop = self.make_loop(sampling, step, faults)
        with self.engine_calls.play():
            loop.play(ctxs)
        call = self.env_pool.call("get_rollout_states", {i: None for i in range(len(self.env_actors))},
                                  self.cfg.es_manager.env_reset_timeout_s)
        faults.count_call(call)
        if self.resets.prefetch and step < self.cfg.trainer.total_training_steps:
            self.resets.start_next()  # the env actors reset while the batch is built and the step trains
        states = [s for s in call.results if s.env_id in ctxs]
        check_env_errors(states, self.cfg.es_manager.max_env_error_fraction, self.split, self.describe_episode)
        return assemble(self.cfg, self.ctx, self.split, ctxs, states, seeds=seeds, temperature=sampling.temperature,
                        faults=faults, reset_prefetched=self.resets.was_prefetched,
                        generations=self.last_generations, timings=loop.timings, describe=self.describe_episode,
                        num_episodes=len(self.episodes),
                        versions=self.last_versions if self.engine_version is not None else None)

    def make_loop(self, sampling: SamplingParams, step: int, faults: RolloutFaults) -> TurnLoop:
        """The loop that plays one rollout's turns: with a barrier between turns, or without (rollout.mode=async)."""
        return (BarrierFreeLoop if self.barrier_free else TurnLoop)(self, sampling, step, faults)

    def close(self) -> None:
        """Release what the rollout started besides its env actors (the gateway rollout's HTTP server)."""

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
                  budgets: list[int] | None = None,
                  prompt_seeds: list[int] | None = None) -> Generations:
        """One turn on the engines (:func:`~agent_trainer.rollout.engines.generate`); a failed engine call counts in
        ``<prefix>/engine_failures``. The turn loops call it through this method (a test may wrap it), one call at
        a time (:attr:`engine_calls`; with rollouts in flight, requests seeded per prompt may share a call with
        theirs): before it the engines may take new weights (:attr:`in_flight_sync`), and its result carries the
        version that generated it (:attr:`engine_version`; an engine restarted mid-call is re-synced before the
        call is repeated, so the version read after it is the one that generated)."""
        request = WaitingCall(self, prompts, sampling, seed, budgets or [sampling.max_tokens] * len(prompts),
                              prompt_seeds)
        outputs = self.engine_calls.call(request, self._send)
        self.engine_call_counts[0] += 1
        self.engine_call_counts[1] += int(request.shared)
        return outputs

    def _send(self, requests: list[WaitingCall]) -> list[Generations]:
        """One engine call for ``requests`` (this rollout's first, then those that joined it), under the engine
        lock: each request's outputs, all with the version that generated them."""
        def count_failure():
            for owner in {id(r.owner): r.owner for r in requests}.values():
                owner.faults.engine_failures += 1

        if self.in_flight_sync is not None:
            self.in_flight_sync()
        first = requests[0]
        seeds = None if first.prompt_seeds is None else [s for r in requests for s in r.prompt_seeds]
        out = generate(self.engines, [p for r in requests for p in r.prompts], first.sampling, first.seed,
                       self.cfg.actor_rollout_ref.rollout.generate_timeout_s, self.on_engine_restart,
                       count_failure, budgets=[b for r in requests for b in r.budgets], prompt_seeds=seeds)
        version = None if self.engine_version is None else self.engine_version()
        outputs, start = [], 0
        for r in requests:
            outputs.append(Generations(out[start:start + len(r.prompts)], version))
            start += len(r.prompts)
        return outputs

    def log_env_error(self, env_id: int, method: str, error: str) -> None:
        """Log an environment's error with its text, once per (tag, exception type) per run."""
        tag = self.episodes[[e.env_id for e in self.episodes].index(env_id)].tag
        key = (tag, error.split(":", 1)[0])
        if key not in self.logged_errors:
            self.logged_errors.add(key)
            logger.error("environment %s failed in %s (%s; logged once per tag and error type): %s", tag, method,
                         self.describe_episode(env_id), error)


class Generations(list):
    """One engine call's (token ids, log-probs) per prompt, in order, and the policy ``version`` that generated
    them (None when the run does not count versions)."""

    def __init__(self, outputs: list[tuple[list[int], list[float]]], version: int | None = None):
        super().__init__(outputs)
        self.version = version


def make_context_manager(cfg: AgentTrainerConfig, tokenizer, agent_cls: type[Agent] | None = None) -> Agent:
    """The run's agent (``agent_cls``, else ``agent_proxy.agent_cls``; docs/agents.md), by default the context
    manager of ``ctx_manager.mode``: full (one row per episode) or condensed (one row per turn)."""
    return resolve_agent_cls(cfg, agent_cls).from_config(cfg, tokenizer)
