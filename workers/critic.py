"""The value worker (FSDP2): per-token values and the clipped value-loss update.

The critic is the policy's backbone with a scalar head
(``AutoModelForTokenClassification(num_labels=1)``; the head is newly
initialised), so any causal-LM checkpoint can serve as a critic.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from agent_trainer import core_algos
from agent_trainer.batch import TensorBatch
from agent_trainer.config import CriticConfig
from workers.actor import _DTYPES, _scalar
from workers.fsdp_base import FSDPWorker, micro_batches, micro_weight


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

    def init_model(self) -> None:
        """Load the backbone with a fresh value head, shard it, build the optimizer."""
        # No dropout before the value head (transformers defaults it to 0.1): values must be a
        # deterministic function of the state, as in verl's critic.
        config = AutoConfig.from_pretrained(self.config.model.path, num_labels=1)
        config.classifier_dropout = 0.0  # an attribute, not a from_pretrained kwarg: kwargs ignore unknown keys
        model = AutoModelForTokenClassification.from_pretrained(
            self.config.model.path, config=config, dtype=_DTYPES[self.config.model.dtype]
        )
        # A zero head starts every value at 0: no random initial baseline noise.
        head = getattr(model, "score", None)
        if isinstance(head, torch.nn.Linear):
            torch.nn.init.zeros_(head.weight)
            if head.bias is not None:
                torch.nn.init.zeros_(head.bias)
        model.config.use_cache = False
        if self.config.model.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model = self.shard_model(model)
        self.build_optimizer(self.config.optim)

    def _values(self, micro: TensorBatch) -> torch.Tensor:
        inputs = self.model_inputs(micro)
        return token_values(self.model(**vars(inputs)).logits)

    @torch.no_grad()
    def compute_values(self, batch: TensorBatch) -> TensorBatch:
        """``values`` [B, T] for this rank's shard."""
        self.model.eval()
        outs = [self._values(m).cpu() for m in micro_batches(batch, self.config.ppo_micro_batch_size_per_gpu)]
        return TensorBatch({"values": torch.cat(outs)})

    def update_critic(self, batch: TensorBatch) -> dict[str, float]:
        """Clipped value-loss epochs over this rank's shard (needs values, returns, response_mask)."""
        cfg = self.config
        self.model.train()
        mini_size = cfg.ppo_mini_batch_size // self.world_size
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(cfg.ppo_epochs):
            for mini in batch.split(mini_size):
                for micro in micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu):
                    mask = micro["response_mask"].to(self.device).float()
                    vpreds = self._values(micro)
                    vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                        vpreds=vpreds,
                        returns=micro["returns"].to(self.device),
                        values=micro["values"].to(self.device),
                        response_mask=mask,
                        cliprange_value=cfg.cliprange_value,
                        loss_agg_mode=cfg.loss_agg_mode,
                    )
                    (vf_loss * micro_weight(micro["response_mask"], mini["response_mask"], cfg.loss_agg_mode)).backward()
                    metrics["critic/vf_loss"].append(_scalar(vf_loss))
                    metrics["critic/vf_clipfrac"].append(_scalar(vf_clipfrac))
                    metrics["critic/vpred_mean"].append(core_algos.masked_mean(vpreds.detach(), mask).item())
                metrics["critic/grad_norm"].append(self.optimizer_step(cfg.grad_clip))
        return {k: sum(v) / len(v) for k, v in metrics.items()}
