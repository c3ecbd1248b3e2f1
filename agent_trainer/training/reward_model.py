"""Reward-model and judge scoring on the driver: which text each episode is scored on, and where the score goes.

The trainer (``AgentTrainer.score_with_reward_model``) calls :func:`episode_texts` on the rollout
batch, tokenizes the texts with the reward model's tokenizer (:func:`encode_texts`), has the
``RewardModelWorker`` group score them (``agent_trainer/workers/reward_model.py``), and adds ``reward_weight x
score`` on each episode's last generated token (:func:`add_scores`). Plain torch, no Ray.

A judge (``AgentTrainer.score_with_judge``) reads the same texts (:func:`judge_items`); :func:`add_judge_scores`
weights the environment's rewards, adds the judge's weighted scores and takes the unscored episodes out of the
batch, so they count in no group's statistics and are not trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config.rewards import JudgeConfig
from agent_trainer.config.splits import Split
from agent_trainer.trajectory_rewards.judge import JudgeFailure, JudgeItem, JudgeVerdict


def last_rows(batch: TensorBatch) -> list[int]:
    """Per episode (``traj_uid``), the row holding its last generated token, in first-appearance order.

    Full mode has one row per episode; condensed mode one per turn, of which the last is the final turn.
    """
    last: dict[int, int] = {}
    for row, uid in enumerate(batch["traj_uid"].tolist()):
        if batch["response_mask"][row].any():
            last[uid] = row  # rows of an episode come in turn order
    return list(last.values())


def _last_token(mask_row: torch.Tensor) -> int:
    return int(mask_row.nonzero()[-1])


def _last_turn_span(mask_row: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the last contiguous run of generated tokens (the episode's final reply)."""
    end = _last_token(mask_row) + 1
    start = end
    while start > 0 and mask_row[start - 1]:
        start -= 1
    return start, end


def episode_texts(batch: TensorBatch, rows: list[int], tokenizer, source: str) -> list[str]:
    """The text the reward model reads for each row: the final reply, or the conversation up to it."""
    texts = []
    for row in rows:
        ids, mask = batch["input_ids"][row], batch["response_mask"][row]
        if source == "response":
            start, end = _last_turn_span(mask)
            texts.append(tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=True))
        else:  # the conversation: everything attended up to the last generated token, template included
            end = _last_token(mask) + 1
            keep = batch["attention_mask"][row][:end].bool()
            texts.append(tokenizer.decode(ids[:end][keep].tolist(), skip_special_tokens=False))
    return texts


def encode_texts(tokenizer, texts: list[str], max_length: int) -> TensorBatch:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``position_ids`` [N, T] (each text's last max_length tokens)."""
    encoded = [tokenizer(t)["input_ids"][-max_length:] or [tokenizer.pad_token_id] for t in texts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(texts), width), dtype=torch.long)
    for i, ids in enumerate(encoded):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return TensorBatch({"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids})


def add_scores(batch: TensorBatch, rows: list[int], scores: torch.Tensor, weight: float) -> None:
    """``token_level_rewards[row, last generated token] += weight * score`` for each scored row."""
    rewards = batch["token_level_rewards"].clone()
    for row, value in zip(rows, scores.tolist()):
        rewards[row, _last_token(batch["response_mask"][row])] += weight * float(value)
    batch["token_level_rewards"] = rewards


def score_metrics(batch: TensorBatch, rows: list[int], scores: torch.Tensor,
                  prefix: str = "reward_model") -> dict[str, float]:
    """``<prefix>/score_mean|std`` and ``<prefix>/episode_reward_mean`` (env + weighted RM rewards)."""
    per_episode: dict[int, float] = {}
    for uid, total in zip(batch["traj_uid"].tolist(), batch["token_level_rewards"].sum(-1).tolist()):
        per_episode[uid] = per_episode.get(uid, 0.0) + total
    return {f"{prefix}/score_mean": float(scores.mean()),
            f"{prefix}/score_std": float(scores.std()) if len(scores) > 1 else 0.0,
            f"{prefix}/episode_reward_mean": sum(per_episode.values()) / max(1, len(per_episode))}


def dump_name(split: str) -> str:
    """The run-dir file ``reward_model.dump_scores`` writes a split's scores to."""
    return "reward_model_scores.jsonl" if split == Split.TRAIN else f"reward_model_scores_{split}.jsonl"


def dump_scores(path: Path, step: int, texts: list[str], scores: torch.Tensor) -> None:
    """Append one JSON line per scored text: step, text, score."""
    with open(path, "a", encoding="utf-8") as f:
        for text, value in zip(texts, scores.tolist()):
            f.write(json.dumps({"step": step, "text": text, "score": float(value)}) + "\n")


def scorer_prefix(scorer: str, split: str) -> str:
    """A scorer's metric prefix (``reward_model``, ``judge``): the scorer for training, ``<split>/<scorer>``
    otherwise (``val/judge``)."""
    return scorer if split == Split.TRAIN else f"{split}/{scorer}"


def judge_items(batch: TensorBatch, tokenizer, source: str) -> list[JudgeItem]:
    """Each episode of ``batch`` as the judge reads it (``judge.input``: the last reply or the conversation)."""
    rows = last_rows(batch)
    texts = episode_texts(batch, rows, tokenizer, source)
    return [JudgeItem(episode=int(batch["traj_uid"][row]), group=int(batch["uid"][row]), text=text)
            for row, text in zip(rows, texts)]


def add_judge_scores(batch: TensorBatch, verdicts: dict[int, JudgeVerdict], cfg: JudgeConfig, split: str,
                     ) -> tuple[TensorBatch, dict[str, float]]:
    """``env_reward_weight x`` the environment's rewards, plus ``reward_weight x score`` on each scored episode's
    last generated token; returns the batch without the unscored episodes' rows, and the metrics.

    Every row of an unscored episode (``JudgeVerdict.score`` None) leaves the batch, so no estimator counts it in
    its group's mean or spread, and it is not trained on (``<prefix>/unscored``). More than
    ``judge.max_unscored_fraction`` of the episodes unscored, or every one of them, raises :class:`JudgeFailure`
    naming the first failure.
    """
    prefix = scorer_prefix("judge", split)
    unscored = sorted(uid for uid, v in verdicts.items() if v.score is None)
    if unscored and (len(unscored) > cfg.max_unscored_fraction * len(verdicts) or len(unscored) == len(verdicts)):
        raise JudgeFailure(
            f"the judge left {len(unscored)} of {len(verdicts)} episodes of the {split} split unscored (more than "
            f"judge.max_unscored_fraction = {cfg.max_unscored_fraction:g}, or all); the first: "
            f"{verdicts[unscored[0]].error}. Check judge.base_url, judge.model and the endpoint, or raise the fraction")
    if cfg.env_reward_weight != 1.0:
        batch["token_level_rewards"] = batch["token_level_rewards"] * cfg.env_reward_weight
    uids = batch["traj_uid"].tolist()
    rows = [row for row in last_rows(batch) if uids[row] in verdicts and verdicts[uids[row]].score is not None]
    scores = torch.tensor([verdicts[uids[row]].score for row in rows], dtype=torch.float64)
    add_scores(batch, rows, scores, cfg.reward_weight)
    if unscored:
        gone = set(unscored)
        batch = batch.index([row for row, uid in enumerate(uids) if uid not in gone])
    metrics = score_metrics(batch, rows, scores, prefix=prefix)
    metrics[f"{prefix}/unscored"] = float(len(unscored))
    metrics[f"{prefix}/scored"] = float(len(rows))
    return batch, metrics
