"""The turn-synchronous loop (:class:`TurnLoop`): every active episode's turn generated in one engine call, then
every env stepped, turn after turn; and the steps both turn loops share (context overflow, per-request seeds,
env outputs)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from agent_trainer.common import profiling
from agent_trainer.agents.condensed_ctx import CondensedEpisode
from agent_trainer.agents.ctx_manager import EpisodeContext
from agent_trainer.episode.es_manager import EnvInput, EnvOutput
from agent_trainer.rollout.results import RolloutFaults
from agent_trainer.rollout.splits import SUMMARY_SEED_SALT, SamplingParams, episode_seed, sampling_seed


class TurnLoop:
    """One rollout's turns, with a barrier between them (``rollout.mode=sync``).

    ``rollout`` is the :class:`~agent_trainer.rollout.MultiTurnRollout` playing: its agent (``ctx``), config,
    split, engines (``_generate``), env actors and turn budgets, read at each use (a test may swap the agent).
    Faults go to ``faults``; each phase's time to :attr:`timings`.
    """

    def __init__(self, rollout, sampling: SamplingParams, step: int, faults: RolloutFaults):
        self.rollout, self.sampling, self.step, self.faults = rollout, sampling, step, faults
        self.timings = profiling.TurnTimings()

    def play(self, ctxs: dict[int, EpisodeContext | CondensedEpisode]) -> None:
        """Generate for every active episode, step the envs, until every episode is done or ``max_turn``."""
        r, cfg = self.rollout, self.rollout.cfg
        for turn in range(cfg.agent_proxy.max_turn):
            seed = sampling_seed(cfg.trainer.seed, r.split, self.step, turn)
            # text the agent asks the policy for (context only; a condenser's summaries)
            r.ctx.write_summaries(ctxs.values(), lambda prompts, budgets, temperature: r._generate(
                prompts, dataclasses.replace(self.sampling, temperature=temperature), seed ^ SUMMARY_SEED_SALT,
                budgets=budgets))
            self.end_overflowing(c for c in ctxs.values() if not c.done)
            active = [c for c in ctxs.values() if not c.done]
            if not active:
                break
            with self.timings.phase("generate", turn):
                generations = r._generate([r.ctx.prompt_ids(c) for c in active], self.sampling, seed,
                                          budgets=[r.turn_budget[c.tag] for c in active],
                                          prompt_seeds=self.request_seeds(active, turn))
            inputs_by_actor: dict = defaultdict(list)
            for ctx, (ids, logprobs) in zip(active, generations):
                inputs_by_actor[r.actor_of_env[ctx.env_id]].append(
                    self.append_reply(ctx, ids, logprobs, getattr(generations, "version", None)))
            with self.timings.phase("env_step", turn):
                call = r.env_pool.call("step", inputs_by_actor, cfg.es_manager.env_step_timeout_s)
            self.faults.count_call(call)
            for out in call.results:
                self.append_env_output(ctxs[out.env_id], out)
            stepped = {out.env_id for out in call.results}
            for ctx in active:  # episodes whose actor failed or timed out end here, left out of the batch
                if ctx.env_id not in stepped:
                    ctx.done = ctx.env_actor_lost = True
                    if r.actor_of_env[ctx.env_id] in call.timed_out:
                        self.faults.tag_timeouts[ctx.tag] += 1

    # -- the steps both turn loops share ---------------------------------------------------
    def end_overflowing(self, episodes) -> None:
        """End (as truncated, ``context_overflow``) each episode whose next prompt leaves no room for its turn."""
        r = self.rollout
        max_model_len = r.cfg.actor_rollout_ref.rollout.max_model_len
        for ctx in episodes:
            if len(r.ctx.prompt_ids(ctx)) + r.turn_budget[ctx.tag] > max_model_len:
                ctx.done = ctx.truncated = ctx.context_overflow = True

    def request_seeds(self, episodes: list, turn: int) -> list[int] | None:
        """Each episode's seed for ``turn`` (:func:`episode_seed`), or None when seeding per engine call."""
        if not self.rollout.seed_per_request:
            return None
        return [self.seed_of(ctx, turn) for ctx in episodes]

    def seed_of(self, ctx: EpisodeContext | CondensedEpisode, turn: int) -> int:
        """An episode's sampling seed for ``turn``: a pure function of the run's seed, the split, the step, the
        episode and the turn (:func:`episode_seed`)."""
        r = self.rollout
        return episode_seed(r.cfg.trainer.seed, r.split, self.step, ctx.env_id, turn)

    def append_reply(self, ctx: EpisodeContext | CondensedEpisode, ids: list[int], logprobs: list[float],
                     version: int | None = None) -> EnvInput:
        """Record the engine's reply (``last_generations``) and the policy version that generated it
        (``last_versions``), and hand it to the agent; returns the env's input."""
        self.rollout.last_generations[ctx.env_id].append(ids)
        if version is not None:
            self.rollout.last_versions[ctx.env_id].append(version)
        return self.rollout.ctx.append_reply(ctx, ids, logprobs)

    def append_env_output(self, ctx: EpisodeContext | CondensedEpisode, out: EnvOutput) -> None:
        """Hand an env step's output to the agent; an environment's error is logged once per tag and type."""
        if out.info.get("error"):
            self.rollout.log_env_error(out.env_id, "step", out.info["error"])
        self.rollout.ctx.append_env_output(ctx, out, self.rollout.turn_budget[out.tag])
