"""The reward-model worker (FSDP2): one scalar score per text.

One rank of the reward-model group. The model is any Hugging Face
``AutoModelForSequenceClassification`` with one label (verl's ``reward_model.model.path``);
its score is the head's output at each text's last non-pad token (the model's own pooling,
which reads ``config.pad_token_id``). Frozen: no optimizer, never saved in checkpoints.
The driver picks and tokenizes the texts (``agent_trainer.training.reward_model``).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import FSDPConfig
from agent_trainer.config.rewards import RewardModelConfig
from agent_trainer.workers.fsdp_base import DTYPES, FSDPWorker, micro_batches, run_model


def load_reward_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """The sequence classifier at ``path``, unsharded; refuses a model with more than one label."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype])
    check_reward_model_config(path, model.config)
    model.config.use_cache = False
    return model.eval()


def check_reward_model_config(path: str, config) -> None:
    """A reward model gives one score per text, read at the last non-pad token."""
    if config.num_labels != 1:
        raise ValueError(f"reward_model.model.path = {path!r} has num_labels = {config.num_labels}; a reward "
                         "model gives one score per text (AutoModelForSequenceClassification with num_labels=1)")
    if config.pad_token_id is None:
        raise ValueError(f"reward_model.model.path = {path!r} has no pad_token_id in its config, so the score "
                         "position of a padded text is unknown; set pad_token_id in its config.json")


class RewardModelWorker(FSDPWorker):
    """One rank of the reward-model group: ``compute_rm_score``."""

    hf_auto_class = AutoModelForSequenceClassification

    def __init__(self, *, rank: int, world_size: int, reward_model: RewardModelConfig, device: str = "auto",
                 seed: int = 0):
        fsdp = FSDPConfig(world_size=reward_model.world_size, num_cpus_per_rank=reward_model.num_cpus_per_rank)
        super().__init__(rank=rank, world_size=world_size, fsdp=fsdp, device=device, seed=seed)
        self.config = reward_model

    def init_model(self) -> None:
        """Load and shard the reward model (every rank, concurrently; with a process group built on the meta
        device, rank 0 reading the weights: :meth:`FSDPWorker.load_pretrained`)."""
        path = self.config.model.path
        config = AutoConfig.from_pretrained(path)
        check_reward_model_config(path, config)

        def prepare(model: torch.nn.Module) -> None:
            model.config.use_cache = False

        self.model = self.load_pretrained(AutoModelForSequenceClassification, path, config,
                                          dtype=self.config.model.dtype, prepare=prepare).eval()

    @torch.no_grad()
    def compute_rm_score(self, batch: TensorBatch) -> TensorBatch:
        """``rm_scores`` [B] for this rank's shard of right-padded texts (input_ids, attention_mask, position_ids)."""
        outs = []
        for micro in micro_batches(batch, self.config.micro_batch_size_per_gpu):
            inputs = self.model_inputs(micro)
            outs.append(run_model(self.model, inputs).logits[:, 0].float().cpu())
        return TensorBatch({"rm_scores": torch.cat(outs)})
