"""``AgentTrainer``: the PPO/GRPO fit loop over multi-turn rollouts.

The loop keeps the shape of verl's ``RayPPOTrainer.fit()``; the one call
that differs is the generation step, which is the multi-turn
``SyncMultiTurnRollout`` instead of single-turn ``generate_sequences``.
Each phase is one call inside a timer.

Rows per step are not fixed: condensed mode makes one row per turn and rollout
filtering drops groups. Every FSDP rank must still run the same number of
mini- and micro-batches, so each update gets its own copy of the batch padded
to a whole number of that group's mini-batches (:func:`pad_for_update`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from ray.exceptions import RayActorError
from tqdm import tqdm

from agent_trainer.common import checkpoint
from agent_trainer import core_algos
from agent_trainer.training import lifecycle, reward_model, trainer_checkpoint
from agent_trainer.training.colocation import ColocatedMemory
from agent_trainer.episode.collapse_metrics import collapse_metrics, collapse_metrics_due, cross_scoring_batch
from agent_trainer.episode.es_manager import plan_episodes
from agent_trainer.rollout.overlap import (PolicyVersions, RolloutBuffer, Taken, has_fresh_groups, split_stale_groups,
                                           version_metrics)
from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import AgentTrainerConfig, rollouts_in_flight
from agent_trainer.config.splits import Split
from agent_trainer.agents.registry import resolve_agent_cls
from agent_trainer.rollout import RolloutResult, SyncMultiTurnRollout, make_context_manager, make_rollout
from agent_trainer.rollout.engines import EngineCalls
from agent_trainer.rollout.stream import GroupStream, NoInformativeGroups, stream_split, uninformative
from agent_trainer.core_algos import trainer_splits
from agent_trainer.episode.rollout_shaping import attach_reward_baselines, shape_rollout
from agent_trainer.observe.tracking import Tracking, timer
from agent_trainer.trajectory_rewards.judge import JudgeClient
from agent_trainer.workers.worker_group import WorkerDied

if TYPE_CHECKING:
    from agent_trainer.workers.build import Workers

logger = logging.getLogger(__name__)


class AgentTrainer:
    """Builds the worker groups and runs ``fit()``.

    Workers: an FSDP2 actor group, an optional FSDP2 critic group (GAE
    estimators), an optional reference group (KL terms), rollout engines
    (vLLM, or HF generate) and env actors for the train and val splits.
    """

    def __init__(self, cfg: AgentTrainerConfig, tokenizer, env_tags: dict, agent_cls: type | None = None, *,
                 build_workers: Callable[[AgentTrainerConfig], Workers]):
        """Decide where the run starts (``trainer.resume_mode``) and open the metric sinks; no worker starts.

        ``agent_cls`` (an ``agents.base.Agent`` subclass) replaces ``agent_proxy.agent_cls`` (docs/agents.md).
        ``build_workers``: the cli layer's builder (``agent_trainer.workers.build.build_workers``: config -> ``Workers``), which
        the caller runs once Ray is up and hands the result to :meth:`init_workers`; the trainer calls it itself
        only to start the workers again after a restart.
        """
        self.cfg = cfg
        self.build_workers = build_workers
        self.tokenizer = tokenizer
        self.env_tags = env_tags
        self.agent_cls = resolve_agent_cls(cfg, agent_cls)
        """The agent class every split's rollout builds (on the driver); refused here, before any worker starts."""
        make_context_manager(cfg, tokenizer, self.agent_cls)  # its constructor's checks (e.g. the chat template)
        self.global_step = 0
        self.run_dir = Path(cfg.trainer.default_local_dir)
        checkpoint.seed_everything(cfg.trainer.seed)
        self.checkpoint_parts = ["actor"] + (["critic"] if core_algos.critic_enabled(cfg) else [])
        self.resume_from = checkpoint.prepare_run_dir(self.run_dir, cfg.trainer.resume_mode,
                                                      cfg.trainer.resume_from_path, self.checkpoint_parts)
        resume_step = checkpoint.TrainerState.load(self.resume_from).global_step if self.resume_from else 0
        self.tracking = Tracking(self.run_dir, cfg.trainer.logger, resume_step=resume_step, cfg=cfg,
                                 tokenizer=tokenizer)
        self.kl_ctrl = make_kl_ctrl(cfg)
        self.judge = JudgeClient(cfg.judge) if cfg.judge.enable else None
        """judge.enable: the client of the LLM judge scoring every episode (docs/rewards.md, "Judges")."""
        self.workers: Workers | None = None
        """The started workers (:meth:`init_workers`); None before and after :meth:`shutdown`."""
        self.actor_wg = self.critic_wg = self.ref_wg = self.engine_group = self.rm_wg = self.teacher_wg = None
        self.rollouts: dict[str, SyncMultiTurnRollout] = {}
        self.continuous = cfg.trainer.max_off_policy_steps >= 1 and cfg.trainer.async_mode == "continuous"
        """trainer.async_mode=continuous: the engines also take new weights while a rollout runs
        (:meth:`sync_in_flight`)."""
        self.in_flight = rollouts_in_flight(cfg)
        """How many of the buffered rollouts run at once (``trainer.rollouts_in_flight``), each on its own train
        rollout (:attr:`train_pool`)."""
        self.prefetch: RolloutBuffer[RolloutResult] = RolloutBuffer(depth=max(1, cfg.trainer.max_off_policy_steps),
                                                                    workers=self.in_flight)
        """trainer.max_off_policy_steps k >= 1: the next k steps' experience, generated while this step trains."""
        self.train_pool: list[SyncMultiTurnRollout] = []
        """The train split's rollouts: the train rollout, and one more (its own env actors) per further rollout in
        flight; the producer threads take a free one for each buffered step."""
        self.idle_train: queue.Queue[SyncMultiTurnRollout] = queue.Queue()
        """The rollouts of :attr:`train_pool` no producer thread is playing."""
        self.engine_calls = EngineCalls(share=cfg.trainer.share_engine_calls)
        """Shared by the train rollouts (their engine calls, one at a time, the waiting ones sent together) and the
        producer's syncs (its ``lock``): a sync never runs while an engine call is in flight
        (``MultiTurnRollout.engine_calls``)."""
        self.scoring_lock = threading.Lock()
        """Around the scoring of a finished rollout (judge, reward model and its score dump, ReMax's one greedy
        rollout), which rollouts in flight reach from several producer threads."""
        self.versions = PolicyVersions()
        """The actor's policy version (optimizer steps taken) and the engines' (bumped by each weight sync)."""
        self.producer_syncs = cfg.trainer.max_off_policy_steps >= 2 or self.continuous
        """The producer thread brings the engines to the newest weights (not the step, after waiting for it)."""
        self.in_flight_syncs = 0
        """Weight syncs made while a rollout ran (:meth:`sync_in_flight`), since the run started."""
        self.syncs_logged = 0
        """:attr:`in_flight_syncs` at the last step's metrics (``trainer.refill=group``)."""
        self.stream: GroupStream | None = None
        """``trainer.refill=group``: the train split's groups, each refilled as soon as it ends
        (``agent_trainer.rollout.stream``); started with the workers."""
        self.memory = ColocatedMemory([], None, sleep=False, offload=False)
        """Engine sleep/wake and actor offload around the rollout (actor_rollout_ref.hybrid_engine on GPUs);
        inactive until the workers start, and on CPU."""

    # -- set-up --------------------------------------------------------------------------
    def init_workers(self, workers: Workers | None = None) -> None:
        """Take the started workers (models loaded), or build them with ``build_workers`` when none are handed over
        (a restart); then build the rollouts and sync the engines."""
        w = self.build_workers(self.cfg) if workers is None else workers
        self.take_workers(w)
        streamed = self.cfg.trainer.refill == "group"
        stream_cfg = dataclasses.replace(self.cfg, es_manager=dataclasses.replace(
            self.cfg.es_manager, train=stream_split(self.cfg))) if streamed else self.cfg
        rollouts = {
            split: make_rollout(stream_cfg if split is Split.TRAIN else self.cfg, self.tokenizer, self.engines,
                                w.env_worker_cls, self.env_tags, split=split,
                                num_env_actors=self.cfg.agent_proxy.num_env_actors,
                                on_engine_restart=self.resync_restarted_engine, agent_cls=self.agent_cls)
            for split in trainer_splits(self.cfg)
        }
        self.rollouts = rollouts
        """Every split's rollout; their env seed counters go into checkpoints."""
        self.train_rollout, self.val_rollout = rollouts[Split.TRAIN], rollouts.get(Split.VAL)
        """val_rollout: None when the run never validates (``trainer.test_freq`` <= 0, :func:`trainer_splits`)."""
        self.remax_rollout = rollouts.get(Split.REMAX_BASELINE)
        """ReMax only: one greedy episode per training group from the group's seed, never trained on."""
        self.train_pool = [self.train_rollout] + [
            make_rollout(self.cfg, self.tokenizer, self.engines, w.env_worker_cls, self.env_tags, split=Split.TRAIN,
                         num_env_actors=self.cfg.agent_proxy.num_env_actors,
                         on_engine_restart=self.resync_restarted_engine, agent_cls=self.agent_cls,
                         label=f"{Split.TRAIN}-{i}")
            for i in range(2, 1 if streamed else self.in_flight + 1)]
        self.idle_train = queue.Queue()
        for rollout in self.train_pool:
            self.idle_train.put(rollout)
            rollout.engine_calls = self.engine_calls
            if self.in_flight > 1:  # the step's seeds are drawn when it is queued, for whichever rollout plays it
                rollout.resets.prefetch = False
            if self.continuous:  # the train split's tokens carry their policy version; its engine calls may sync
                rollout.engine_version = lambda: self.versions.engines
                rollout.in_flight_sync = self.sync_in_flight
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
        # The engines start from model_path on disk; sync once so they hold exactly the actor's weights.
        self.memory.to_rollout(self.sync_weights)
        if streamed:
            self.start_stream()

    def start_stream(self) -> None:
        """``trainer.refill=group``: start the producer of refilled groups from the train split's reset counter
        (a resumed run's: past every group its checkpoint had started), the trained groups counted against the
        bound."""
        t, fg = self.cfg.trainer, self.cfg.algorithm.filter_groups
        if self.val_rollout is not None:  # validation shares the engines with the stream: one call at a time
            self.val_rollout.engine_calls = self.engine_calls
        layout = [spec.tag for spec in plan_episodes(self.cfg.es_manager.train)][::self.cfg.es_manager.train.group_size]
        self.stream = GroupStream(
            self.train_rollout, make_context_manager(self.cfg, self.tokenizer, self.agent_cls), layout,
            steps_allowed=lambda: min(self.versions.actor + t.max_off_policy_steps + 1, t.total_training_steps),
            first_reset=self.train_rollout.num_resets, trained_steps=self.global_step,
            oldest_trainable=lambda: self.versions.actor - t.max_off_policy_steps,
            set_aside=(lambda group: uninformative(group, fg.metric)) if fg.enable else None,
            max_set_aside=fg.max_num_gen_batches)
        self.stream.start()

    def take_workers(self, w: Workers) -> None:
        """Keep the workers' handles and drive the engines' colocation: sleep/wake when the builder created them with
        sleep mode (``w.sleep_mode``), actor offload when ``w.actor_offload``."""
        self.workers = w
        self.actor_wg, self.critic_wg, self.ref_wg, self.engines = w.actor, w.critic, w.ref, w.engines
        self.engine_group = w.engine_group
        self.memory = ColocatedMemory(w.engines, w.actor, sleep=w.sleep_mode, offload=w.actor_offload)
        self.rm_wg = w.reward_model
        """reward_model.enable: the RewardModelWorker group scoring every training episode (docs/rewards.md)."""
        self.rm_tokenizer = load_tokenizer(self.cfg.reward_model.model.path) if self.rm_wg is not None else None
        self.teacher_wg = w.teacher
        """algorithm.distill.enable: the teacher group scoring every trained token (docs/distillation.md)."""

    def shutdown(self) -> None:
        """Kill every worker of the run (env actors, engines, FSDP groups) and free their placement groups."""
        self.prefetch.drop()
        if self.stream is not None:
            self.stream.stop()
            self.stream = None
        for rollout in self.all_rollouts():
            rollout.close()
        lifecycle.kill_actors([a for rollout in self.all_rollouts() for a in rollout.env_actors])
        self.rollouts, self.train_pool = {}, []
        for group in self.worker_groups():
            group.shutdown()
            lifecycle.kill_actors(group.workers)  # wait until dead: a restart reuses the actor names
        self.workers = None
        self.actor_wg = self.critic_wg = self.ref_wg = self.engine_group = self.rm_wg = self.teacher_wg = None

    def restart(self) -> None:
        """Tear every worker down and start again from the latest checkpoint (from model_path when none)."""
        self.shutdown()
        self.resume_from = checkpoint.find_latest(self.run_dir)
        resume_step = checkpoint.TrainerState.load(self.resume_from).global_step if self.resume_from else 0
        self.tracking.rewind(resume_step)  # steps after it are trained again
        if self.resume_from is None:  # step 0 again: the state a fresh run starts with
            self.global_step = 0
            self.versions.reset(0)
            checkpoint.seed_everything(self.cfg.trainer.seed)
            self.kl_ctrl = make_kl_ctrl(self.cfg)
        self.init_workers()

    # -- the loop ------------------------------------------------------------------------
    def fit(self, stop: lifecycle.StopSignal | None = None) -> list[dict[str, float]]:
        """Train for ``trainer.total_training_steps`` steps; return every step's metrics.

        A dead actor, critic or reference rank (or any worker Ray cannot restart) restarts the
        whole run from the latest checkpoint, up to ``trainer.max_restarts`` times; after that
        the error propagates. ``stop`` (SIGINT/SIGTERM) ends the loop at the next step boundary,
        after a checkpoint when ``trainer.save_on_signal``, by raising ``lifecycle.Interrupted``.
        """
        restarts = 0
        while True:
            try:
                return self.fit_steps(stop)
            except (WorkerDied, RayActorError) as err:
                cause = str(err) if isinstance(err, WorkerDied) else lifecycle.describe_death(err, self.named_workers())
                if restarts >= self.cfg.trainer.max_restarts:
                    raise lifecycle.WorkerLost(f"{cause}; the run stops (trainer.max_restarts = "
                                               f"{self.cfg.trainer.max_restarts}, {restarts} used); set "
                                               "trainer.max_restarts=1 or more to continue from the latest "
                                               "checkpoint automatically") from None
                restarts += 1
                logger.error("%s; restart %d of trainer.max_restarts = %d: every worker is started again from the "
                             "latest checkpoint in %s", cause, restarts, self.cfg.trainer.max_restarts, self.run_dir)
                self.restart()

    def worker_groups(self) -> list:
        """Every started group, each once (a colocated reference is the actor's group in a second role)."""
        return self.workers.groups() if self.workers is not None else []

    def named_workers(self) -> dict[str, list]:
        """Every worker's name (as in the Ray namespace) -> its actor handle, for error messages."""
        named = {f"{g.name} rank {i}": [w] for g in self.worker_groups() for i, w in enumerate(g.workers)}
        for r in self.all_rollouts():
            named.update(r.named_actors())
        return named

    def all_rollouts(self) -> list[SyncMultiTurnRollout]:
        """Every split's rollout and the further train rollouts in flight (:attr:`train_pool`), each once."""
        return list(self.rollouts.values()) + self.train_pool[1:]

    def fit_steps(self, stop: lifecycle.StopSignal | None = None) -> list[dict[str, float]]:
        """The steps from ``global_step + 1`` to ``trainer.total_training_steps``; returns their metrics."""
        cfg = self.cfg.trainer
        history = []
        if cfg.val_before_train and cfg.test_freq > 0 and self.global_step == 0:
            self.tracking.log(self.validate(), step=0)
        steps = range(self.global_step + 1, cfg.total_training_steps + 1)
        if not steps:
            logger.warning("%s already holds step %d of %d: nothing to train (raise trainer.total_training_steps, "
                           "or start over with trainer.resume_mode=disable)", self.run_dir, self.global_step,
                           cfg.total_training_steps)
        bar = tqdm(steps, desc="training", disable=not show_progress_bar(cfg.progress_bar), dynamic_ncols=True,
                   initial=self.global_step, total=cfg.total_training_steps)
        for step in bar:
            self.global_step = step
            try:
                metrics = self.train_step()
            except NoInformativeGroups as err:  # nothing left to train on: keep what the run learned, then stop
                self.global_step = step - 1
                self.save_before_stopping(str(err))
                raise
            is_last = step == cfg.total_training_steps
            if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or is_last):
                with timer("validate", metrics):
                    self.engines_to_step_weights()
                    metrics.update(self.validate())
            saved = cfg.save_freq > 0 and (step % cfg.save_freq == 0 or is_last)
            if saved:
                if self.stream is not None:  # the groups not yet trained: a resumed run plays new ones
                    metrics["rollout/buffered_not_checkpointed"] = float(self.stream.untrained())
                elif cfg.max_off_policy_steps:  # a resumed run generates them again (docs/checkpointing.md)
                    metrics["rollout/buffered_not_checkpointed"] = float(len(self.prefetch))
                with timer("save", metrics), self.memory.training():
                    self.save_checkpoint(metrics)
            self.tracking.log(metrics, step=step)
            history.append(metrics)
            if stop is not None and stop.signum is not None:
                self.stop_after_step(stop.signum, saved=saved)
        self.tracking.close()
        return history

    def save_before_stopping(self, why: str) -> None:
        """Save the last trained step (unless it is saved already or none was trained) before the run stops for
        ``why``; the same command, with what stopped it changed, continues from it."""
        last = self.run_dir / f"global_step_{self.global_step}"
        if self.global_step > 0 and not last.exists():
            with self.memory.training():
                last = self.save_checkpoint()
        if self.global_step > 0:
            logger.error("%s; step %d is saved in %s: the same command continues from it", why, self.global_step, last)
        self.tracking.close()

    def stop_after_step(self, signum: int, saved: bool) -> None:
        """A signal arrived during the step that just ended: save (unless this step was saved), then stop."""
        if self.cfg.trainer.save_on_signal and not saved:
            with self.memory.training():
                path = self.save_checkpoint()
            logger.warning("saved %s before stopping; the same command continues from it", path)
        self.tracking.close()
        raise lifecycle.Interrupted(signum)

    def train_step(self) -> dict[str, float]:
        """One rollout and one update; returns the step's metrics.

        With ``trainer.max_off_policy_steps`` k >= 1 the step's experience was generated while earlier steps
        trained, and the next k steps' are generated while this one trains (``agent_trainer.rollout.overlap``).
        """
        metrics: dict[str, float] = {}
        with timer("step", metrics):
            result = self.take_experience(metrics)
            if self.memory.active:
                with timer("engine_sleep", metrics):  # the GPU goes back to the trainer (agent_trainer.training.colocation)
                    self.memory.to_training()
            self.start_prefetch()
            with timer("shape", metrics):
                batch = self.shape(result.batch, metrics)
            with timer("log_prob", metrics):
                metrics.update(self.compute_old_log_probs(batch, staleness=int(metrics["rollout/policy_staleness"])))
            metrics.update(self.collapse_diagnostic(result.batch))  # every group, before the filter; when due
            if self.ref_wg is not None:
                with timer("ref", metrics):
                    batch.update(self.ref_wg.dp_compute("compute_ref_log_prob", batch))
            if self.teacher_wg is not None:
                with timer("teacher", metrics):
                    batch.update(self.teacher_wg.dp_compute("compute_teacher_log_prob", batch))
            if self.critic_wg is not None:
                with timer("values", metrics):
                    batch.update(self.critic_wg.dp_compute("compute_values", batch))
            with timer("adv", metrics):
                metrics.update(self.compute_advantage(batch))
            batch.meta.progress = (self.global_step - 1) / self.cfg.trainer.total_training_steps
            if self.critic_wg is not None:
                with timer("update_critic", metrics):
                    metrics.update(self.run_update(self.critic_wg, "update_critic", batch,
                                                   self.cfg.critic.ppo_mini_batch_size))
            with timer("update_actor", metrics), self.versions.updating():
                metrics.update(self.run_update(self.actor_wg, "update_actor", batch,
                                               self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size))
            if self.stream is not None:  # one more version: the stream may start more groups
                self.stream.wake()
            if not self.producer_syncs:  # k >= 2 or continuous: the producer syncs
                if self.prefetch.pending:
                    with timer("wait_prefetch", metrics):  # the engines take new weights only between rollouts
                        self.prefetch.wait()
                with timer("sync", metrics):  # colocated engines: wake weights, sync, offload actor, wake KV cache
                    self.memory.to_rollout(self.sync_weights)
        metrics.update(batch_metrics(batch, metrics["timing_s/step"]))
        self.tracking.record_step(self.global_step, result, batch, metrics)  # rates, trajectories
        return metrics

    # -- phases --------------------------------------------------------------------------
    def take_experience(self, metrics: dict[str, float]) -> RolloutResult:
        """The step's experience: the oldest buffered batch (``trainer.max_off_policy_steps`` >= 1), or a rollout
        now. Each row carries the policy version that generated it (``policy_version``); batches more than
        ``max_off_policy_steps`` versions older than the weights this step trains from are dropped and counted."""
        k = self.cfg.trainer.max_off_policy_steps
        if self.stream is not None:
            return self.take_groups(metrics)
        metrics["rollout/buffered"] = float(len(self.prefetch))
        if k >= 1:
            metrics["rollout/in_flight_episodes"] = float(self.prefetch.running() * len(self.train_rollout.episodes))
        oldest, policy = self.versions.actor - k, self.cfg.trainer.stale_groups
        taken: Taken | None = self.prefetch.take(
            self.global_step, oldest_version=oldest,
            fresh=(lambda r: has_fresh_groups(r.batch, oldest, policy)) if self.continuous else None)
        dropped = [r.batch for r in (taken.dropped if taken is not None else [])]
        if taken is None or taken.result is None:  # nothing buffered: the producer is idle, the engines free
            self.versions.sync_if_newer(self.ship_weights)
            taken = Taken(self.collect(self.global_step), self.versions.engines, [])
        result = taken.result
        if "token_versions" in result.batch:  # continuous: a row is as old as its oldest token
            result.batch, stale = split_stale_groups(result.batch, oldest, default=taken.version)
            dropped += [stale] if stale is not None else []
            metrics.update(version_metrics(result.batch))
        else:
            result.batch["policy_version"] = torch.full((len(result.batch),), taken.version, dtype=torch.long)
        batch = result.batch
        metrics.update(result.metrics)
        metrics["rollout/stale_dropped"] = float(sum(len(episode_ids(b)) for b in dropped))
        metrics.update(staleness_metrics(self.versions.actor - batch["policy_version"], k))
        return result

    def take_groups(self, metrics: dict[str, float]) -> RolloutResult:
        """``trainer.refill=group``: the step's batch of the ``env_groups`` finished groups of the oldest versions
        (waiting for them), groups with a token more than k versions old dropped on the way and, with
        ``algorithm.filter_groups``, groups whose episodes all scored the same set aside (both counted)."""
        k = self.cfg.trainer.max_off_policy_steps
        oldest = self.versions.actor - k
        with timer("wait_groups", metrics):
            taken, stale, empty, aside = self.stream.take(oldest)
        metrics["rollout/buffered"] = float(self.stream.waiting())
        metrics["rollout/in_flight_episodes"] = float(self.stream.playing * self.cfg.es_manager.train.group_size)
        result = self.stream.assemble(taken, empty + stale + aside, timings=self.stream.loop.take_timings())
        self.score(result, self.global_step)
        result.batch, _ = split_stale_groups(result.batch, oldest, default=self.versions.engines)
        metrics.update(version_metrics(result.batch))
        metrics.update(result.metrics)
        metrics["rollout/in_flight_syncs"] = float(self.in_flight_syncs - self.syncs_logged)
        self.syncs_logged = self.in_flight_syncs
        metrics["rollout/stale_dropped"] = float(sum(len(g.episodes) for g in stale))
        if self.cfg.algorithm.filter_groups.enable:
            metrics["rollout/set_aside_groups"] = float(len(aside))
        metrics.update(staleness_metrics(self.versions.actor - result.batch["policy_version"], k))
        return result

    def engines_to_step_weights(self) -> None:
        """Before validating under ``trainer.max_off_policy_steps`` >= 2: the buffered rollouts end (the engines
        are then free) and the engines take this step's weights, as in the other modes."""
        if self.stream is not None:  # the stream goes on; validation's engine calls take turns with its
            self.versions.sync_when_free(self.ship_weights, self.engine_calls.lock)
        elif self.producer_syncs:
            self.prefetch.wait()
            self.versions.sync_if_newer(self.ship_weights)

    def produce(self, pending) -> RolloutResult:
        """The producer's job under ``trainer.max_off_policy_steps`` >= 2 (one-step-off: its prefetch): bring the
        engines to the actor's newest version when they hold an older one, then :meth:`collect` ``pending.step``'s
        experience."""
        metrics: dict[str, float] = {}
        rollout = self.idle_train.get()  # one per producer thread: never waits
        try:
            if self.producer_syncs:
                with timer("producer_sync", metrics):
                    self.versions.sync_when_free(self.ship_weights, self.engine_calls.lock)
            pending.mark_started(resets=rollout.num_resets, version=self.versions.engines)
            syncs = self.in_flight_syncs
            result = self.collect(pending.step, rollout, pending.seeds)
            if self.in_flight > 1:  # read before another producer thread takes the rollout (and resets them)
                calls, shared = rollout.engine_call_counts
                result.metrics["rollout/engine_calls"] = float(calls)
                result.metrics["rollout/engine_calls_shared"] = float(shared)
        finally:
            self.idle_train.put(rollout)
        if self.continuous:
            result.metrics["rollout/in_flight_syncs"] = float(self.in_flight_syncs - syncs)
        result.metrics.update(metrics)
        return result

    def sync_in_flight(self) -> None:
        """The train rollout's ``in_flight_sync`` (``trainer.async_mode=continuous``), between two of its engine
        calls: the engines take the actor's newest weights (every transport; vLLM drops its prefix cache at the
        end of the load), unless the actor is updating right now, and the episodes in flight go on under them."""
        if self.versions.sync_unless_updating(self.ship_weights):
            self.in_flight_syncs += 1

    def collect(self, step: int, rollout: SyncMultiTurnRollout | None = None,
                seeds: list[int] | None = None) -> RolloutResult:
        """Step ``step``'s experience on the engines' current weights: the rollout (``rollout``, default the train
        rollout; from ``seeds``, default the split's next ones), then the judge's and the reward model's scores
        and ReMax's baselines."""
        metrics: dict[str, float] = {}
        with timer("rollout", metrics):
            result = (rollout or self.train_rollout).rollout(step, seeds=seeds)
        result.metrics.update(metrics)
        self.score(result, step)
        return result

    def score(self, result: RolloutResult, step: int) -> None:
        """The judge's and the reward model's scores of a finished rollout, and ReMax's baselines."""
        with self.scoring_lock:
            if self.judge is not None:
                with timer("judge", result.metrics):
                    result.metrics.update(self.score_with_judge(result))
            if self.rm_wg is not None:
                with timer("reward_model", result.metrics):
                    result.metrics.update(self.score_with_reward_model(result.batch, step=step))
            if self.remax_rollout is not None:
                with timer("remax_baseline", result.metrics):
                    self.add_remax_baselines(result, step)

    def start_prefetch(self) -> None:
        """``trainer.max_off_policy_steps`` k >= 1: queue the rollouts of the next k steps not yet queued (none
        with ``trainer.refill=group``: the stream refills on its own)."""
        if self.stream is not None:
            return
        last = min(self.global_step + self.cfg.trainer.max_off_policy_steps, self.cfg.trainer.total_training_steps)
        for step in range(self.global_step + 1 + len(self.prefetch), last + 1):
            if self.in_flight > 1:  # drawn in step order, whichever rollout starts first
                resets = self.train_rollout.num_resets
                self.prefetch.start(step, self.produce, resets=resets, seeds=self.train_rollout.next_group_seeds())
            else:
                self.prefetch.start(step, self.produce)

    def score_with_reward_model(self, batch: TensorBatch, split: Split = Split.TRAIN,
                                step: int | None = None) -> dict[str, float]:
        """Add ``reward_model.reward_weight x score`` on every episode's last generated token (before shaping).

        The text (the final reply or the whole conversation, ``reward_model.input``) is decoded with the
        policy's tokenizer and re-tokenized with the reward model's (``agent_trainer.training.reward_model``).
        ``split`` "val" scores validation episodes: metrics ``val/reward_model/*``, dumps to
        ``reward_model_scores_val.jsonl``. ``step`` (default: the current one) labels the dumped scores.
        """
        rm_cfg = self.cfg.reward_model
        rows = reward_model.last_rows(batch)
        texts = reward_model.episode_texts(batch, rows, self.tokenizer, rm_cfg.input)
        inputs = reward_model.encode_texts(self.rm_tokenizer, texts, rm_cfg.max_length)
        scores = self.rm_wg.dp_compute("compute_rm_score", inputs)["rm_scores"]
        reward_model.add_scores(batch, rows, scores, rm_cfg.reward_weight)
        if rm_cfg.dump_scores:
            reward_model.dump_scores(self.run_dir / reward_model.dump_name(split),
                                     self.global_step if step is None else step, texts, scores)
        return reward_model.score_metrics(batch, rows, scores, prefix=reward_model.scorer_prefix("reward_model", split))

    def score_with_judge(self, result: RolloutResult, split: Split = Split.TRAIN) -> dict[str, float]:
        """The judge's ``reward_weight x score`` on every scored episode's last generated token (the environment's
        rewards times ``env_reward_weight``); unscored episodes leave ``result.batch`` (``agent_trainer.training.reward_model
        .add_judge_scores``). The verdicts go to ``result.judge``, and from there into the trajectories."""
        items = reward_model.judge_items(result.batch, self.tokenizer, self.cfg.judge.input)
        verdicts, stats = self.judge.judge(items)
        result.batch, metrics = reward_model.add_judge_scores(result.batch, verdicts, self.cfg.judge, split)
        result.judge = verdicts
        metrics.update(stats.metrics(reward_model.scorer_prefix("judge", split)))
        return metrics

    def shape(self, batch: TensorBatch, metrics: dict[str, float]) -> TensorBatch:
        """StarPO-S rollout filtering, then RAGEN reward normalisation (``agent_trainer.episode.rollout_shaping``)."""
        rollout, norm = self.cfg.actor_rollout_ref.rollout, self.cfg.agent_proxy.reward_normalization
        batch, shape_metrics = shape_rollout(
            batch, filter_strategy=rollout.rollout_filter_strategy, filter_value=rollout.rollout_filter_value,
            norm_grouping=norm.grouping, norm_method=norm.method,
        )
        metrics.update(shape_metrics)
        return batch

    def add_remax_baselines(self, result: RolloutResult, step: int) -> None:
        """ReMax: replay every training group's seed greedily; the episode's reward is the group's baseline.

        Sets ``result.batch["reward_baselines"]`` [B]; the greedy episodes are never trained on.
        """
        metrics = result.metrics
        baseline = self.remax_rollout.rollout(step, seeds=result.group_seeds)
        result.batch, dropped = attach_reward_baselines(result.batch, baseline.batch)
        metrics["rollout/remax_baseline_reward_mean"] = baseline.metrics["remax_baseline/episode_reward_mean"]
        metrics["rollout/remax_baseline_success_rate"] = baseline.metrics["remax_baseline/success_rate"]
        metrics["rollout/nonfinite_dropped"] += float(dropped)  # groups left without a (finite) baseline

    def compute_old_log_probs(self, batch: TensorBatch, staleness: int = 0) -> dict[str, float]:
        """``old_log_probs`` from the actor, unless the update can do without (:func:`needs_old_log_probs`)
        or the engine's log-probs stand in (``algorithm.rollout_correction.bypass_mode``); then the
        rollout-correction weights from them (``algorithm.rollout_correction``)."""
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]  # the same contract: response tokens, 0 elsewhere
            return {"perf/old_log_prob_skipped": 1.0}
        if not needs_old_log_probs(self.cfg, staleness):  # update_actor reports the difference to the engine's
            return {"perf/old_log_prob_skipped": 1.0}
        batch.update(self.actor_wg.dp_compute("compute_log_prob", batch))
        diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()  # as update_actor reports it
        metrics = {"perf/old_log_prob_skipped": 0.0,
                   "actor/rollout_vs_actor_logprob_diff": float(core_algos.masked_mean(diff, batch["response_mask"])),
                   "rollout/mismatch_kl": float(core_algos.mismatch_kl(
                       batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]))}
        rc = self.cfg.algorithm.rollout_correction
        weights, is_metrics = None, {}
        if rc.rollout_is is not None:
            weights, is_metrics = core_algos.compute_rollout_is_weights(
                batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rc.rollout_is,
                rc.rollout_is_threshold)
        if rc.rollout_rs is not None:  # IcePop: tokens out of the ratio band get no gradient
            keep, rs_metrics = core_algos.compute_rollout_rs_mask(
                batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
                rc.rollout_rs_threshold_lower, rc.rollout_rs_threshold)
            weights, is_metrics = (keep if weights is None else weights * keep), {**is_metrics, **rs_metrics}
        if weights is not None:
            batch["rollout_is_weights"] = weights
        return {**metrics, **{f"actor/{k}": float(v) for k, v in is_metrics.items()}}

    def collapse_diagnostic(self, batch: TensorBatch) -> dict[str, float]:
        """RAGEN-2's template-collapse metrics (``collapse/*``, ``agent_trainer.episode.collapse_metrics``) every
        ``trainer.collapse_metrics_freq`` steps: every first reply of the rollout's ``batch`` (all groups, before the
        reward-variance filter) scored by the actor after each of up to ``trainer.collapse_metrics_num_prompts``
        distinct first prompts, before this step's update."""
        t, metrics = self.cfg.trainer, {}
        if not collapse_metrics_due(t.collapse_metrics_freq, self.global_step, t.total_training_steps):
            return metrics
        with timer("collapse", metrics):
            seed = t.seed * 1_000_003 + self.global_step
            plan = cross_scoring_batch(batch, t.collapse_metrics_num_prompts, seed=seed)
            if plan is not None:
                scored = self.actor_wg.dp_compute("compute_log_prob", plan.batch)["old_log_probs"]
                metrics.update(collapse_metrics(plan, scored))
        return metrics

    def run_update(self, group, method: str, batch: TensorBatch, mini_batch_size: int) -> dict[str, float]:
        """Run ``method`` on every rank with the batch padded to whole mini-batches; average the metrics."""
        padded, n_pad = pad_for_update(batch, mini_batch_size)
        metrics = _mean_over_ranks(group.dp_execute(method, padded))
        metrics[f"perf/{method}_padding_rows"] = float(n_pad)
        return metrics

    def compute_advantage(self, batch: TensorBatch) -> dict[str, float]:
        """KL-in-reward (optional), the distillation signal (optional: added to the rewards, or the advantage
        itself), then the configured estimator, on the driver in plain torch."""
        alg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        # Without the old-log-prob pass (bypass_mode, or on-policy at temperature 1 for KL-in-reward) the engine's
        # log-probs of the same policy stand in.
        policy_log_probs = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
        if self.kl_ctrl is not None:
            rewards, kl_metrics = core_algos.apply_kl_penalty(
                batch["token_level_rewards"], policy_log_probs, batch["ref_log_prob"],
                batch["response_mask"], self.kl_ctrl, alg.kl_penalty,
            )
            batch["token_level_rewards"] = rewards
            metrics.update(kl_metrics)
        distilled = None
        if self.teacher_wg is not None:
            distilled, distill_metrics = core_algos.apply_distillation(batch.tensors, policy_log_probs,
                                                                       alg.distill.mode, alg.distill.coef)
            metrics.update(distill_metrics)
        if distilled is not None:  # algorithm.distill.mode advantage: the teacher's signal is the advantage
            advantages, returns = distilled, distilled.clone()
        else:
            advantages, returns = core_algos.compute_advantage(
                batch.tensors, core_algos.estimator(alg), gamma=alg.gamma, lam=alg.lam,
                high_level_gamma=alg.high_level_gamma, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                **core_algos.estimator_options(alg),
            )
        self.check_finite(batch, advantages, returns)
        batch["advantages"], batch["returns"] = advantages, returns
        mask = batch["response_mask"].float()
        metrics["critic/advantages_mean"] = core_algos.masked_mean(advantages, mask).item()
        metrics["critic/returns_mean"] = core_algos.masked_mean(returns, mask).item()
        return metrics

    def check_finite(self, batch: TensorBatch, advantages: torch.Tensor, returns: torch.Tensor) -> None:
        """Stop the step when an advantage or return on a generated token is NaN or infinite, naming the episode."""
        mask = batch["response_mask"].bool()
        bad = ((~torch.isfinite(advantages) | ~torch.isfinite(returns)) & mask).any(-1)
        if bad.any():
            row = int(bad.nonzero()[0])
            raise RuntimeError(
                f"non-finite advantages or returns in {int(bad.sum())} of {len(batch)} rows, the first in "
                f"{self.train_rollout.describe_episode(int(batch['traj_uid'][row]), batch.meta.group_seeds or None)}; "
                "every reward was finite after the rollout, so look at the critic's values, the KL-in-reward term "
                "and the estimator's inputs")

    def resync_restarted_engine(self) -> float:
        """The rollout's ``on_engine_restart``: a restarted engine takes the actor's weights (the actor's state
        comes back to its device for the gather when it was offloaded)."""
        return self.memory.resync(self.sync_weights)

    def sync_weights(self) -> float:
        """:meth:`ship_weights`; the engines then hold the actor's policy version."""
        return self.versions.sync(self.ship_weights)

    def ship_weights(self) -> float:
        """Ship the actor's weights to every engine, bucket by bucket; returns engine 0's reload seconds.

        ``agent_trainer.workers.weight_sync.sync_weights`` (shared with SFT): every actor rank takes part in the per-unit
        all-gathers, rank 0 sends (object store, collective group or CUDA IPC: ``rollout.weight_sync``). An
        engine that dies while loading (or is found dead) is restarted by Ray from the checkpoint on disk: the
        sync waits for it and sends the weights once more; a second failure raises with Ray's error.
        """
        return self.workers.sync_weights()

    def validate(self) -> dict[str, float]:
        """Greedy rollouts on the held-out validation seeds, scored by the judge and the reward model when on."""
        result = self.val_rollout.rollout(self.global_step)
        if self.judge is not None:
            result.metrics.update(self.score_with_judge(result, split=Split.VAL))
        if self.rm_wg is not None:
            result.metrics.update(self.score_with_reward_model(result.batch, split=Split.VAL))
        return result.metrics

    def save_checkpoint(self, metrics: dict[str, float] | None = None) -> Path:
        """Save everything a resume needs into ``global_step_N/``, atomically (``agent_trainer.training.trainer_checkpoint``)."""
        return trainer_checkpoint.save(self, metrics)

    def load_checkpoint(self, path: Path) -> None:
        """Restore workers and driver state from a ``global_step_N`` folder (``agent_trainer.training.trainer_checkpoint``)."""
        trainer_checkpoint.load(self, path)


