"""The value worker (FSDP2): per-token values and the clipped value-loss update.

The critic is the policy's backbone with a scalar head
(``AutoModelForTokenClassification(num_labels=1)``; the head is newly
initialised), so any causal-LM checkpoint can serve as a critic.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from agent_trainer import core_algos
from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import CriticConfig
from agent_trainer.workers.fsdp_base import FSDPWorker, MicroBatching, Prepared, run_model


def token_values(scores: torch.Tensor) -> torch.Tensor:
    """``out[b, t]`` = the value head at position t-1 (the state before token t); column 0 is 0.

    Aligned like the log probs: the value of a generated token is read
    from the hidden state that generated it.
    """
    return torch.nn.functional.pad(scores[:, :-1, 0].float(), (1, 0))


class CriticWorker(FSDPWorker):
    """One rank of the critic group: ``compute_values``, ``update_critic``."""

    hf_auto_class = AutoModelForTokenClassification

    def __init__(self, *, rank: int, world_size: int, critic: CriticConfig, device: str = "auto", seed: int = 0):
        super().__init__(rank=rank, world_size=world_size, fsdp=critic.fsdp, device=device, seed=seed)
        self.config = critic
        budget = critic.ppo_max_token_len_per_gpu if critic.use_dynamic_bsz else None
        forward_budget = (critic.forward_max_token_len_per_gpu or budget) if critic.use_dynamic_bsz else None
        self.update_batching = MicroBatching(critic.ppo_micro_batch_size_per_gpu, budget)
        self.forward_batching = MicroBatching(critic.ppo_micro_batch_size_per_gpu, forward_budget)

    def init_model(self) -> None:
        """Load the backbone with a fresh value head, shard it, build the optimizer (every rank, concurrently;
        with a process group the model is built on the meta device and rank 0 reads the weights:
        :meth:`FSDPWorker.load_pretrained`)."""
        # No dropout before the value head (transformers defaults it to 0.1): values must be a
        # deterministic function of the state, as in verl's critic.
        config = AutoConfig.from_pretrained(self.config.model.path, num_labels=1)
        config.classifier_dropout = 0.0  # an attribute, not a from_pretrained kwarg: kwargs ignore unknown keys

        def prepare(model: torch.nn.Module) -> None:
            model.config.use_cache = False
            if self.config.model.enable_gradient_checkpointing:
                model.gradient_checkpointing_enable()

        self.model = self.load_pretrained(AutoModelForTokenClassification, self.config.model.path, config,
                                          dtype=self.config.model.dtype, prepare=prepare, fresh_prefixes=("score.",))
        # A zero head starts every value at 0: no random initial baseline noise (a sharded head's shards too).
        head = getattr(self.model, "score", None)
        if isinstance(head, torch.nn.Linear):
            with torch.no_grad():
                head.weight.zero_()
                if head.bias is not None:
                    head.bias.zero_()
        self.build_optimizer(self.config.optim)

    def _values(self, micro: Prepared) -> torch.Tensor:
        """Values [b, w] of ``micro``; 0 in a shared prefix's columns, which no generated token reads."""
        inputs = micro.inputs
        with self.precision():
            scores = run_model(self.model, inputs).logits
        return token_values(torch.nn.functional.pad(scores, (0, 0, inputs.shared_prefix, 0)))

    def compute_values(self, batch: TensorBatch) -> TensorBatch:
        """``values`` [B, T] for this rank's shard."""
        self.model.eval()
        return TensorBatch({"values": self.forward_rows(batch, self.forward_batching, self._values)})

    def update_critic(self, batch: TensorBatch) -> dict[str, float]:
        """Clipped value-loss epochs over this rank's shard (needs values, returns, response_mask)."""
        cfg = self.config
        self.follow_progress(batch.meta.progress)
        self.model.train()
        return self.run_update(batch, epochs=cfg.ppo_epochs, mini_batch_size=cfg.ppo_mini_batch_size // self.world_size,
                               batching=self.update_batching, loss_agg_mode=cfg.loss_agg_mode,
                               grad_clip=cfg.grad_clip, micro_loss=self._micro_loss, prefix="critic")

    def _micro_loss(self, micro: Prepared) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro["response_mask"].float()
        vpreds = self._values(micro)
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds,
            returns=micro["returns"],
            values=micro["values"],
            response_mask=mask,
            cliprange_value=self.config.cliprange_value,
            loss_agg_mode=self.config.loss_agg_mode,
            loss_scale_factor=micro.meta.seq_len,
        )
        return vf_loss, {"critic/vf_loss": vf_loss.detach(), "critic/vf_clipfrac": vf_clipfrac,
                         "critic/vpred_mean": core_algos.masked_mean(vpreds.detach(), mask)}
