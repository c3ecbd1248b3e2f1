"""The built-in condensers: ``full``, ``truncate`` and ``simple`` (``summary`` is in ``summary.py``)."""

from __future__ import annotations

from agent_trainer.condensers.base import ContextCondenser, Draft, TrajectorySoFar, register_condenser
from agent_trainer.condensers.layouts import common_prefix_len, recap_prompt_ids, step_recaps


@register_condenser("full")
class FullCondenser(ContextCondenser):
    """No condensation: the whole conversation, laid out as ``ctx_manager.mode=full`` does.

    Over budget, whole steps are dropped from the oldest (the task prompt
    stays, and the rest stays a well-formed chat); if the task and the last
    step alone do not fit, ``condense`` clips tokens.
    """

    def build(self, traj: TrajectorySoFar) -> Draft:
        task, segments = self.conversation.segments(traj)
        total = len(task) + sum(len(s) for s in segments)
        uncondensed, drop = total, 0
        while total > self.config.max_condensed_tokens and drop < len(segments) - 1:
            total -= len(segments[drop])
            drop += 1
        ids = task + [t for seg in segments[drop:] for t in seg]
        return Draft(ids, head_len=len(task), kept_steps=len(segments) - drop, dropped_for_budget=drop > 0,
                     uncondensed=uncondensed)


@register_condenser("truncate")
class TruncateCondenser(ContextCondenser):
    """The task prompt plus the most recent tokens of the conversation, cut at the token (not the step).

    ``condense`` keeps the first min(len(task prompt), budget // 2) tokens and
    fills the rest of ``max_condensed_tokens`` with the latest tokens.
    """

    def build(self, traj: TrajectorySoFar) -> Draft:
        task, segments = self.conversation.segments(traj)
        ids = task + [t for seg in segments for t in seg]
        budget = self.config.max_condensed_tokens
        room = budget - min(len(task), budget // 2) if len(ids) > budget else len(ids)
        kept = 0
        for seg in reversed(segments):  # steps whose whole segment survives the cut
            room -= len(seg)
            if room < 0:
                break
            kept += 1
        return Draft(ids, head_len=len(task), kept_steps=kept, uncondensed=len(ids))


@register_condenser("simple")
class SimpleCondenser(ContextCondenser):
    """The task plus exactly the last ``keep_last_n_steps`` steps, as a text recap in one fresh prompt.

    With ``step_view="answer"`` the prompt is token for token the one
    ``ctx_manager.mode=condensed`` renders with ``keep_last_n_turns`` = n.
    Over budget, the oldest shown steps are dropped first (``truncated``).
    """

    def build(self, traj: TrajectorySoFar) -> Draft:
        return recap_draft(self, traj, traj.instruction, summary=None)


def recap_draft(condenser: ContextCondenser, traj: TrajectorySoFar, instruction: str, summary) -> Draft:
    """The recap prompt with the last n steps, dropping the oldest shown ones while it is over budget."""
    recaps = step_recaps(condenser, traj)
    n = min(condenser.config.keep_last_n_steps, len(recaps))
    for m in range(n, -1, -1):
        ids = recap_prompt_ids(condenser, instruction, recaps[len(recaps) - m:] if m else [], traj)
        if len(ids) <= condenser.config.max_condensed_tokens:
            break
    head = common_prefix_len(ids, condenser.chat_prompt_ids(traj.instruction.strip()))
    return Draft(ids, head_len=head, kept_steps=m, dropped_for_budget=m < n, summary=summary)
