"""What a split plays and how it samples: its groups (:func:`split_config`), the splits a run plays
(:func:`trainer_splits`), its sampling (:func:`sampling_params`) and the engines' seeds (:func:`sampling_seed`,
:func:`episode_seed`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from agent_trainer import core_algos
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.envs import EnvGroupsConfig
from agent_trainer.config.splits import Split

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


def trainer_splits(cfg: AgentTrainerConfig) -> tuple[Split, ...]:
    """The splits a training run plays, each with env actors of its own: train; val only when the run validates
    (``trainer.test_freq`` > 0), so a run that never validates starts no val env actors; the greedy baseline split
    when the estimator reads ``reward_baselines`` (ReMax)."""
    return ((Split.TRAIN,) + ((Split.VAL,) if cfg.trainer.test_freq > 0 else ())
            + ((Split.REMAX_BASELINE,) if core_algos.estimator_spec(core_algos.estimator(cfg.algorithm)).greedy_baseline
               else ()))


def split_config(cfg: AgentTrainerConfig, split: Split | str) -> EnvGroupsConfig:
    """The groups a split plays; remax_baseline: the training groups with one episode each."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if split == Split.REMAX_BASELINE:
        return dataclasses.replace(cfg.es_manager.train, group_size=1)
    return cfg.es_manager.train if split == Split.TRAIN else cfg.es_manager.val


def sampling_seed(base_seed: int, split: Split | str, step: int, turn: int) -> int:
    """The engines' sampling seed for one turn: a pure function of (base seed, split, step, turn)."""
    key = [base_seed, 0 if split == Split.TRAIN else 1, step, turn]
    return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x3FFFFFFF)


def episode_seed(base_seed: int, split: Split | str, step: int, env_id: int, turn: int) -> int:
    """One episode's sampling seed for one turn (``rollout.mode=async``): a pure function of its arguments."""
    key = [base_seed, SPLITS.index(split), step, turn, env_id]
    return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x3FFFFFFF)
