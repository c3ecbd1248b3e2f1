"""The turn loop without a barrier (``rollout.mode=async``, :class:`BarrierFreeLoop`): each group is a
:class:`Lane` that takes its next turn as soon as its own env step returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from agent_trainer.agents.condensed_ctx import CondensedEpisode
from agent_trainer.agents.ctx_manager import EpisodeContext
from agent_trainer.rollout.splits import SUMMARY_SEED_SALT
from agent_trainer.rollout.turns import TurnLoop


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


class BarrierFreeLoop(TurnLoop):
    """The turn loop without a barrier: each group (a :class:`Lane`) runs its own turns.

    A lane's next turn is queued for the engines as soon as its own env step returns;
    whatever lanes are queued while the engines are busy go out together in the next
    ``_generate`` call (so the engines keep their batch full and there is one engine call
    at a time, which keeps ``_generate``'s restart-and-retry as it is). Env steps run in
    threads, one call per lane, at once across lanes and env actors (threaded actors).
    Every episode's sampling is seeded per request by (trainer.seed, split, step, env_id,
    turn) (:func:`~agent_trainer.rollout.splits.episode_seed`), so the batch does not depend on which lanes
    shared a call. The context manager is used from this thread only.
    """

    def play(self, ctxs: dict[int, EpisodeContext | CondensedEpisode]) -> None:
        lanes = [lane for lane in self.lanes(ctxs) if self.start_lane_turn(lane)]
        timeout = self.rollout.cfg.es_manager.env_step_timeout_s
        self._lanes_now = lanes
        queued, running = list(lanes), {}
        with ThreadPoolExecutor(max_workers=len(lanes) + 1, thread_name_prefix="rollout-lane") as pool:
            while queued or running:
                if queued and not any(kind == "generate" for kind, _ in running.values()):
                    sent = [(lane, lane.active()) for lane in queued if lane.active()]  # (a lost actor's: none)
                    if sent:
                        running[self.submit_generation(pool, sent)] = ("generate", sent)
                    queued = []
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in finished:
                    kind, payload = running.pop(future)
                    if kind == "generate":
                        for lane, stepped, env_inputs in self.take_replies(payload, future.result()):
                            call = pool.submit(self.timed, "env_step", lane.turn, self.rollout.env_pool.call, "step",
                                               {lane.actor: env_inputs}, timeout)
                            running[call] = ("step", (lane, stepped))
                    else:
                        lane, stepped = payload
                        self.take_env_outputs(lane, stepped, future.result())
                        lane.turn += 1
                        if self.start_lane_turn(lane):
                            queued.append(lane)

    def lanes(self, ctxs: dict[int, EpisodeContext | CondensedEpisode]) -> list[Lane]:
        """One lane per group (a group's episodes live on one env actor), in env_id order."""
        by_group: dict[int, Lane] = {}
        for env_id in sorted(ctxs):
            ctx = ctxs[env_id]
            lane = by_group.setdefault(ctx.group_id, Lane(actor=self.rollout.actor_of_env[env_id]))
            lane.episodes.append(ctx)
        return list(by_group.values())

    def start_lane_turn(self, lane: Lane) -> bool:
        """Prepare a lane's next turn (summaries, context overflow); False when the lane is finished."""
        r = self.rollout
        if lane.turn >= r.cfg.agent_proxy.max_turn:
            return False
        # text the agent asks the policy for (context only; a condenser's summaries)
        salt = self.seed_of(lane.episodes[0], lane.turn)
        r.ctx.write_summaries(lane.episodes, lambda prompts, budgets, temperature: self.generate_alone(
            prompts, dataclasses.replace(self.sampling, temperature=temperature), salt ^ SUMMARY_SEED_SALT,
            budgets=budgets, prompt_seeds=[(salt ^ SUMMARY_SEED_SALT) + k for k in range(len(prompts))]))
        self.end_overflowing(lane.active())
        return bool(lane.active())

    def submit_generation(self, pool: ThreadPoolExecutor, sent: list[tuple[Lane, list]]) -> Future:
        """One ``_generate`` call for the given (lane, episodes) pairs, each episode seeded per request."""
        r = self.rollout
        episodes = [ctx for _, ctxs in sent for ctx in ctxs]
        prompts = [r.ctx.prompt_ids(ctx) for ctx in episodes]
        seeds = [seed for lane, ctxs in sent for seed in self.request_seeds(ctxs, lane.turn)]
        budgets = [r.turn_budget[ctx.tag] for ctx in episodes]
        turn = min(lane.turn for lane, _ in sent)
        return pool.submit(self.timed, "generate", turn, self.generate_alone, prompts, self.sampling, seeds[0],
                           budgets, seeds)

    def generate_alone(self, *args, **kwargs) -> list[tuple[list[int], list[float]]]:
        """``_generate``, one call at a time (the rollout's ``engine_calls``): an engine restart re-syncs the
        weights once."""
        return self.rollout._generate(*args, **kwargs)

    def timed(self, phase: str, turn: int, fn: Callable, *args):
        """``fn(*args)`` (in a lane thread) timed as ``phase`` of ``turn``; lanes overlap, so the phases add
        up to more than the rollout's wall time."""
        with self.timings.phase(phase, turn):
            return fn(*args)

    def take_replies(self, sent: list[tuple[Lane, list]], generations: list) -> list[tuple[Lane, list, list]]:
        """Append each reply to the episode it was generated for; returns, per lane with an episode still
        active (its actor may have been lost meanwhile), the episodes to step and their env inputs."""
        replies = iter(generations)
        out = []
        for lane, ctxs in sent:
            inputs = []
            for ctx in ctxs:
                ids, logprobs = next(replies)
                inputs.append(self.append_reply(ctx, ids, logprobs, getattr(generations, "version", None)))
            stepped = [(ctx, env_input) for ctx, env_input in zip(ctxs, inputs) if not ctx.done]
            if stepped:
                out.append((lane, [ctx for ctx, _ in stepped], [env_input for _, env_input in stepped]))
        return out

    def take_env_outputs(self, lane: Lane, stepped: list, call) -> None:
        """Append the env outputs of a lane's ``stepped`` episodes. When the call lost the lane's actor (died or
        timed out), every active episode of that actor ends where it is, as in the sync loop."""
        self.faults.count_call(call)
        if call.failed or call.timed_out:
            for ctx in (c for other in self._lanes_now if other.actor == lane.actor for c in other.active()):
                ctx.done = ctx.env_actor_lost = True
                self.faults.tag_timeouts[ctx.tag] += int(bool(call.timed_out))
            return
        by_env = {out.env_id: out for out in call.results}
        for ctx in stepped:
            out = by_env.get(ctx.env_id)
            if ctx.done or out is None:  # ended meanwhile: another lane lost their actor
                ctx.done = ctx.env_actor_lost = True
                continue
            self.append_env_output(ctx, out)
