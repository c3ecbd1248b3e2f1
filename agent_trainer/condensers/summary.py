"""``summary``: the policy itself summarises the steps older than the last ``keep_last_n_steps``.

The context is the ``simple`` recap prompt with the summary placed after the
instruction::

    <instruction>
    Summary of turns 1-m:
    <the policy's summary>
    Recent turns (the last n): ...
    Current observation (turn k): ...

The summary is written by ``generate(prompt_ids, summary_max_tokens)`` (in
training: the rollout engine, with the current weights). Its ids are returned
in ``CondensedContext.summary`` for accounting and timing only: they are
context, never a training row, and their loss mask is 0. Summaries are
incremental: with the last one kept on the trajectory (``TrajectorySoFar.remember``)
only steps it does not cover are sent, together with it; while it still covers
every older step, no call is made.
"""

from __future__ import annotations

import time

from agent_trainer.condensers.base import (
    ContextCondenser,
    Draft,
    SummaryCall,
    TrajectorySoFar,
    fit_to_budget,
    register_condenser,
)
from agent_trainer.condensers.layouts import common_prefix_len, step_recaps
from agent_trainer.condensers.strategies import recap_draft

SUMMARY_REQUEST = ("Summarise the earlier turns of this task for yourself in a few sentences: what you tried, "
                   "what happened, and what you know now. Reply with the summary only.")
EMPTY_SUMMARY = "(no summary)"


@register_condenser("summary")
class SummaryCondenser(ContextCondenser):
    """The task, a policy-written summary of older steps, and the last ``keep_last_n_steps`` steps."""

    def __init__(self, tokenizer, config, *, generate=None, enable_think: bool = True, action_sep: str = "||"):
        super().__init__(tokenizer, config, generate=generate, enable_think=enable_think, action_sep=action_sep)
        if generate is None:
            raise ValueError("multiturn_trajectory.context_condenser.type = 'summary' needs generate(prompt_ids, "
                             "max_tokens) -> token ids (the rollout engine); pass generate=")

    def build(self, traj: TrajectorySoFar) -> Draft:
        older = max(0, len(traj.steps) - self.config.keep_last_n_steps)
        if older == 0:
            return recap_draft(self, traj, traj.instruction, summary=None)
        prev = traj.summary if traj.summary is not None and traj.summary.covers_steps <= older else None
        call = None
        if prev is not None and prev.covers_steps == older:
            text = prev.text
        else:
            call = self.summarize(traj, prev, older)
            text = call.text
        instruction = f"{traj.instruction.strip()}\nSummary of turns 1-{older}:\n{text}"
        return recap_draft(self, traj, instruction, summary=call)

    def summarize(self, traj: TrajectorySoFar, prev: SummaryCall | None, older: int) -> SummaryCall:
        """Ask the policy for a summary of steps 1..older (extending ``prev`` when there is one)."""
        first = prev.covers_steps if prev is not None else 0
        parts = [SUMMARY_REQUEST, f"Task:\n{traj.instruction.strip()}"]
        if prev is not None:
            parts.append(f"Summary so far (turns 1-{prev.covers_steps}):\n{prev.text}")
        for r in step_recaps(self, traj)[first:older]:
            parts.append(f"Turn {r.turn}:\nObservation:\n{r.observation.strip()}\nYour answer: {r.answer}\n"
                         f"Reward: {r.reward:g}")
        prompt = self.chat_prompt_ids("\n".join(parts))
        head = common_prefix_len(prompt, self.chat_prompt_ids(parts[0] + "\n" + parts[1]))
        prompt, _, _ = fit_to_budget(prompt, self.config.max_condensed_tokens, head)
        start = time.perf_counter()
        output = list(self.generate(prompt, self.config.summary_max_tokens))[: self.config.summary_max_tokens]
        seconds = time.perf_counter() - start
        text = self.decode(output).strip() or EMPTY_SUMMARY
        return SummaryCall(prompt_ids=prompt, output_ids=output, text=text, covers_steps=older, seconds=seconds)
