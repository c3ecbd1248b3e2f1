"""``summary``: the policy itself summarises the steps older than the last ``keep_last_n_steps``.

The context is the ``simple`` recap prompt with the summary placed after the
instruction::

    <instruction>
    Summary of turns 1-m:
    <the policy's summary>
    Recent turns (the last n): ...
    Current observation (turn k): ...

The summary is written by the policy (in training: the rollout engines, with
the current weights, batched over episodes through ``summary_request`` /
``accept_summary``; standalone: ``generate(prompt_ids, summary_max_tokens)``). Its ids are returned
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
    SummaryRequest,
    TrajectorySoFar,
    fit_to_budget,
    register_condenser,
)
from agent_trainer.condensers.layouts import common_prefix_len, step_recaps
from agent_trainer.condensers.strategies import recap_draft

SUMMARY_REQUEST = ("Summarise the earlier turns of this task for yourself in a few sentences: what you tried, "
                   "what happened, and what you know now. Reply with the summary only.")


@register_condenser("summary")
class SummaryCondenser(ContextCondenser):
    """The task, a policy-written summary of older steps, and the last ``keep_last_n_steps`` steps.

    In training the rollout asks ``summary_request`` for every episode after each
    env step, generates all requests in one engine call and hands the ids back
    through ``accept_summary``; ``build`` then reuses the remembered summary and
    calls nothing. Standalone, ``generate`` is called inside ``build`` instead.
    """

    def build(self, traj: TrajectorySoFar) -> Draft:
        older = max(0, len(traj.steps) - self.config.keep_last_n_steps)
        if older == 0:
            return recap_draft(self, traj, traj.instruction, summary=None)
        call = None
        request = self.summary_request(traj)
        if request is not None:
            if self.generate is None:
                raise RuntimeError("the summary condenser needs a summary of turns 1-{} that was never generated: "
                                   "pass generate= or hand the rollout's ids to accept_summary".format(older))
            start = time.perf_counter()
            output = list(self.generate(request.prompt_ids, request.max_tokens))
            call = self.accept_summary(traj, request, output, time.perf_counter() - start)
        instruction = f"{traj.instruction.strip()}\nSummary of turns 1-{older}:\n{traj.summary.text}"
        return recap_draft(self, traj, instruction, summary=call)

    def summary_request(self, traj: TrajectorySoFar) -> SummaryRequest | None:
        """The prompt of a summary of steps 1..older, or None while the remembered one covers them.

        Incremental: a remembered summary of steps 1..m (m < older) is sent with
        steps m+1..older only.
        """
        older = max(0, len(traj.steps) - self.config.keep_last_n_steps)
        prev = traj.summary if traj.summary is not None and traj.summary.covers_steps <= older else None
        if older == 0 or (prev is not None and prev.covers_steps == older):
            return None
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
        return SummaryRequest(prompt_ids=prompt, max_tokens=self.config.summary_max_tokens, covers_steps=older)
