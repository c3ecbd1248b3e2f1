"""``SyncMultiTurnRollout``: episodes fanned out to Ray env actors and rollout engines.

One call to :meth:`SyncMultiTurnRollout.rollout` plays ``env_groups x
group_size`` episodes for up to ``agent_proxy.max_turn`` turns and returns
one training batch plus metrics::

    reset env actors (one seed per group)
    for turn in 1..max_turn, while any episode is active:
        prompts  <- ctx_manager: token ids of each active episode's next turn
        outputs  <- rollout engines: generate(token ids) -> token ids + logprobs
        env actors: parse <answer>, step env, reward, done
    batch    <- ctx_manager.build_update_batch()

``ctx_manager.mode`` picks the layout: ``full`` (one growing sequence and one
row per episode, ``agent_trainer.ctx_manager``) or ``condensed`` (a fresh
prompt per turn and one row per turn, ``agent_trainer.condensed_ctx``).

A failing env actor is reported (``rollout/env_actor_failures``) and its
episodes end where they are; the rollout goes on with the others. Ray
restarts the actor (``max_restarts``), so the next reset finds it again.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from agent_trainer.batch import TensorBatch
from agent_trainer.condensed_ctx import CondensedContextManager, CondensedEpisode
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.ctx_manager import ContextManager, EpisodeContext
from agent_trainer.es_manager import EnvInput, EnvOutput, EpisodeSpec, group_seeds, plan_episodes

logger = logging.getLogger(__name__)


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


class SyncMultiTurnRollout:
    """Plays one split's (train or val) episodes against the policy's rollout engines.

    ``engines`` are Ray actor handles exposing ``generate(prompts, **sampling)``
    (``workers.rollout``); ``env_worker_cls`` is the ``ray.remote`` env-state
    manager (``workers.env_worker.EnvWorker``), of which ``num_env_actors``
    are started, each hosting a contiguous shard of episodes.
    """

    def __init__(self, cfg: AgentTrainerConfig, tokenizer, engines: list, env_worker_cls, env_tags: dict,
                 split: str = "train", num_env_actors: int = 2, on_engine_restart: Callable[[], object] | None = None):
        self.cfg = cfg
        self.split = split
        self.engines = engines
        self.on_engine_restart = on_engine_restart
        """Called after an engine died (Ray restarts it from the checkpoint on disk): re-sync the weights."""
        self.split_cfg = cfg.es_manager.train if split == "train" else cfg.es_manager.val
        self.ctx = make_context_manager(cfg, tokenizer)
        self.episodes: list[EpisodeSpec] = plan_episodes(self.split_cfg)
        # Whole groups per actor, so pass@group and group seeds stay local to one actor.
        group_shards = np.array_split(np.arange(self.split_cfg.env_groups), max(1, num_env_actors))
        shards = [[i for i, e in enumerate(self.episodes) if e.group_id in set(g.tolist())] for g in group_shards]
        shards = [s for s in shards if s]
        self.env_actors = [
            env_worker_cls.remote(
                tags=env_tags,
                episodes=[self.episodes[i] for i in shard],
                format_penalty=cfg.es_manager.format_penalty,
                action_sep=cfg.es_manager.action_sep,
                max_actions_per_turn=cfg.es_manager.max_actions_per_turn,
            )
            for shard in shards
        ]
        self.actor_of_env = {int(self.episodes[i].env_id): a for a, shard in zip(self.env_actors, shards) for i in shard}
        self.num_resets = 0
        self.last_generations: dict[int, list[list[int]]] = defaultdict(list)
        """The engine's raw token ids per episode and turn in the last rollout (for checks and debugging)."""

    def sampling_params(self) -> SamplingParams:
        """Training sampling, or the greedy ``val_kwargs`` for the val split."""
        r = self.cfg.actor_rollout_ref.rollout
        if self.split == "train":
            return SamplingParams(max_tokens=r.response_length, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        return SamplingParams(max_tokens=r.response_length, temperature=r.val_kwargs.temperature,
                              top_p=r.val_kwargs.top_p)

    # -- the turn loop -------------------------------------------------------------------
    def rollout(self) -> RolloutResult:
        """Play every episode of the split once; return the batch and metrics."""
        sampling = self.sampling_params()
        seeds = group_seeds(self.split, self.split_cfg.env_groups, self.num_resets, self.cfg.es_manager.seed)
        self.num_resets += 1
        failures = 0
        self.engine_failures = 0
        self.last_generations = defaultdict(list)
        ctxs: dict[int, EpisodeContext | CondensedEpisode] = {}
        group_seed_map = dict(enumerate(seeds))
        reset_outputs, failed = self._call_env_actors("reset", {a: group_seed_map for a in self.env_actors})
        failures += len(failed)
        if failed:  # Ray restarts a dead env actor (max_restarts); its episodes start again there
            retried, still_failed = self._call_env_actors("reset", {a: group_seed_map for a in failed})
            reset_outputs += retried
            if still_failed:
                raise RuntimeError(f"{len(still_failed)} env actor(s) failed to reset twice; see the errors above")
        for out in reset_outputs:
            ctxs[out.env_id] = self.ctx.start(out)

        for _ in range(self.cfg.agent_proxy.max_turn):
            active = [c for c in ctxs.values() if not c.done]
            if not active:
                break
            generations = self._generate([self.ctx.prompt_ids(c) for c in active], sampling)
            inputs_by_actor: dict = defaultdict(list)
            for ctx, (ids, logprobs) in zip(active, generations):
                self.last_generations[ctx.env_id].append(ids)
                env_input: EnvInput = self.ctx.append_reply(ctx, ids, logprobs)
                inputs_by_actor[self.actor_of_env[ctx.env_id]].append(env_input)
            outputs, failed = self._call_env_actors("step", inputs_by_actor)
            failures += len(failed)
            stepped = set()
            for out in outputs:
                self.ctx.append_env_output(ctxs[out.env_id], out, sampling.max_tokens)
                stepped.add(out.env_id)
            for ctx in active:  # episodes whose actor failed end here
                if ctx.env_id not in stepped:
                    ctx.done = True

        states, failed = self._call_env_actors("get_rollout_states", {a: None for a in self.env_actors})
        failures += len(failed)
        episodes = [ctxs[k] for k in sorted(ctxs)]
        batch = self.ctx.build_update_batch(episodes)
        batch.meta["temperature"] = sampling.temperature if sampling.temperature > 0 else 1.0
        prefix = "rollout" if self.split == "train" else "val"
        metrics = rollout_metrics(episodes, states, prefix=prefix)
        metrics[f"{prefix}/env_actor_failures"] = float(failures)
        metrics[f"{prefix}/engine_failures"] = float(self.engine_failures)
        return RolloutResult(batch=batch, metrics=metrics, states=states)

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[tuple[list[int], list[float]]]:
        """Split prompts across the engines, generate, keep the order.

        An engine that dies mid-turn is restarted by Ray (``max_restarts``) from
        the checkpoint on disk; ``on_engine_restart`` re-syncs the policy weights
        and the turn is generated once more. A second failure raises.
        """
        chunks = [c for c in np.array_split(np.arange(len(prompts)), len(self.engines)) if len(c)]
        for attempt in range(2):
            refs = [engine.generate.remote([prompts[i] for i in chunk], **vars(sampling))
                    for engine, chunk in zip(self.engines, chunks)]
            try:
                outputs = ray.get(refs)
                break
            except RayActorError as err:
                if attempt == 1 or self.on_engine_restart is None:
                    raise
                self.engine_failures += 1
                logger.error("rollout engine failed (%s); re-syncing weights into its restart and retrying", err)
                wait_until_ready(self.engines)
                self.on_engine_restart()
        return [(list(o.token_ids), list(o.logprobs)) for chunk_outputs in outputs for o in chunk_outputs]

    def _call_env_actors(self, method: str, args_by_actor: dict) -> tuple[list, list]:
        """Call ``method`` on several env actors at once; return the results and the actors that failed.

        A dead actor is logged and reported, not raised: its episodes end where they are.
        """
        refs = {a: (getattr(a, method).remote() if arg is None else getattr(a, method).remote(arg))
                for a, arg in args_by_actor.items()}
        results: list = []
        failed: list = []
        for actor, ref in refs.items():
            try:
                results.extend(ray.get(ref))
            except (RayActorError, RayTaskError) as err:
                failed.append(actor)
                logger.error("env actor %s failed in %s: %s", actor, method, err)
        return results, failed


def make_context_manager(cfg: AgentTrainerConfig, tokenizer) -> ContextManager:
    """The context manager of ``ctx_manager.mode``: full (one row per episode) or condensed (one row per turn)."""
    common = dict(enable_think=cfg.agent_proxy.enable_think, action_sep=cfg.es_manager.action_sep,
                  max_model_len=cfg.actor_rollout_ref.rollout.max_model_len)
    if cfg.ctx_manager.mode == "condensed":
        return CondensedContextManager(tokenizer, keep_last_n_turns=cfg.ctx_manager.keep_last_n_turns, **common)
    return ContextManager(tokenizer, **common)


def wait_until_ready(actors: list, timeout_s: float = 600.0) -> None:
    """Block until every actor answers (a restarting actor raises ActorUnavailableError until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get([a.__ray_ready__.remote() for a in actors])
            return
        except ActorUnavailableError:
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
    m[f"{prefix}/format_error_rate"] = float(sum(e.format_errors for e in episodes) / max(1, sum(turns)))
    success = [bool(s.get("metrics", {}).get("success", False)) for s in states]
    m[f"{prefix}/success_rate"] = float(np.mean(success)) if success else 0.0
    by_tag: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in states:
        for key, value in s.get("metrics", {}).items():
            if isinstance(value, (bool, int, float)):
                by_tag[s["tag"]][key].append(float(value))
    env_prefix = "env" if prefix == "rollout" else "val/env"
    for tag, values in by_tag.items():
        for key, vals in values.items():
            m[f"{env_prefix}/{tag}/{key}"] = float(np.mean(vals))
    return m
