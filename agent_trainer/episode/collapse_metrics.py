"""RAGEN-2's template-collapse diagnostic on the training batch: the prompt-response mutual information.

When due (``trainer.collapse_metrics_freq``) the trainer takes the step's rollout batch (every group, before
the reward-variance filter, so the numbers describe the policy, not the groups the filter kept) and in it
each episode's **first turn**: its prompt
(every token before the first generated one: system prompt, instruction, the initial observation, the
assistant header) and its reply (the first run of generated tokens, end-of-turn token included). The
distinct prompts are the columns (episodes of one group share theirs); up to
``trainer.collapse_metrics_num_prompts`` of them are drawn (seeded by ``trainer.seed`` and the step,
without touching the run's random state), and every reply to a drawn prompt is scored by the actor
after each drawn prompt: :func:`cross_scoring_batch` builds those rows (``prompt_j + reply_i``, the
reply's tokens in ``response_mask``), the actor's ``compute_log_prob`` scores them at the rollout
temperature, and :func:`collapse_metrics` sums each row's log-probabilities into the [N, M] matrix of
``core_algos.mutual_information_estimates``. No Ray here; the trainer runs the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_trainer import core_algos
from agent_trainer.common.batch import TensorBatch

PREFIX = "collapse/"


@dataclass
class CrossScoring:
    """The rows to score and how they map back: row ``i * M + j`` is prompt ``j`` followed by reply ``i``."""

    batch: TensorBatch
    """[N * M] rows: input_ids, attention_mask, position_ids, response_mask (on the reply's tokens)."""
    own: torch.Tensor
    """int64 [N]: the column of the prompt reply ``i`` answered."""
    lengths: torch.Tensor
    """int64 [N]: reply ``i``'s number of tokens."""
    num_prompts: int
    """M."""


def collapse_metrics_due(freq: int, step: int, total_steps: int) -> bool:
    """Every ``freq`` steps and at the last step; never with ``freq`` 0."""
    return freq > 0 and (step % freq == 0 or step == total_steps)


def first_turns(batch: TensorBatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each episode's (prompt token ids, first reply's token ids), in the order of the episodes' first rows.

    An episode's first row (rows of an episode are in turn order: one row in full mode, one per turn in
    condensed mode) holds its first turn; an episode without a generated token there is left out.
    """
    ids, mask = batch["input_ids"], batch["response_mask"].bool()
    seen: set[int] = set()
    pairs = []
    for row, traj in enumerate(batch["traj_uid"].tolist()):
        if traj in seen:
            continue
        seen.add(traj)
        generated = mask[row].nonzero().flatten()
        if generated.numel() == 0:
            continue
        start = int(generated[0])
        after = (~mask[row, start:]).nonzero().flatten()
        end = start + int(after[0]) if after.numel() else mask.shape[1]
        pairs.append((tuple(ids[row, :start].tolist()), tuple(ids[row, start:end].tolist())))
    return pairs


def cross_scoring_batch(batch: TensorBatch, num_prompts: int, seed: int) -> CrossScoring | None:
    """The cross-scoring rows of ``batch``'s first turns (:func:`first_turns`) over at most ``num_prompts``
    distinct prompts, drawn with ``seed`` when there are more; None when no episode generated a token."""
    pairs = first_turns(batch)
    if not pairs:
        return None
    prompts = list(dict.fromkeys(prompt for prompt, _ in pairs))  # distinct, in order of appearance
    if len(prompts) > num_prompts:
        drawn = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))[:num_prompts]
        prompts = [prompts[i] for i in sorted(drawn.tolist())]
    column = {prompt: j for j, prompt in enumerate(prompts)}
    samples = [(column[prompt], reply) for prompt, reply in pairs if prompt in column]
    m = len(prompts)
    width = max(len(p) for p in prompts) + max(len(r) for _, r in samples)
    rows = len(samples) * m
    input_ids = torch.zeros((rows, width), dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    for i, (_, reply) in enumerate(samples):
        for j, prompt in enumerate(prompts):
            row, p, t = i * m + j, len(prompt), len(prompt) + len(reply)
            input_ids[row, :t] = torch.tensor(prompt + reply, dtype=torch.long)
            attention_mask[row, :t] = 1
            response_mask[row, p:t] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    meta = batch.meta.copy()
    meta.group_seeds = []
    scored = TensorBatch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                          "response_mask": response_mask}, meta)
    return CrossScoring(batch=scored, own=torch.tensor([j for j, _ in samples], dtype=torch.long),
                        lengths=torch.tensor([len(r) for _, r in samples], dtype=torch.long), num_prompts=m)


def collapse_metrics(plan: CrossScoring, token_log_probs: torch.Tensor) -> dict[str, float]:
    """``collapse/*`` from the actor's per-token log-probs [N * M, T] of ``plan.batch`` (``old_log_probs``)."""
    mask = plan.batch["response_mask"].double()
    sums = (token_log_probs.double() * mask).sum(-1).view(len(plan.own), plan.num_prompts)
    estimates = core_algos.mutual_information_estimates(sums, plan.own, plan.lengths)
    return {PREFIX + key: value for key, value in estimates.items()}