def show_progress_bar(wanted: bool, stream=None) -> bool:
    """Whether the step bar is drawn: ``trainer.progress_bar`` and tqdm's stream (stderr) is a terminal. Written to
    a file (``make train > log``, ``ray job submit`` logs), the log gets the console logger's one line per step
    (``tracking.format_metrics``) and no bar redraws."""
    stream = sys.stderr if stream is None else stream
    return bool(wanted) and hasattr(stream, "isatty") and stream.isatty()


def make_kl_ctrl(cfg: AgentTrainerConfig) -> core_algos.AdaptiveKLController | core_algos.FixedKLController | None:
    """The KL-in-reward controller at its starting coefficient (None without ``algorithm.use_kl_in_reward``)."""
    if not cfg.algorithm.use_kl_in_reward:
        return None
    ctrl = cfg.algorithm.kl_ctrl
    if ctrl.type == "adaptive":
        return core_algos.AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return core_algos.FixedKLController(ctrl.kl_coef)


def needs_old_log_probs(cfg: AgentTrainerConfig, staleness: int = 0) -> bool:
    """Whether this step runs the old-log-prob forward (``actor_rollout_ref.actor.recompute_old_log_prob``).

    ``auto`` skips it when the weights being updated are the ones that generated: ``staleness`` 0
    (a prefetched batch, ``trainer.max_off_policy_steps``, is one step older) and one PPO epoch.
    The actor then uses its detached current log-probs as the old ones on the first mini-batch
    (exactly on-policy: TRL's rule) and scores the later mini-batches' rows itself before its
    first optimizer step (``ActorWorker.update_actor``). It still runs when something needs the
    trainer's own log-probs before the update: the rollout correction (TRL, too, keeps the
    forward with its vLLM IS correction), or KL-in-reward at a temperature other than 1 (the
    engine's log-probs, which stand in for the old ones there, are temperature-1), or distillation
    (``algorithm.distill``: the student's side of the reverse KL is the trainer's forward, as the teacher's is).
    """
    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    if actor.recompute_old_log_prob == "always":
        return True
    on_policy = staleness == 0 and actor.ppo_epochs == 1
    correction = alg.rollout_correction.rollout_is is not None or alg.rollout_correction.rollout_rs is not None
    needs_trainer_log_probs = correction or alg.distill.enable or (
        alg.use_kl_in_reward and cfg.actor_rollout_ref.rollout.temperature != 1.0)
    return not on_policy or needs_trainer_log_probs


