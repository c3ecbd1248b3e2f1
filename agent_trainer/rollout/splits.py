"""How a split samples: its sampling (:func:`sampling_params`) and the engines' seeds (:func:`sampling_seed`,
:func:`episode_seed`). The groups a split plays are :func:`agent_trainer.config.split_config`, the splits a run plays
:func:`agent_trainer.core_algos.trainer_splits`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import Split

SUMMARY_SEED_SALT = 0x2545F491
"""XOR-ed into a turn's sampling seed for the summaries an agent writes before it (distinct from the turn's own
calls)."""
SPLITS: tuple[Split, ...] = tuple(Split)
"""Every :class:`~agent_trainer.config.splits.Split`, in the order :func:`episode_seed` numbers them."""


@dataclass
class SamplingParams:
    """How the engines sample one turn."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] | None = None
    """Ids that end a reply besides the model's eos (the gateway's ``stop``); None: the eos only."""


def sampling_params(cfg: AgentTrainerConfig, split: Split) -> SamplingParams:
    """Training sampling, the ``val_kwargs`` for the val split, greedy for the ReMax baseline."""
    r = cfg.actor_rollout_ref.rollout
    if split is Split.TRAIN:
        return SamplingParams(max_tokens=r.response_length, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    if split is Split.REMAX_BASELINE:
        return SamplingParams(max_tokens=r.response_length, temperature=0.0)
    return SamplingParams(max_tokens=r.response_length, temperature=r.val_kwargs.temperature,
                          top_p=r.val_kwargs.top_p)


def sampling_seed(base_seed: int, split: Split | str, step: int, turn: int) -> int:
    """The engines' sampling seed for one turn: a pure function of (base seed, split, step, turn)."""
    key = [base_seed, 0 if split == Split.TRAIN else 1, step, turn]
    return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x3FFFFFFF)


def episode_seed(base_seed: int, split: Split | str, step: int, env_id: int, turn: int) -> int:
    """One episode's sampling seed for one turn (``rollout.mode=async``): a pure function of its arguments."""
    key = [base_seed, SPLITS.index(split), step, turn, env_id]
    return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x3FFFFFFF)
