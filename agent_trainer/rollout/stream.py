"""Groups refilled as soon as they end (``trainer.refill=group``, on ``trainer.async_mode=continuous``).

A whole rollout waits for its slowest group: its batch is ready when the last of its groups ends, and in the
meantime the finished groups' env slots sit idle. Here the train split's env actors host
``trainer.rollouts_in_flight x env_groups`` group slots (default k = ``trainer.max_off_policy_steps``: as many
episodes in flight as k whole rollouts), and one producer thread (:class:`StreamLoop`, the loop
without a turn barrier) keeps them playing: a group that ends is handed to the trainer's queue
(:class:`GroupStream`) and its slot is reset at once with its tag's next group seed, so the engines and env actors
never wait for a slow group. The trainer takes a rollout's worth of finished groups (each env tag's
``n_groups``), those of the oldest policy versions, as soon as they are ready (AReaL's streaming rollout, verl's
fully asynchronous trainer, prime-rl's continuous batching)::

    slot 0  [ group 0 .......... ][ group 6 ...... ][ group 9 ...
    slot 1  [ group 1 ... ][ group 4 ..... ][ group 8 .........
    slot 2  [ group 2 ............................. ][ group 11
    ...                  ^ step 1 takes groups 1, 0, 3 (the first env_groups to end)

- **Seeds.** Each env tag counts its groups: the n-th group of a tag to start resets from the seed a synchronous
  run gives that tag's n-th group (group g of reset r, in the tags' ``n_groups`` layout; ``es_manager.group_seeds``)
  and its episodes sample with that reset's step and env ids (:func:`~agent_trainer.rollout.splits.episode_seed`):
  the same initial states and draws as a synchronous run, whichever slot plays them. A batch holds each tag's
  ``n_groups``, whichever ended first.
- **The bound.** A group of a tag starts only while the tag's groups started (minus those dropped) are fewer
  than ``min(v + k + 1, total_training_steps) x n_groups``, v the actor's policy version (AReaL's rollout
  capacity): the producer runs at most k steps ahead. Every token records the version that generated it
  (in-flight weight updates, ``trainer.async_mode=continuous``); a finished group whose oldest token is more than k
  versions behind the step's weights is left out when taken (``rollout/stale_dropped``) and the batch waits for
  the next one.
- **Dynamic sampling** (``algorithm.filter_groups``, DAPO): a group whose episodes all scored the same is set
  aside as it ends (it no longer counts against the start rule, so its slot's next group starts at once) and the
  batch waits for an informative one; more than ``max_num_gen_batches`` rollouts' worth of a tag's groups set
  aside in a row stops the run.
- **Faults.** An env actor lost mid-episode ends its episodes (left out of their groups, ``env_actor_lost``); a
  group whose every reset failed is counted (``rollout/reset_failures``) and never taken.
- **Checkpoints.** A checkpoint holds none of the groups in flight or finished but not taken: it saves the train
  split's reset counter rounded up past the last group started, so a resumed run starts from new seeds; the
  groups not yet trained are discarded, counted in ``rollout/buffered_not_checkpointed``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

from agent_trainer.common import profiling
from agent_trainer.config import rollouts_in_flight
from agent_trainer.config.splits import Split
from agent_trainer.episode.es_manager import EpisodeState, group_seeds
from agent_trainer.rollout.lanes import BarrierFreeLoop, Lane
from agent_trainer.rollout.results import EnvFailure, RolloutFaults, RolloutResult, assemble, check_env_errors
from agent_trainer.rollout.splits import episode_seed

logger = logging.getLogger(__name__)


@dataclass
class FinishedGroup:
    """One group played to its end by the stream: its episodes (the slot's env ids), their env states, the
    engine's tokens and their policy versions per episode and turn."""

    number: int
    """Its place in the synchronous order: reset r's group g is number r x env_groups + g."""
    seed: int
    tag: str
    episodes: list
    states: list[EpisodeState]
    generations: dict[int, list[list[int]]]
    versions: dict[int, list[int]]
    started_version: int
    """The engines' version when its reset was sent."""
    faults: RolloutFaults = field(default_factory=RolloutFaults)
    """What went wrong in the stream since the group before it ended (counted once, with the batch taking it)."""

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among its generated tokens (its start's when it generated none)."""
        return min((v for turns in self.versions.values() for v in turns), default=self.started_version)

    @property
    def played(self) -> bool:
        return any(ctx.num_replies > 0 for ctx in self.episodes)


def uninformative(group: FinishedGroup, metric: str) -> bool:
    """Whether every episode of ``group`` that played a turn scored the same (``metric``: reward, the episode's
    reward as its env actor reports it, format penalties included, or success): a group whose group-relative
    advantages would all be 0 (DAPO's dynamic sampling). Fewer than two such episodes (lost, failed): not judged,
    the batch's own checks see to it."""
    played = {ctx.env_id for ctx in group.episodes if ctx.num_replies > 0 and not ctx.env_actor_lost}
    scores = [state.total_reward if metric == "reward" else float(state.metrics.get("success", 0.0))
              for state in group.states if state.env_id in played and not state.service_failure]
    return len(scores) >= 2 and len(set(scores)) == 1


class NoInformativeGroups(RuntimeError):
    """Dynamic sampling set aside more than ``algorithm.filter_groups.max_num_gen_batches`` rollouts' worth of an
    env tag's groups in a row: no batch of informative groups comes (the trainer saves, then stops)."""


class StreamTake(NamedTuple):
    """What :meth:`GroupStream.take` hands a step."""

    taken: list[FinishedGroup]
    """Each tag's ``n_groups`` finished groups, the batch (in the synchronous order)."""
    stale: list[FinishedGroup]
    """Left out: a token more than k versions old (ended in flight, or finished and taken too late)."""
    empty: list[FinishedGroup]
    """Left out: no episode played a turn."""
    set_aside: list[FinishedGroup]
    """Left out by dynamic sampling (``algorithm.filter_groups``): every episode scored the same."""


class GroupStream:
    """The finished groups the producer thread (:class:`StreamLoop`) hands the trainer, and its start rule.

    ``layout``: the env tag of each of a rollout's ``env_groups`` groups (``es_manager.train.env_configs``); each
    tag keeps its own count, so a batch holds as many groups of each tag as a rollout and the n-th group of a tag
    plays the seed of that tag's n-th group in the synchronous order. ``steps_allowed()``: how many steps' worth
    of groups may have started (minus those dropped) by now; ``first_reset`` the reset a resumed run's groups start
    from, ``trained_steps`` the steps trained so far (their groups count as started)."""

    def __init__(self, rollout, agent, layout: list[str], steps_allowed: Callable[[], int], first_reset: int = 0,
                 trained_steps: int = 0, oldest_trainable: Callable[[], int] | None = None,
                 set_aside: Callable[[FinishedGroup], bool] | None = None, max_set_aside: int = 1):
        self.rollout, self.steps_allowed = rollout, steps_allowed
        self.set_aside = set_aside
        """Dynamic sampling (None: off): whether a finished group is set aside rather than trained
        (:func:`uninformative`)."""
        self.max_set_aside = max_set_aside
        """Rollouts' worth of a tag's groups that may be set aside in a row
        (``algorithm.filter_groups.max_num_gen_batches``); one more stops the stream with an error."""
        self.oldest_trainable = oldest_trainable
        """The oldest policy version a group's tokens may have and still be trained by a later step (None: any): a
        group in flight with an older token is ended at once, its slot starting the next group."""
        self.agent = agent
        """An agent of the rollout's class that builds the batches (the rollout's own is the producer thread's)."""
        self.num_groups = len(layout)
        self.groups_of: dict[str, list[int]] = {}
        """Per tag: its groups' places in a rollout, in order."""
        for g, tag in enumerate(layout):
            self.groups_of.setdefault(tag, []).append(g)
        self.started = {tag: first_reset * len(gs) for tag, gs in self.groups_of.items()}
        """Per tag: the groups started so far, counting from reset 0 (the next one's index in the tag's order)."""
        self.counted = {tag: trained_steps * len(gs) for tag, gs in self.groups_of.items()}
        """Per tag: groups started or trained, minus those dropped (what the start rule bounds)."""
        self.ready: dict[str, list[FinishedGroup]] = {tag: [] for tag in self.groups_of}
        self.playing_oldest: dict[int, tuple[str, int]] = {}
        """Per slot with a group in flight that generated tokens: (its tag, its oldest token's version)."""
        self.ended_stale: list[FinishedGroup] = []
        """Groups ended in flight as too old to train (:attr:`oldest_trainable`), not yet reported by a take."""
        self.aside: list[FinishedGroup] = []
        """Groups set aside by :attr:`set_aside` since the last take."""
        self.aside_in_a_row = {tag: 0 for tag in self.groups_of}
        """Per tag: its groups set aside since its last informative one."""
        self.playing = 0
        """Groups started and not yet finished."""
        self.error: BaseException | None = None
        self.stopping = False
        self._cond = threading.Condition()
        self._wake: Future = Future()
        self.loop: StreamLoop | None = None
        self.thread = threading.Thread(target=self._run, name="group-stream", daemon=True)

    def start(self) -> None:
        """Start the producer thread (:class:`StreamLoop` on the rollout's env actors and engines)."""
        self.loop = StreamLoop(self)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as err:  # handed to the trainer's next take
            if self.stopping:  # the run's actors are being torn down
                return
            logger.error("the group stream stopped: %s", err)
            with self._cond:
                self.error = err
                self._cond.notify_all()

    # -- the producer's side ---------------------------------------------------------------
    def claim(self, tag: str) -> tuple[int, int, int] | None:
        """A group of ``tag`` that may start now, counted as started: (its seed, the step and the place in the
        rollout a synchronous run plays it at); None while the start rule holds it back."""
        with self._cond:
            groups = self.groups_of[tag]
            if self.stopping or self.counted[tag] >= self.steps_allowed() * len(groups):
                return None
            self.counted[tag] += 1
            self.playing += 1
            reset, j = divmod(self.started[tag], len(groups))
            self.started[tag] += 1
            group = groups[j]
            seed = group_seeds(Split.TRAIN, self.num_groups, reset, self.rollout.cfg.es_manager.seed)[group]
            return seed, reset + 1, group

    def put(self, group: FinishedGroup) -> None:
        """A finished group: waiting for a step, or set aside (:attr:`set_aside`; no longer counted against the
        start rule, so the producer starts the next group at once)."""
        with self._cond:
            self.playing -= 1
            if self.set_aside is not None and group.played and self.set_aside(group):
                self.counted[group.tag] -= 1
                self.aside.append(group)
                self.aside_in_a_row[group.tag] += 1
                self._check_set_aside(group.tag)
            else:
                self.ready[group.tag].append(group)
                self.aside_in_a_row[group.tag] = 0
            self._cond.notify_all()

    def _check_set_aside(self, tag: str) -> None:
        """Stop the stream when more than ``max_set_aside`` rollouts' worth of ``tag``'s groups in a row were set
        aside: the policy plays (nearly) every seed of it the same way, a batch would wait for ever."""
        n, limit = self.aside_in_a_row[tag], self.max_set_aside * len(self.groups_of[tag])
        if n > limit and self.error is None:
            self.error = NoInformativeGroups(
                f"{n} finished groups of env tag {tag!r} in a row scored the same in every episode and were set "
                f"aside (dynamic sampling), more than algorithm.filter_groups.max_num_gen_batches = "
                f"{self.max_set_aside} rollouts' worth ({limit} groups): the policy plays each of its seeds the "
                "same way, so no batch of informative groups comes. Raise algorithm.filter_groups."
                "max_num_gen_batches, or set algorithm.filter_groups.enable=false")
            self.stopping = True

    def end_stale(self, group: FinishedGroup) -> None:
        """A group ended in flight because a token of it is too old for any later step: it no longer counts
        against the start rule (its slot starts the next group) and the next take reports it as dropped."""
        with self._cond:
            self.playing -= 1
            self.counted[group.tag] -= 1
            self.ended_stale.append(group)

    def wake_signal(self) -> Future:
        """A future set when the start rule may have changed (:meth:`wake`): the producer waits on it too."""
        with self._cond:
            if self._wake.done():
                self._wake = Future()
            return self._wake

    def wake(self) -> None:
        """The actor's version moved on, or groups were dropped, or the stream stops: re-check the start rule."""
        with self._cond:
            if not self._wake.done():
                self._wake.set_result(None)

    # -- the trainer's side ----------------------------------------------------------------
    def take(self, oldest: int | None = None) -> StreamTake:
        """Wait for a rollout's worth of finished groups (each tag's count) with no token older than version
        ``oldest`` (None: any) and take them, the oldest versions first, with those left out since the last take
        (:class:`StreamTake`). The groups left out no longer count against the start rule.

        A group in flight with a token of version ``oldest`` can be trained by this step only: while it and the
        others of its tag in that case fit in the batch, the step waits for them rather than leave them to go
        stale (the engines play on meanwhile)."""
        empty: list[FinishedGroup] = []
        with self._cond:
            dropped, self.ended_stale = self.ended_stale, []  # their slots restarted already
            while True:
                left_out = len(dropped) + len(empty)
                for tag, ready in self.ready.items():
                    for group in list(ready):
                        if not group.played or (oldest is not None and group.oldest_version < oldest):
                            ready.remove(group)
                            (dropped if group.played else empty).append(group)
                            self.counted[tag] -= 1
                if len(dropped) + len(empty) > left_out:  # the start rule lets as many more start
                    self.wake()
                if all(len(self.ready[tag]) >= len(gs) and not self._last_chance_playing(tag, oldest)
                       for tag, gs in self.groups_of.items()):
                    taken = []
                    for tag, gs in self.groups_of.items():
                        ready = sorted(self.ready[tag], key=lambda g: (g.oldest_version, g.number))
                        taken += ready[:len(gs)]
                        self.ready[tag] = ready[len(gs):]
                    aside, self.aside = self.aside, []
                    return StreamTake(sorted(taken, key=lambda g: g.number), dropped, empty, aside)
                if isinstance(self.error, NoInformativeGroups):
                    raise self.error
                if self.error is not None:
                    raise RuntimeError(f"the group stream stopped: {self.error}") from self.error
                if self.thread.ident is not None and not self.thread.is_alive():
                    raise RuntimeError("the group stream ended before the batch was full")
                self._cond.wait(timeout=1.0)

    def _last_chance_playing(self, tag: str, oldest: int | None) -> bool:
        """Whether groups of ``tag`` in flight can be trained by this step only (a token of version ``oldest``) and
        fit in its batch with the finished groups in that case."""
        if oldest is None:
            return False
        playing = sum(1 for t, version in self.playing_oldest.values() if t == tag and version == oldest)
        finished = sum(1 for g in self.ready[tag] if g.oldest_version == oldest)
        return 0 < playing and playing + finished <= len(self.groups_of[tag])

    def note_versions(self, slot: object, tag: str, version: int | None) -> None:
        """The producer's record of a group in flight: its oldest token's version (None: it ended)."""
        with self._cond:
            if version is None:
                self.playing_oldest.pop(id(slot), None)
            else:
                self.playing_oldest[id(slot)] = (tag, version)
            self._cond.notify_all()

    def waiting(self) -> int:
        """Finished groups not yet taken."""
        with self._cond:
            return sum(len(ready) for ready in self.ready.values())

    def untrained(self) -> int:
        """Groups started and not taken (in flight, or finished and waiting)."""
        return self.playing + self.waiting()

    def resume_resets(self) -> int:
        """The train split's reset counter a checkpoint saves: past every group started, so a resumed run plays
        none of them again (those not yet trained are discarded)."""
        with self._cond:
            return max(math.ceil(self.started[tag] / len(gs)) for tag, gs in self.groups_of.items())

    def stop(self) -> None:
        """Start no more groups; the producer ends once its calls in flight return (the run's actors may already be
        gone: their errors are ignored)."""
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
        self.wake()

    def assemble(self, groups: list[FinishedGroup], left_out: list[FinishedGroup],
                 timings: profiling.TurnTimings | None = None) -> RolloutResult:
        """One batch of ``groups``, numbered as a rollout's (group j, env ids j x group_size + m), with the
        split's metrics; the groups ``left_out`` (empty, dropped as stale) add their faults only."""
        r = self.rollout
        group_size = r.split_cfg.group_size
        ctxs, states, generations, versions, seeds = {}, [], {}, {}, []
        faults = RolloutFaults()
        for group in [*groups, *left_out]:
            merge_faults(faults, group.faults)
        for j, group in enumerate(groups):
            seeds.append(group.seed)
            members = sorted({s.env_id for s in group.states} | {c.env_id for c in group.episodes})
            renumber = {old: j * group_size + m for m, old in enumerate(members)}
            for ctx in group.episodes:
                old = ctx.env_id
                ctx.env_id, ctx.group_id = renumber[old], j
                ctxs[ctx.env_id] = ctx
                generations[ctx.env_id] = group.generations.get(old, [])
                versions[ctx.env_id] = group.versions.get(old, [])
            for state in group.states:
                state.env_id, state.group_id = renumber[state.env_id], j
                states.append(state)
        tags = {env_id: ctx.tag for env_id, ctx in ctxs.items()}

        def describe(env_id: int, _seeds=None) -> str:
            group = env_id // group_size
            seed = seeds[group] if group < len(seeds) else "unknown"
            return (f"env tag {tags.get(env_id, '?')!r}, episode {env_id % group_size} of a group with seed {seed}, "
                    f"{r.split} split (trainer.refill=group)")

        limit = r.cfg.es_manager.max_failed_reset_fraction
        episodes = (len(groups) + len(left_out)) * group_size
        if faults.reset_failures > limit * episodes:
            raise EnvFailure(f"{faults.reset_failures} of the {episodes} episodes of the last groups of the train "
                             f"split failed to reset (more than es_manager.max_failed_reset_fraction = {limit:g}); "
                             "see the errors above. Fix the environment's reset, or raise the fraction")
        check_env_errors(states, r.cfg.es_manager.max_env_error_fraction, r.split, describe)
        sampling = r.sampling_params()
        return assemble(r.cfg, self.agent, r.split, ctxs, states, seeds=seeds, temperature=sampling.temperature,
                        faults=faults, reset_prefetched=False, generations=generations,
                        timings=timings or profiling.TurnTimings(), describe=describe,
                        num_episodes=len(groups) * group_size,
                        versions=versions if r.engine_version is not None else None)


def merge_faults(into: RolloutFaults, other: RolloutFaults) -> None:
    for key in ("actor_failures", "timeouts", "reset_failures", "engine_failures"):
        setattr(into, key, getattr(into, key) + getattr(other, key))
    for tag, n in other.tag_timeouts.items():
        into.tag_timeouts[tag] += n


@dataclass(eq=False)
class Slot(Lane):
    """A group slot of the stream: the env actor's group it resets and plays, and the group playing there."""

    group: int = 0
    """The slot's group id on its env actor."""
    tag: str = ""
    number: int = -1
    """The group playing (:attr:`FinishedGroup.number`); -1 when idle."""
    seed: int = 0
    started_version: int = 0


class StreamLoop(BarrierFreeLoop):
    """The producer of :class:`GroupStream`: the loop without a turn barrier, where a group that ends hands its
    episodes to the stream and its slot starts the next group at once."""

    def __init__(self, stream: GroupStream):
        r = stream.rollout
        super().__init__(r, r.sampling_params(), step=0, faults=RolloutFaults())
        r.faults = self.faults  # the engine calls' failures count here too
        self.stream = stream
        self.slots: list[Slot] = []
        for episode in r.episodes:
            if not self.slots or self.slots[-1].group != episode.group_id:
                self.slots.append(Slot(actor=r.actor_of_env[episode.env_id], group=episode.group_id,
                                       tag=episode.tag))
        self.members = {slot.group: [e.env_id for e in r.episodes if e.group_id == slot.group] for slot in self.slots}
        self.seed_keys: dict[int, tuple[int, int]] = {}
        """Slot env id -> (step, env id) a synchronous run samples the group's episode with."""

    def seed_of(self, ctx, turn: int) -> int:
        step, env_id = self.seed_keys[ctx.env_id]
        return episode_seed(self.rollout.cfg.trainer.seed, self.rollout.split, step, env_id, turn)

    def take_timings(self) -> profiling.TurnTimings:
        """The phases timed since the last call (the next batch's profile)."""
        timings, self.timings = self.timings, profiling.TurnTimings()
        return timings

    def run(self) -> None:
        r, stream = self.rollout, self.stream
        es = r.cfg.es_manager
        self._lanes_now = self.slots
        idle, queued, running = list(self.slots), [], {}
        pool = ThreadPoolExecutor(max_workers=len(self.slots) + 2, thread_name_prefix="group-stream")
        try:
            while not stream.stopping:
                for slot in self.too_old(queued):  # no later step could train it: end it, start the next
                    queued.remove(slot)
                    stream.note_versions(slot, slot.tag, None)
                    stream.end_stale(self.finished(slot, None))
                    slot.number = -1
                    idle.append(slot)
                for slot in list(idle):
                    claimed = stream.claim(slot.tag)
                    if claimed is not None:
                        idle.remove(slot)
                        running[self.start_group(pool, slot, *claimed)] = ("reset", slot)
                if queued and not any(kind == "generate" for kind, _ in running.values()):
                    sent = [(slot, slot.active()) for slot in queued if slot.active()]
                    if sent:
                        running[self.submit_generation(pool, sent)] = ("generate", sent)
                    queued = []
                wake = stream.wake_signal()
                finished, _ = wait([*running, wake], return_when=FIRST_COMPLETED)
                for future in finished:
                    if future is wake:
                        continue
                    kind, payload = running.pop(future)
                    if kind == "reset":
                        if self.take_reset(payload, future.result()):
                            queued.append(payload)
                    elif kind == "generate":
                        replies = self.take_replies(payload, future.result())
                        for slot, _ in payload:
                            stream.note_versions(slot, slot.tag, self.oldest_of(slot))
                        for slot, stepped, env_inputs in replies:
                            call = pool.submit(self.timed, "env_step", slot.turn, r.env_pool.call, "step",
                                               {slot.actor: env_inputs}, es.env_step_timeout_s)
                            running[call] = ("step", (slot, stepped))
                    elif kind == "step":
                        slot, stepped = payload
                        self.take_env_outputs(slot, stepped, future.result())
                        slot.turn += 1
                        if self.start_lane_turn(slot):
                            queued.append(slot)
                    else:  # "states": the group is finished
                        stream.note_versions(payload, payload.tag, None)
                        stream.put(self.finished(payload, future.result()))
                        payload.number = -1
                        idle.append(payload)
                busy = {id(s) for s in queued} | {id(p) for kind, p in running.values() if kind in ("reset", "states")}
                busy |= {id(p[0]) for kind, p in running.values() if kind == "step"}
                busy |= {id(s) for kind, p in running.values() if kind == "generate" for s, _ in p}
                for slot in self.slots:  # nothing pending and not queued: its group ended (every episode done,
                    # max_turn reached, or its actor lost): collect its states
                    if slot.number >= 0 and id(slot) not in busy:
                        running[pool.submit(r.env_pool.call, "get_rollout_states", {slot.actor: [slot.group]},
                                            es.env_reset_timeout_s)] = ("states", slot)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def too_old(self, slots: list[Slot]) -> list[Slot]:
        """The slots whose group has a token older than the stream's :attr:`GroupStream.oldest_trainable`."""
        if self.stream.oldest_trainable is None:
            return []
        oldest = self.stream.oldest_trainable()
        return [slot for slot in slots if (version := self.oldest_of(slot)) is not None and version < oldest]

    def oldest_of(self, slot: Slot) -> int | None:
        """The oldest version among the tokens the group in ``slot`` generated so far (None: none yet)."""
        versions = self.rollout.last_versions
        return min((v for c in slot.episodes for v in versions.get(c.env_id, [])), default=None)

    def start_group(self, pool: ThreadPoolExecutor, slot: Slot, seed: int, step: int, group: int) -> Future:
        """Reset ``slot``'s group from ``seed``: the group a synchronous run plays at place ``group`` of ``step``'s
        rollout, whose env ids its episodes sample with."""
        r = self.rollout
        slot.seed, slot.number, slot.turn, slot.episodes = seed, (step - 1) * self.stream.num_groups + group, 0, []
        slot.started_version = r.engine_version() if r.engine_version is not None else 0
        for m, env_id in enumerate(self.members[slot.group]):
            self.seed_keys[env_id] = (step, group * len(self.members[slot.group]) + m)
            r.last_generations.pop(env_id, None)
            r.last_versions.pop(env_id, None)
        return pool.submit(r.env_pool.call, "reset_groups", {slot.actor: {slot.group: slot.seed}},
                           r.cfg.es_manager.env_reset_timeout_s)

    def take_reset(self, slot: Slot, call) -> bool:
        """Start the episodes of a group whose reset returned; whether it has a turn to play."""
        r = self.rollout
        self.faults.count_call(call)
        outputs = [out for out in call.results if out.group_id == slot.group]
        failed = [out for out in outputs if out.info.get("error")]
        for out in failed:
            r.log_env_error(out.env_id, "reset", out.info["error"])
        self.faults.reset_failures += len(self.members[slot.group]) - len(outputs) + len(failed)
        slot.episodes = [r.ctx.start(out) for out in outputs if not out.info.get("error")]
        return self.start_lane_turn(slot) if slot.episodes else False

    def finished(self, slot: Slot, call) -> FinishedGroup:
        """The group that played in ``slot``, with its env states (none when its actor was lost meanwhile: its
        episodes are then left out as lost; none read, ``call`` None, for a group ended as too old)."""
        r = self.rollout
        lost = call is None or call.failed or call.timed_out
        states = [] if lost else [s for s in call.results if s.group_id == slot.group]
        if not states and call is not None:
            for ctx in slot.episodes:
                ctx.done = ctx.env_actor_lost = True
        group = FinishedGroup(
            number=slot.number, seed=slot.seed, tag=slot.tag, episodes=list(slot.episodes), states=states,
            generations={c.env_id: r.last_generations.pop(c.env_id, []) for c in slot.episodes},
            versions={c.env_id: r.last_versions.pop(c.env_id, []) for c in slot.episodes},
            started_version=slot.started_version, faults=self.faults)
        self.faults = r.faults = RolloutFaults()
        return group


def stream_split(cfg):
    """The train split's config with the stream's group slots: ``trainer.rollouts_in_flight`` (default k) times
    ``env_groups``, each tag's count scaled alike."""
    train = cfg.es_manager.train
    scale = rollouts_in_flight(cfg)
    env_configs = dataclasses.replace(train.env_configs, n_groups=[n * scale for n in train.env_configs.n_groups])
    return dataclasses.replace(train, env_groups=train.env_groups * scale, env_configs=env_configs)