def pad_for_update(batch: TensorBatch, mini_batch_size: int) -> tuple[TensorBatch, int]:
    """Append zero-mask copies of leading rows until ``len(batch)`` is a multiple of ``mini_batch_size``.

    Why: ``dp_execute`` splits the batch into equal contiguous rank shards and
    each rank splits its shard into mini-batches of ``mini_batch_size //
    world_size`` rows (validated to be a whole number of micro-batches); a
    multiple of ``mini_batch_size`` therefore gives every rank the same number of
    full mini- and micro-batches, so the FSDP collectives line up, and never
    lets ``split_for_ranks`` repeat real rows. The padding rows are copies of
    real rows (well-defined forward passes) with ``response_mask``, rewards,
    advantages and returns zeroed, so every loss ignores them (agg_loss leaves
    all-zero-mask rows out). They go at the end and number fewer than one
    mini-batch, so rank 0's part of every optimizer step holds a real row: no
    step is taken on padding alone. Returns the batch and the number of rows added.
    """
    padded, pad = batch.pad_to_multiple(mini_batch_size)
    if pad == 0:
        return batch, 0
    for key in ("response_mask", "token_level_rewards", "advantages", "returns"):
        if key in padded:  # concat made new tensors: zeroing the tail leaves ``batch`` untouched
            padded[key][len(batch):] = 0
    return padded, pad


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over ranks."""
    keys = per_rank[0].keys()
    return {k: sum(m[k] for m in per_rank) / len(per_rank) for k in keys}


def batch_metrics(batch: TensorBatch, step_seconds: float) -> dict[str, float]:
    """Sizes and throughput of the step's batch."""
    mask = batch["response_mask"]
    tokens = int(batch["attention_mask"].sum())
    metrics = {
        "perf/num_rows": float(len(batch)),
        "perf/total_tokens": float(tokens),
        "perf/generated_tokens": float(mask.sum()),
        "perf/max_seq_len": float(batch["input_ids"].shape[1]),
        "perf/tokens_per_s": tokens / max(step_seconds, 1e-9),
        "rollout/rollout_logprob_mean": float(core_algos.masked_mean(batch["rollout_log_probs"], mask)),
    }
    return metrics


def episode_ids(batch: TensorBatch) -> torch.Tensor:
    """The distinct episodes (``traj_uid``) of a batch."""
    return batch["traj_uid"].unique()


def staleness_metrics(staleness: torch.Tensor, max_off_policy_steps: int) -> dict[str, float]:
    """``rollout/policy_staleness`` (the max over rows: optimizer steps between the policy that generated a row
    and the weights the step trains from), its mean, and the share of rows at each staleness 0..k."""
    rows = staleness.float()
    metrics = {"rollout/policy_staleness": float(rows.max()), "rollout/policy_staleness_mean": float(rows.mean())}
    for lag in range(max_off_policy_steps + 1):
        metrics[f"rollout/policy_staleness_frac/{lag}"] = float((staleness == lag).float().mean())
    return metrics


def load_tokenizer(path: str):
    """A Hugging Face tokenizer (the reward model's, which may differ from the policy's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
