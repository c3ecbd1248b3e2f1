"""The policy worker (FSDP2): log probs, the PPO/GRPO update, full weights for sync.

One rank of the actor group. ``ReferenceWorker`` is the frozen copy used for
KL terms: the same forward, no optimizer.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

from agent_trainer import core_algos
from agent_trainer.batch import TensorBatch
from agent_trainer.config import ActorConfig, ModelConfig, RefConfig
from workers.fsdp_base import (FSDPWorker, greedy_hits, micro_batches, micro_weight, token_entropy,
                                token_log_probs)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(model: ModelConfig) -> torch.nn.Module:
    """Load any Hugging Face causal LM from ``model.path`` (the tiny model is just a folder)."""
    lm = AutoModelForCausalLM.from_pretrained(model.path, dtype=_DTYPES[model.dtype])
    if model.enable_gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    lm.config.use_cache = False
    return lm


class ReferenceWorker(FSDPWorker):
    """A frozen policy: ``compute_ref_log_prob`` only."""

    hf_auto_class = AutoModelForCausalLM

    def __init__(self, *, rank: int, world_size: int, model: ModelConfig, ref: RefConfig, device: str = "auto",
                 seed: int = 0):
        super().__init__(rank=rank, world_size=world_size, fsdp=ref.fsdp, device=device, seed=seed)
        self.model_config = model
        self.micro_batch_size = ref.log_prob_micro_batch_size_per_gpu

    def init_model(self) -> None:
        """Load and shard the model (every rank, concurrently)."""
        self.model = self.shard_model(load_causal_lm(self.model_config))
        self.model.eval()

    @torch.no_grad()
    def _log_probs(self, batch: TensorBatch, micro_batch_size: int) -> torch.Tensor:
        temperature = float(batch.meta.get("temperature", 1.0))
        outs = []
        for micro in micro_batches(batch, micro_batch_size):
            inputs = self.model_inputs(micro)
            logits = self.model(**vars(inputs)).logits
            outs.append(token_log_probs(logits, inputs.input_ids, temperature).cpu())
        return torch.cat(outs)

    def compute_ref_log_prob(self, batch: TensorBatch) -> TensorBatch:
        """``ref_log_prob`` [B, T] for this rank's shard."""
        return TensorBatch({"ref_log_prob": self._log_probs(batch, self.micro_batch_size)})


