"""The policy worker (FSDP2): log probs, the PPO/GRPO update, full weights for sync.

One rank of the actor group. The reference policy (the frozen copy used for KL terms)
lives either in the actor's own processes (``actor_rollout_ref.ref.colocate``, the default,
as verl colocates it): each actor rank also holds its shard of the frozen weights and answers
``compute_ref_log_prob``; or in a group of its own, ``ReferenceWorker``: the same forward, no
optimizer. The critic, likewise, is hosted by the actor's ranks (``critic.colocate``, the
default, verl's fused worker): a ``CriticWorker`` component in the same process answers
``compute_values`` and ``update_critic`` on the actor's process group; or it has a group of its own.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agent_trainer import core_algos
from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import ActorConfig, CriticConfig, ModelConfig, RefConfig
from agent_trainer.workers.critic import CriticWorker
from agent_trainer.workers.fsdp_base import (DTYPES, FSDPWorker, MicroBatching, Prepared, TargetScores, device_means,
                                             gathered_once, micro_batches, target_scores)


def load_causal_lm(model: ModelConfig) -> torch.nn.Module:
    """Load any Hugging Face causal LM from ``model.path`` (the tiny model is just a folder), unsharded."""
    lm = AutoModelForCausalLM.from_pretrained(model.path, dtype=DTYPES[model.dtype])
    _prepare_causal_lm(model)(lm)
    return lm


def _prepare_causal_lm(model: ModelConfig):
    """What every causal LM of a role gets before sharding: gradient checkpointing as configured, no KV cache."""
    def prepare(lm: torch.nn.Module) -> None:
        if model.enable_gradient_checkpointing:
            lm.gradient_checkpointing_enable()
        lm.config.use_cache = False
    return prepare


def sharded_causal_lm(worker: FSDPWorker, model: ModelConfig, dtype: str | None = None, *,
                      cpu_offload: bool = False, lora: bool = False) -> torch.nn.Module:
    """``model.path``'s causal LM sharded on ``worker``'s ranks (:meth:`FSDPWorker.load_pretrained`: meta-device
    build, rank 0 reads, broadcast into the shards), in ``dtype`` (None: ``model.dtype``); with ``lora`` carrying
    ``model``'s LoRA adapter (``agent_trainer/workers/lora.py``)."""
    config = AutoConfig.from_pretrained(model.path)
    return worker.load_pretrained(AutoModelForCausalLM, model.path, config, dtype=dtype or model.dtype,
                                  prepare=_prepare_causal_lm(model), cpu_offload=cpu_offload,
                                  lora=model if lora else None)


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A model that is only ever evaluated: eval mode, no gradients."""
    model.eval()
    return model.requires_grad_(False)


class ReferenceWorker(FSDPWorker):
    """A frozen policy in a group of its own (``actor_rollout_ref.ref.colocate=false``): ``compute_ref_log_prob``."""

    hf_auto_class = AutoModelForCausalLM

    def __init__(self, *, rank: int, world_size: int, model: ModelConfig, ref: RefConfig, device: str = "auto",
                 seed: int = 0):
        super().__init__(rank=rank, world_size=world_size, fsdp=ref.fsdp, device=device, seed=seed)
        self.model_config = model
        self.ref_config = ref
        self.ref_model: torch.nn.Module | None = None
        self.ref_batching = ref_batching(ref)

    def init_model(self) -> None:
        """Load and shard the model (every rank, concurrently) in ``ref.dtype``, its shards in host memory with
        ``ref.fsdp.param_offload`` (FSDP2's ``CPUOffloadPolicy``; GPU only)."""
        self.model = self.ref_model = frozen(sharded_causal_lm(
            self, self.model_config, self.ref_config.dtype,
            cpu_offload=self.ref_config.fsdp.param_offload))

    def _log_probs(self, batch: TensorBatch, model: torch.nn.Module, batching: MicroBatching) -> torch.Tensor:
        """Log-probs [B, T] of ``batch``'s generated tokens (``response_mask``; 0 elsewhere) under ``model``
        at the rollout temperature, micro-batched. A batch without ``response_mask`` (plain sequences to
        score) gets every attended token's."""
        temperature = float(batch.meta.temperature)

        def per_token(micro: Prepared) -> torch.Tensor:
            return self._scores(model, micro, temperature).log_probs

        return self.forward_rows(batch, batching, per_token, model)

    def _scores(self, model: torch.nn.Module, micro: Prepared, temperature: float = 1.0, entropy: bool = False,
                hits: bool = False) -> TargetScores:
        """``model``'s scores of ``micro``'s scored tokens (:func:`target_scores`: the output head in chunks), in
        this role's precision."""
        with self.precision():
            return target_scores(model, micro.inputs, micro.index, temperature, entropy, hits)

    def compute_ref_log_prob(self, batch: TensorBatch) -> TensorBatch:
        """``ref_log_prob`` [B, T] for this rank's shard under the frozen reference weights (generated tokens only)."""
        if self.ref_model is None:
            raise RuntimeError("this actor group hosts no reference model (it was started without one: "
                               "actor_rollout_ref.ref.colocate=false or no KL term)")
        return TensorBatch({"ref_log_prob": self._log_probs(batch, self.ref_model, self.ref_batching)})

    def compute_teacher_log_prob(self, batch: TensorBatch) -> TensorBatch:
        """``teacher_log_prob`` [B, T]: a distillation teacher group's (``algorithm.distill``) frozen model's
        log-probs of the generated tokens, the same forward as :meth:`compute_ref_log_prob`."""
        return TensorBatch({"teacher_log_prob": self.compute_ref_log_prob(batch)["ref_log_prob"]})


def ref_batching(ref: RefConfig) -> MicroBatching:
    """The reference forward's micro-batches (rows, or a token budget with log_prob_use_dynamic_bsz)."""
    return MicroBatching(ref.log_prob_micro_batch_size_per_gpu,
                         ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None)


class ActorWorker(ReferenceWorker):
    """The trained policy: ``compute_log_prob``, ``update_actor``, ``full_state_dict``."""

    def __init__(self, *, rank: int, world_size: int, model: ModelConfig, actor: ActorConfig, device: str = "auto",
                 seed: int = 0, ref: RefConfig | None = None, critic: CriticConfig | None = None,
                 teacher: tuple[ModelConfig, RefConfig] | None = None):
        """``ref``: host the reference policy too (``actor_rollout_ref.ref.colocate``), else None. ``critic``: host
        the critic too (``critic.colocate``), on this rank's threads and process group, else None. ``teacher``: host
        the distillation teacher too (``algorithm.distill.colocate``: its model section and forward settings), else
        None."""
        FSDPWorker.__init__(self, rank=rank, world_size=world_size, fsdp=actor.fsdp, device=device, seed=seed)
        self.model_config = model
        self.config = actor
        self.batching = MicroBatching(actor.ppo_micro_batch_size_per_gpu,
                                      actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None)
        self.policy_loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss_mode)
        self.ref_model = None
        self.ref_config = ref
        if ref is not None and ref.fsdp.param_offload and self.device.type == "cpu":
            raise ValueError(f"actor_rollout_ref.ref.fsdp.param_offload = True keeps the reference in host memory "
                             f"for a GPU, but this worker runs on {self.device}; set it to false or run on GPUs")
        self.ref_batching = ref_batching(ref) if ref is not None else None
        self.hosts_ref = ref is not None
        self.lora = model.lora_rank > 0
        """A LoRA adapter is trained (``agent_trainer/workers/lora.py``): the reference is this model with it switched
        off."""
        self.lora_seed = seed
        self.critic = None if critic is None else CriticWorker(
            rank=rank, world_size=world_size, critic=dataclasses.replace(critic, fsdp=actor.fsdp), device=device,
            seed=seed)
        """The colocated critic (composition: the critic's own worker class, in this process), else None."""
        self.teacher = teacher
        self.teacher_model: torch.nn.Module | None = None

    def init_model(self) -> None:
        """Load, shard, and build the optimizer (every rank, concurrently); the frozen reference too when hosted
        (in ``ref.dtype``, its shards in host memory with ``ref.fsdp.param_offload``)."""
        self.model = sharded_causal_lm(self, self.model_config, lora=self.lora)
        self.build_optimizer(self.config.optim)
        # its own copy from model_path: the policy's weights move, the reference's never do (with LoRA: the
        # policy's base weights never move, and the reference is the policy with its adapter off)
        if self.hosts_ref and not self.lora:
            self.ref_model = frozen(sharded_causal_lm(self, self.model_config, self.ref_config.dtype,
                                                      cpu_offload=self.ref_config.fsdp.param_offload))
        if self.teacher is not None:  # sharded over the actor's ranks, in the teacher's dtype
            model, forward = self.teacher
            self.teacher_model = frozen(sharded_causal_lm(self, model, forward.dtype,
                                                          cpu_offload=forward.fsdp.param_offload))
        if self.critic is not None:
            self.critic.init_model()

    def compute_teacher_log_prob(self, batch: TensorBatch) -> TensorBatch:
        """``teacher_log_prob`` [B, T]: the hosted distillation teacher's log-probs of the generated tokens."""
        if self.teacher_model is None:
            raise RuntimeError("this actor group hosts no distillation teacher (algorithm.distill.colocate=false "
                               "gives the teacher a group of its own)")
        return TensorBatch({"teacher_log_prob": self._log_probs(batch, self.teacher_model,
                                                                ref_batching(self.teacher[1]))})

    def compute_ref_log_prob(self, batch: TensorBatch) -> TensorBatch:
        """``ref_log_prob`` [B, T]: the frozen reference's (:meth:`ReferenceWorker.compute_ref_log_prob`), or with
        LoRA the policy model's with its adapter switched off (the base weights never move; no second model)."""
        if not (self.lora and self.hosts_ref):
            return super().compute_ref_log_prob(batch)
        from agent_trainer.workers.lora import adapter_disabled

        self.model.eval()
        with adapter_disabled(self.model):
            return TensorBatch({"ref_log_prob": self._log_probs(batch, self.model, self.ref_batching)})

    def compute_values(self, batch: TensorBatch) -> TensorBatch:
        """The colocated critic's ``values`` (``CriticWorker.compute_values``)."""
        return self._hosted_critic().compute_values(batch)

    def update_critic(self, batch: TensorBatch) -> dict[str, float]:
        """The colocated critic's update (``CriticWorker.update_critic``)."""
        return self._hosted_critic().update_critic(batch)

    def save_checkpoint(self, path: str, role: str = "actor", **options) -> None:
        """The policy's state (``FSDPWorker.save_checkpoint``, ``options`` passed on), or the colocated critic's with
        role ``critic``."""
        if role == "critic":
            return self._hosted_critic().save_checkpoint(path, **options)
        return super().save_checkpoint(path, **options)

    def load_checkpoint(self, path: str, role: str = "actor") -> None:
        """Restore what :meth:`save_checkpoint` wrote for ``role``."""
        if role == "critic":
            return self._hosted_critic().load_checkpoint(path)
        return super().load_checkpoint(path)

    def _hosted_critic(self) -> CriticWorker:
        if self.critic is None:
            raise RuntimeError("this actor group hosts no critic (it was started without one: critic.colocate=false "
                               "or an estimator without values)")
        return self.critic

    def compute_log_prob(self, batch: TensorBatch) -> TensorBatch:
        """``old_log_probs`` [B, T] under the current policy for this rank's shard (generated tokens; 0 elsewhere)."""
        self.model.eval()
        return TensorBatch({"old_log_probs": self._log_probs(batch, self.model, self.batching)})

    def update_actor(self, batch: TensorBatch) -> dict[str, float]:
        """PPO epochs over this rank's shard: mini-batches (optimizer steps) of micro-batches.

        Needs ``advantages``, ``response_mask`` (and ``ref_log_prob`` with ``use_kl_loss``,
        ``rollout_is_weights`` with a rollout correction). ``old_log_probs`` may be absent only
        when the batch was generated by the current weights and ``ppo_epochs`` is 1
        (actor.recompute_old_log_prob=auto): the first mini-batch is then exactly on-policy and
        its detached current log-probs stand in (ratio exactly 1, TRL's rule), and the rows of
        the later mini-batches get theirs from a forward before the first optimizer step
        (:meth:`_old_log_probs_after_the_first_mini_batch`), which is all the trainer's old-log-prob
        pass would have given them. Every rank holds the same number of rows (the trainer pads
        updates to whole mini-batches) so the collectives line up; micro-batch losses are weighted
        so padding rows dilute nothing (``micro_weight``).
        """
        cfg = self.config
        temperature = float(batch.meta.temperature)
        mini_size = cfg.ppo_mini_batch_size // self.world_size
        if "old_log_probs" not in batch:
            if cfg.ppo_epochs != 1:
                raise RuntimeError(f"update_actor without old_log_probs needs one PPO epoch (the first mini-batch is "
                                   f"on-policy, the later ones are scored before the first step), got "
                                   f"ppo_epochs={cfg.ppo_epochs}; the trainer must run compute_log_prob first")
            # a new batch: the caller's keeps its keys
            batch = batch.select(batch.keys()).update(self._old_log_probs_after_the_first_mini_batch(batch, mini_size))
        self.follow_progress(batch.meta.progress)
        lr = self.lr_scheduler.get_last_lr()[0]  # the rate of this update's first optimizer step
        self.model.train()
        metrics = self.run_update(batch, epochs=cfg.ppo_epochs, mini_batch_size=mini_size, batching=self.batching,
                                  loss_agg_mode=cfg.loss_agg(), grad_clip=cfg.grad_clip, prefix="actor",
                                  micro_loss=lambda micro: self._micro_loss(micro, temperature),
                                  stop=None if cfg.target_kl is None else ("actor/approx_kl", cfg.target_kl))
        metrics["actor/lr"] = lr
        return metrics

    def _old_log_probs_after_the_first_mini_batch(self, batch: TensorBatch, mini_size: int) -> TensorBatch:
        """``old_log_probs`` of the rows after the first mini-batch under the current weights (0 on the first
        mini-batch's rows), and ``on_policy_rows`` [B] bool marking the first mini-batch's rows, whose
        detached current log-probs stand in during the update (all rows when they fit one mini-batch)."""
        old = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        if len(batch) > mini_size:
            self.model.eval()
            later = batch.index(torch.arange(mini_size, len(batch)))
            old[mini_size:] = self._log_probs(later, self.model, self.batching)
        on_policy = torch.zeros(len(batch), dtype=torch.bool)
        on_policy[:mini_size] = True
        return TensorBatch({"old_log_probs": old, "on_policy_rows": on_policy})

    def update_sft(self, batch: TensorBatch) -> dict[str, float]:
        """One supervised optimizer step on this rank's shard of a batch (``agent_trainer/sft.py``).

        Loss: the token-mean negative log-likelihood of the ``response_mask`` tokens (each reply
        and its eos, the tokens RL trains on), accumulated over micro-batches with
        ``micro_weight``, so zero-mask padding rows count for nothing. Every rank holds the same
        number of rows, so the collectives line up. Returns this rank's sums ``sft/nll_sum``,
        ``sft/tokens``, ``sft/correct`` (the driver adds them over ranks), ``sft/grad_norm``
        and the ``sft/lr`` of the step.
        """
        self.follow_progress(batch.meta.progress)
        self.model.train()
        plan = [self.prepare(micro, batch["response_mask"]) for micro in
                micro_batches(batch, self.config.ppo_micro_batch_size_per_gpu)]
        totals: dict[str, list] = defaultdict(list)
        for micro in gathered_once(self.model, plan, backward=True):
            loss, stats = self._sft_micro_loss(micro)
            (loss * micro.weight).backward()
            for key, value in stats.items():
                totals[key].append(value)
        out = device_means(totals, self.device, total=True)
        out["sft/lr"] = self.lr_scheduler.get_last_lr()[0]
        out["sft/grad_norm"] = self.optimizer_step(self.config.grad_clip)
        return out

    @torch.no_grad()
    def compute_sft_loss(self, batch: TensorBatch) -> dict[str, float]:
        """``sft/nll_sum``, ``sft/tokens``, ``sft/correct`` on this rank's shard, without an update (validation)."""
        self.model.eval()
        totals: dict[str, list] = defaultdict(list)
        plan = [self.prepare(m) for m in micro_batches(batch, self.config.ppo_micro_batch_size_per_gpu)]
        for micro in gathered_once(self.model, plan, backward=False):
            for key, value in self._sft_micro_loss(micro)[1].items():
                totals[key].append(value)
        return device_means(totals, self.device, total=True)

    def _sft_micro_loss(self, micro: Prepared) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token-mean NLL of the masked tokens, and the sums behind it (NLL, tokens, greedy-correct tokens)."""
        mask = micro["response_mask"].float()
        scores = self._scores(self.model, micro, hits=True)
        nll = -scores.log_probs
        stats = {"sft/nll_sum": (nll * mask).sum().detach(), "sft/tokens": mask.sum(),
                 "sft/correct": (scores.greedy_hits * mask).sum()}
        return core_algos.agg_loss(nll, mask, "token-mean"), stats

    def _micro_loss(self, micro: Prepared, temperature: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        (clip_low, clip_high), agg_mode = cfg.clip_ratios(), cfg.loss_agg()
        scale = micro.meta.seq_len  # the uncut width: seq-mean-token-sum-norm divides by it
        mask = micro["response_mask"].float()
        scores = self._scores(self.model, micro, temperature, entropy=bool(cfg.entropy_coeff))
        log_prob = scores.log_probs
        old_log_prob = _old_log_prob(micro, log_prob.detach())
        is_weights = micro["rollout_is_weights"] if "rollout_is_weights" in micro else None
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = self.policy_loss_fn(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=micro["advantages"],
            response_mask=mask,
            cliprange_low=clip_low,  # as set, else clip_ratio, else the policy loss's default (ActorConfig)
            cliprange_high=clip_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=agg_mode,
            rollout_is_weights=is_weights,
            loss_scale_factor=scale,
        )
        loss = pg_loss
        metrics = {  # 0-d tensors, read once per update (run_update)
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": pg_clipfrac,
            "actor/ppo_kl": ppo_kl,
            "actor/pg_clipfrac_lower": pg_clipfrac_lower,
        }
        # the driver reports it when it ran the old-log-prob pass
        if "on_policy_rows" in micro and "rollout_log_probs" in micro:
            diff = (micro["rollout_log_probs"] - old_log_prob).abs()
            metrics["actor/rollout_vs_actor_logprob_diff"] = core_algos.masked_mean(diff, mask)
            metrics["rollout/mismatch_kl"] = core_algos.mismatch_kl(old_log_prob, micro["rollout_log_probs"], mask)
        if cfg.target_kl is not None:  # SB3's approx_kl, (r - 1) - log r: >= 0, what actor.target_kl compares
            approx_kl = core_algos.kl_penalty(old_log_prob, log_prob.detach(), "low_var_kl")
            metrics["actor/approx_kl"] = core_algos.masked_mean(approx_kl, mask)
        if cfg.entropy_coeff:
            entropy = core_algos.agg_loss(scores.entropy, mask, agg_mode, scale)
            loss = loss - cfg.entropy_coeff * entropy
            metrics["actor/entropy"] = entropy.detach()
        if cfg.use_kl_loss:
            kl = core_algos.kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kl, mask, agg_mode, scale)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics


def _old_log_prob(micro: Prepared, current: torch.Tensor) -> torch.Tensor:
    """PPO's old log-probs of ``micro``: ``old_log_probs``, with ``current`` (detached) on the rows the update
    found on-policy (``on_policy_rows``, set when the trainer gave no old log-probs)."""
    old = micro["old_log_probs"]
    if "on_policy_rows" not in micro:
        return old
    return torch.where(micro["on_policy_rows"][:, None], current, old)
