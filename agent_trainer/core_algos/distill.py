"""On-policy distillation (``algorithm.distill``, docs/distillation.md): the teacher's per-token signal.

The student sampled every generated token y_t; the teacher scored it. The per-token reverse KL on the sampled
token (a one-sample estimate of KL(pi_student || pi_teacher) at that position) is

    reverse_kl_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)      (generated tokens only)

and the distillation signal is ``-coef * reverse_kl_t``: positive where the teacher likes the sampled token more
than the student does. ``mode`` advantage uses it as each token's advantage (and return); ``mode`` reward adds it
to the token rewards before the configured estimator (prime-rl's opd, slime's --use-opd, TRL's DistillationTrainer
with its reverse-KL on student samples).
"""

from __future__ import annotations

import torch

from ._masked import masked_mean

DISTILL_MODES = ("advantage", "reward")
"""``algorithm.distill.mode``: the signal is the advantage itself, or a token reward added before the estimator."""


def distill_signal(teacher_log_prob: torch.Tensor, student_log_prob: torch.Tensor, response_mask: torch.Tensor,
                   coef: float) -> torch.Tensor:
    """``coef * (teacher_log_prob - student_log_prob)`` on the generated tokens, 0 elsewhere ([B, T])."""
    diff = teacher_log_prob.float() - student_log_prob.float()
    return torch.where(response_mask.bool(), coef * diff, torch.zeros_like(diff))


def apply_distillation(tensors: dict[str, torch.Tensor], student_log_prob: torch.Tensor, mode: str,
                       coef: float) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Apply the teacher's signal to a batch's ``tensors`` (``teacher_log_prob``, ``response_mask``,
    ``token_level_rewards``), given the student's log-probs of the same tokens.

    mode reward: ``token_level_rewards`` gains the signal in place of the old tensor; returns (None, metrics): the
    estimator runs next. mode advantage: returns (the advantages, metrics); the rewards are left as they are.
    Metrics (means over generated tokens): ``distill/reverse_kl``, ``distill/reverse_kl_seq_mean`` (per row's
    summed reverse KL, over rows with a generated token), ``distill/teacher_log_prob``, ``distill/student_log_prob``,
    ``distill/signal_abs_mean`` (|coef * (teacher - student)|, what the update sees).
    """
    if mode not in DISTILL_MODES:
        raise ValueError(f"algorithm.distill.mode = {mode!r}; known: {list(DISTILL_MODES)}")
    mask = tensors["response_mask"]
    teacher = tensors["teacher_log_prob"]
    signal = distill_signal(teacher, student_log_prob, mask, coef)
    reverse_kl = torch.where(mask.bool(), student_log_prob.float() - teacher.float(), 0.0)
    rows = mask.sum(-1) > 0
    metrics = {
        "distill/reverse_kl": float(masked_mean(reverse_kl, mask)),
        "distill/reverse_kl_seq_mean": float(reverse_kl.sum(-1)[rows].mean()) if bool(rows.any()) else 0.0,
        "distill/teacher_log_prob": float(masked_mean(teacher.float(), mask)),
        "distill/student_log_prob": float(masked_mean(student_log_prob.float(), mask)),
        "distill/signal_abs_mean": float(masked_mean(signal.abs(), mask)),
    }
    if mode == "reward":
        rewards = tensors["token_level_rewards"]
        tensors["token_level_rewards"] = rewards + signal.to(rewards.dtype)
        return None, metrics
    return signal, metrics