class ActorWorker(ReferenceWorker):
    """The trained policy: ``compute_log_prob``, ``update_actor``, ``full_state_dict``."""

    def __init__(self, *, rank: int, world_size: int, model: ModelConfig, actor: ActorConfig, device: str = "auto",
                 seed: int = 0):
        FSDPWorker.__init__(self, rank=rank, world_size=world_size, fsdp=actor.fsdp, device=device, seed=seed)
        self.model_config = model
        self.config = actor
        self.micro_batch_size = actor.ppo_micro_batch_size_per_gpu
        self.policy_loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss_mode)

    def init_model(self) -> None:
        """Load, shard, and build the optimizer (every rank, concurrently)."""
        self.model = self.shard_model(load_causal_lm(self.model_config))
        self.build_optimizer(self.config.optim)

    def compute_log_prob(self, batch: TensorBatch) -> TensorBatch:
        """``old_log_probs`` [B, T] under the current policy for this rank's shard."""
        self.model.eval()
        return TensorBatch({"old_log_probs": self._log_probs(batch, self.micro_batch_size)})

    def update_actor(self, batch: TensorBatch) -> dict[str, float]:
        """PPO epochs over this rank's shard: mini-batches (optimizer steps) of micro-batches.

        Needs ``old_log_probs``, ``advantages``, ``response_mask`` (and
        ``ref_log_prob`` with ``use_kl_loss``). Every rank holds the same
        number of rows (the trainer pads updates to whole mini-batches) so the
        collectives line up; micro-batch losses are weighted so padding rows
        dilute nothing (``micro_weight``).
        """
        cfg = self.config
        self.model.train()
        temperature = float(batch.meta.get("temperature", 1.0))
        mini_size = cfg.ppo_mini_batch_size // self.world_size
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(cfg.ppo_epochs):
            for mini in batch.split(mini_size):
                for micro in micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu):
                    loss, step_metrics = self._micro_loss(micro, temperature)
                    weight = micro_weight(micro["response_mask"], mini["response_mask"], cfg.loss_agg())
                    (loss * weight).backward()
                    for k, v in step_metrics.items():
                        metrics[k].append(v)
                metrics["actor/grad_norm"].append(self.optimizer_step(cfg.grad_clip))
        metrics["actor/lr"].append(self.lr_scheduler.get_last_lr()[0])
        return {k: sum(v) / len(v) for k, v in metrics.items()}

    def update_sft(self, batch: TensorBatch) -> dict[str, float]:
        """One supervised optimizer step on this rank's shard of a batch (``agent_trainer/sft.py``).

        Loss: the token-mean negative log-likelihood of the ``response_mask`` tokens (each reply
        and its eos, the tokens RL trains on), accumulated over micro-batches with
        ``micro_weight``, so zero-mask padding rows count for nothing. Every rank holds the same
        number of rows, so the collectives line up. Returns this rank's sums ``sft/nll_sum``,
        ``sft/tokens``, ``sft/correct`` (the driver adds them over ranks), ``sft/grad_norm``
        and the ``sft/lr`` of the step.
        """
        self.model.train()
        totals: dict[str, float] = defaultdict(float)
        for micro in micro_batches(batch, self.config.ppo_micro_batch_size_per_gpu):
            loss, stats = self._sft_micro_loss(micro)
            (loss * micro_weight(micro["response_mask"], batch["response_mask"], "token-mean")).backward()
            for key, value in stats.items():
                totals[key] += value
        totals["sft/lr"] = self.lr_scheduler.get_last_lr()[0]
        totals["sft/grad_norm"] = self.optimizer_step(self.config.grad_clip)
        return dict(totals)

    @torch.no_grad()
    def compute_sft_loss(self, batch: TensorBatch) -> dict[str, float]:
        """``sft/nll_sum``, ``sft/tokens``, ``sft/correct`` on this rank's shard, without an update (validation)."""
        self.model.eval()
        totals: dict[str, float] = defaultdict(float)
        for micro in micro_batches(batch, self.config.ppo_micro_batch_size_per_gpu):
            for key, value in self._sft_micro_loss(micro)[1].items():
                totals[key] += value
        return dict(totals)

    def _sft_micro_loss(self, micro: TensorBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-mean NLL of the masked tokens, and the sums behind it (NLL, tokens, greedy-correct tokens)."""
        inputs = self.model_inputs(micro)
        mask = micro["response_mask"].to(self.device).float()
        logits = self.model(**vars(inputs)).logits
        nll = -token_log_probs(logits, inputs.input_ids)
        stats = {"sft/nll_sum": _scalar((nll * mask).sum()), "sft/tokens": _scalar(mask.sum()),
                 "sft/correct": _scalar((greedy_hits(logits, inputs.input_ids) * mask).sum())}
        return core_algos.agg_loss(nll, mask, "token-mean"), stats

    def _micro_loss(self, micro: TensorBatch, temperature: float) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        (clip_low, clip_high), agg_mode = cfg.clip_ratios(), cfg.loss_agg()
        inputs = self.model_inputs(micro)
        mask = micro["response_mask"].to(self.device).float()
        logits = self.model(**vars(inputs)).logits
        log_prob = token_log_probs(logits, inputs.input_ids, temperature)
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = self.policy_loss_fn(
            old_log_prob=micro["old_log_probs"].to(self.device),
            log_prob=log_prob,
            advantages=micro["advantages"].to(self.device),
            response_mask=mask,
            cliprange_low=clip_low,  # as set, else clip_ratio, else the policy loss's default (ActorConfig)
            cliprange_high=clip_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=agg_mode,
        )
        loss = pg_loss
        metrics = {
            "actor/pg_loss": _scalar(pg_loss),
            "actor/pg_clipfrac": _scalar(pg_clipfrac),
            "actor/ppo_kl": _scalar(ppo_kl),
            "actor/pg_clipfrac_lower": _scalar(pg_clipfrac_lower),
        }
        if cfg.entropy_coeff:
            entropy = core_algos.agg_loss(token_entropy(logits), mask, agg_mode)
            loss = loss - cfg.entropy_coeff * entropy
            metrics["actor/entropy"] = _scalar(entropy)
        if cfg.use_kl_loss:
            kl = core_algos.kl_penalty(log_prob, micro["ref_log_prob"].to(self.device), cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kl, mask, agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = _scalar(kl_loss)
        return loss, metrics


def _scalar(value) -> float:
    """A detached Python float from a tensor or number (metrics only)."""
    return float(value.detach()) if torch.is_tensor(value) else float(value)
