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

import logging
from pathlib import Path

import ray
from tqdm import tqdm

from agent_trainer import core_algos
from agent_trainer.batch import TensorBatch
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.rollout import SyncMultiTurnRollout
from agent_trainer.rollout_shaping import shape_rollout
from agent_trainer.tracking import Tracking, timer

logger = logging.getLogger(__name__)


class AgentTrainer:
    """Builds the worker groups and runs ``fit()``.

    Workers: an FSDP2 actor group, an optional FSDP2 critic group (GAE
    estimators), an optional reference group (KL terms), rollout engines
    (vLLM, or HF generate) and env actors for the train and val splits.
    """

    def __init__(self, cfg: AgentTrainerConfig, tokenizer, env_tags: dict):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.env_tags = env_tags
        self.global_step = 0
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.tracking = Tracking(self.run_dir, cfg.trainer.logger)
        ctrl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = None
        if cfg.algorithm.use_kl_in_reward:
            self.kl_ctrl = (core_algos.AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
                            if ctrl.type == "adaptive" else core_algos.FixedKLController(ctrl.kl_coef))

    # -- set-up --------------------------------------------------------------------------
    def init_workers(self) -> None:
        """Start every worker group and load the models (collectively where sharded)."""
        from workers.build import build_workers  # heavy imports (FSDP, vLLM) stay out of agent_trainer

        w = build_workers(self.cfg)
        self.actor_wg, self.critic_wg, self.ref_wg, self.engines = w.actor, w.critic, w.ref, w.engines
        self.train_rollout, self.val_rollout = (
            SyncMultiTurnRollout(self.cfg, self.tokenizer, self.engines, w.env_worker_cls, self.env_tags, split=split,
                                 num_env_actors=self.cfg.agent_proxy.num_env_actors,
                                 on_engine_restart=self.sync_weights)
            for split in ("train", "val")
        )
        # The engines start from the checkpoint on disk; sync once so they hold exactly the actor's weights.
        self.sync_weights()

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train for ``trainer.total_training_steps`` steps; return every step's metrics."""
        cfg = self.cfg.trainer
        history = []
        if cfg.val_before_train and cfg.test_freq > 0:
            self.tracking.log(self.validate(), step=0)
        steps = range(1, cfg.total_training_steps + 1)
        for step in tqdm(steps, desc="training", disable=not cfg.progress_bar, dynamic_ncols=True):
            self.global_step = step
            metrics = self.train_step()
            is_last = step == cfg.total_training_steps
            if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or is_last):
                with timer("validate", metrics):
                    metrics.update(self.validate())
            if cfg.save_freq > 0 and (step % cfg.save_freq == 0 or is_last):
                with timer("save", metrics):
                    self.save_checkpoint()
            self.tracking.log(metrics, step=step)
            history.append(metrics)
        self.tracking.close()
        return history

    def train_step(self) -> dict[str, float]:
        """One rollout and one update; returns the step's metrics."""
        metrics: dict[str, float] = {}
        with timer("step", metrics):
            with timer("rollout", metrics):
                result = self.train_rollout.rollout()
            metrics.update(result.metrics)
            with timer("shape", metrics):
                batch = self.shape(result.batch, metrics)
            with timer("log_prob", metrics):
                batch.update(self.actor_wg.dp_compute("compute_log_prob", batch))
            if self.ref_wg is not None:
                with timer("ref", metrics):
                    batch.update(self.ref_wg.dp_compute("compute_ref_log_prob", batch))
            if self.critic_wg is not None:
                with timer("values", metrics):
                    batch.update(self.critic_wg.dp_compute("compute_values", batch))
            with timer("adv", metrics):
                metrics.update(self.compute_advantage(batch))
            if self.critic_wg is not None:
                with timer("update_critic", metrics):
                    metrics.update(self.run_update(self.critic_wg, "update_critic", batch,
                                                   self.cfg.critic.ppo_mini_batch_size))
            with timer("update_actor", metrics):
                metrics.update(self.run_update(self.actor_wg, "update_actor", batch,
                                               self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size))
            with timer("sync", metrics):
                self.sync_weights()
        metrics.update(batch_metrics(batch, metrics["timing_s/step"]))
        return metrics

    # -- phases --------------------------------------------------------------------------
    def shape(self, batch: TensorBatch, metrics: dict[str, float]) -> TensorBatch:
        """StarPO-S rollout filtering, then RAGEN reward normalisation (``agent_trainer.rollout_shaping``)."""
        rollout, norm = self.cfg.actor_rollout_ref.rollout, self.cfg.agent_proxy.reward_normalization
        batch, shape_metrics = shape_rollout(
            batch, filter_strategy=rollout.rollout_filter_strategy, filter_value=rollout.rollout_filter_value,
            norm_grouping=norm.grouping, norm_method=norm.method,
        )
        metrics.update(shape_metrics)
        return batch

    def run_update(self, group, method: str, batch: TensorBatch, mini_batch_size: int) -> dict[str, float]:
        """Run ``method`` on every rank with the batch padded to whole mini-batches; average the metrics."""
        padded, n_pad = pad_for_update(batch, mini_batch_size)
        metrics = _mean_over_ranks(group.dp_execute(method, padded))
        metrics[f"perf/{method}_padding_rows"] = float(n_pad)
        return metrics

    def compute_advantage(self, batch: TensorBatch) -> dict[str, float]:
        """KL-in-reward (optional), then the configured estimator, on the driver in plain torch."""
        alg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        if self.kl_ctrl is not None:
            rewards, kl_metrics = core_algos.apply_kl_penalty(
                batch["token_level_rewards"], batch["old_log_probs"], batch["ref_log_prob"],
                batch["response_mask"], self.kl_ctrl, alg.kl_penalty,
            )
            batch["token_level_rewards"] = rewards
            metrics.update(kl_metrics)
        advantages, returns = core_algos.compute_advantage(
            batch.tensors, alg.estimator(), gamma=alg.gamma, lam=alg.lam, high_level_gamma=alg.high_level_gamma,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        )
        batch["advantages"], batch["returns"] = advantages, returns
        mask = batch["response_mask"].float()
        metrics["critic/advantages_mean"] = core_algos.masked_mean(advantages, mask).item()
        metrics["critic/returns_mean"] = core_algos.masked_mean(returns, mask).item()
        return metrics

    def sync_weights(self) -> float:
        """Ship the actor's full weights to every engine; returns the reload seconds of engine 0.

        Every actor rank takes part in the all-gather; rank 0's state dict
        travels through the object store straight to the engines.
        """
        refs = self.actor_wg.execute_all_async("full_state_dict")
        ray.get(refs[1:])
        return ray.get([e.update_weights.remote(refs[0]) for e in self.engines])[0]

    def validate(self) -> dict[str, float]:
        """Greedy rollouts on the held-out validation seeds."""
        return self.val_rollout.rollout().metrics

    def save_checkpoint(self) -> Path:
        """Save the actor as a Hugging Face folder (loadable as ``model_path``) plus the tokenizer."""
        path = self.run_dir / "checkpoints" / f"global_step_{self.global_step}" / "actor"
        self.actor_wg.execute_all("save_hf_checkpoint", str(path))
        self.tokenizer.save_pretrained(str(path))
        return path


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
    return {
        "perf/num_rows": float(len(batch)),
        "perf/total_tokens": float(tokens),
        "perf/generated_tokens": float(mask.sum()),
        "perf/max_seq_len": float(batch["input_ids"].shape[1]),
        "perf/tokens_per_s": tokens / max(step_seconds, 1e-9),
        "rollout/rollout_logprob_mean": float((batch["rollout_log_probs"] * mask).sum() / mask.sum().clamp(min=1)),
        "actor/rollout_vs_actor_logprob_diff": float(
            ((batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
        ) if "old_log_probs" in batch else 0.0,
    }
