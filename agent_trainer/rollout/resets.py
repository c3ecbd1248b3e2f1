"""A split's env resets (:class:`EnvResets`): the group seeds each reset uses, the reset of every env actor with
its faults (a dead actor reset once more, a stuck one replaced, failed episodes dropped), and the next rollout's
reset started while the step trains (``es_manager.prefetch_reset``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import Split
from agent_trainer.rollout.env_pool import EnvActorPool, PendingCall
from agent_trainer.episode.es_manager import EnvOutput, EpisodeSpec, group_seeds
from agent_trainer.rollout.results import EnvFailure, RolloutFaults


class EnvResets:
    """The resets of one split's env actors, and the seed counter a checkpoint saves (:attr:`num_resets`).

    ``describe(env_id, seeds)`` names an episode in errors; ``log_env_error(env_id, method, error)`` logs an
    environment's error once per tag and error type (both :class:`~agent_trainer.rollout.MultiTurnRollout`'s).
    """

    def __init__(self, cfg: AgentTrainerConfig, split: Split, num_groups: int, env_pool: EnvActorPool,
                 episodes: list[EpisodeSpec], actor_of_env: dict[int, int],
                 describe: Callable[..., str], log_env_error: Callable[[int, str, str], None]):
        self.cfg, self.split, self.num_groups = cfg, split, num_groups
        self.env_pool, self.episodes, self.actor_of_env = env_pool, episodes, actor_of_env
        self.describe, self.log_env_error = describe, log_env_error
        self.num_resets = 0
        """Resets this split's rollouts have used (a prefetched one counts once its rollout takes it)."""
        self.prefetch = cfg.es_manager.prefetch_reset and split is Split.TRAIN
        """Reset the env actors for the next rollout as soon as this one is done (``es_manager.prefetch_reset``)."""
        self.pending: tuple[list[int], PendingCall] | None = None
        """The next rollout's reset, started at the end of the last one: (group seeds, the call)."""
        self.was_prefetched = False
        """Whether the last rollout took a prefetched reset (metric ``<prefix>/reset_prefetched``)."""
        self.last_seeds: list[int] = []
        """The group seeds of the last rollout (group id -> seed), for error messages."""

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
        return group_seeds(self.split, self.num_groups, self.num_resets, self.cfg.es_manager.seed)

    def reset(self, seeds: list[int], faults: RolloutFaults) -> list[EnvOutput]:
        """Reset every env actor with the group seeds; returns the first outputs of the episodes that started.

        A dead actor is reset once more (Ray restarted it); an actor that misses the reset
        deadline was replaced and its episodes sit this rollout out. Episodes whose reset
        raised or whose actor was lost are dropped (:meth:`check_failures`).
        """
        self.last_seeds = seeds
        pending, self.pending = self.pending, None
        self.was_prefetched = pending is not None and pending[0] == list(seeds)
        if self.was_prefetched:
            call = self.env_pool.collect(pending[1])
        else:
            if pending is not None:  # other seeds asked for: the prefetched reset ends before this one starts
                self.env_pool.collect(pending[1])
            call = self.env_pool.collect(self.submit(seeds, range(len(self.env_pool.actors))))
        outputs, lost = list(call.results), dict(call.errors)
        faults.actor_failures += len(call.failed)
        faults.timeouts += len(call.timed_out)
        timed_out = set(call.timed_out)
        if call.failed:  # Ray restarts a dead env actor (max_restarts); its episodes start again there once it is up
            retry = self.env_pool.collect(self.submit(seeds, call.failed))
            outputs += retry.results
            lost = {i: text for i, text in lost.items() if i in timed_out} | retry.errors
            timed_out |= set(retry.timed_out)
            faults.timeouts += len(retry.timed_out)
        errors = {out.env_id: out.info["error"] for out in outputs if out.info.get("error")}
        tags = {e.env_id: e.tag for e in self.episodes}
        for env_id, actor in self.actor_of_env.items():
            if actor in lost:
                errors[env_id] = lost[actor]
                if actor in timed_out:
                    faults.tag_timeouts[tags[env_id]] += 1
        self.check_failures(errors, faults)
        return [out for out in outputs if out.env_id not in errors]

    def start_next(self) -> None:
        """Start the reset of the split's next group seeds (:meth:`next_group_seeds` draws them when the next
        rollout takes the reset, so a checkpoint saved meanwhile counts only the resets used)."""
        seeds = self.upcoming_group_seeds()
        self.pending = (seeds, self.submit(seeds, range(len(self.env_pool.actors))))

    def submit(self, seeds: list[int], actors: Iterable[int]) -> PendingCall:
        """Start the reset of ``actors``' episodes, each from its group's seed; the deadline
        (``es_manager.env_reset_timeout_s``) counts from now."""
        seed_of_group, timeout = dict(enumerate(seeds)), self.cfg.es_manager.env_reset_timeout_s
        return self.env_pool.submit("reset", {i: seed_of_group for i in actors}, timeout)

    def check_failures(self, errors: dict[int, str], faults: RolloutFaults) -> None:
        """Log failed resets once per (tag, error type); stop when too many of the split failed."""
        faults.reset_failures = len(errors)
        for env_id, error in sorted(errors.items()):
            self.log_env_error(env_id, "reset", error)
        limit = self.cfg.es_manager.max_failed_reset_fraction
        if errors and len(errors) > limit * len(self.episodes):
            env_id, error = min(errors.items())
            raise EnvFailure(
                f"{len(errors)} of {len(self.episodes)} episodes of the {self.split} split failed to reset "
                f"(more than es_manager.max_failed_reset_fraction = {limit:g}); the first: "
                f"{self.describe(env_id)}: {error}. Fix the environment's reset, or raise the fraction")
