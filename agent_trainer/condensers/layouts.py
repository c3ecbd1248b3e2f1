"""The two context layouts the strategies build on.

- Conversation (``full``, ``truncate``): the episode as ``ctx_manager.mode=full``
  lays it out, rendered by :class:`agent_trainer.agents.ctx_manager.ContextManager`
  itself (the condenser is handed that rendering, :class:`ConversationLayout`): the first prompt (system, instruction,
  first observation, assistant header), then per step its output ids verbatim (plus an eos when cut) and the
  next observation as a user message ending in the assistant header. Each
  step's (output, observation) segment starts right after an assistant header,
  so whole segments can be dropped and the rest stays a well-formed chat.
- Recap (``simple``, ``summary``): one fresh prompt whose user message holds the
  instruction, a text recap of recent steps and the current observation,
  rendered by :func:`condensed_user_message`: the layout the condensed
  context manager rendered before condensers existed (``simple`` keeps it token for token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agent_trainer.common import prompts

NO_ANSWER = "(no <answer> block)"
"""How a recap shows a reply without an answer."""


@dataclass
class TurnSummary:
    """What a recap prompt remembers of a past turn (text only)."""

    turn: int
    observation: str
    """The observation the turn answered."""
    answer: str
    """The reply's <answer> text (its reasoning is dropped), or the whole reply (step_view=reply)."""
    reward: float


def condensed_user_message(instruction: str, history: list[TurnSummary], observation: str, turn: int,
                           enable_think: bool = True) -> str:
    """The user message of a recap prompt: instruction, recent turns as text, current observation, format."""
    parts = [instruction.strip()]
    if history:
        lines = [f"Recent turns (the last {len(history)}):"]
        for h in history:
            lines.append(f"Turn {h.turn}:\nObservation:\n{h.observation.strip()}\n"
                         f"Your answer: {h.answer}\nReward: {h.reward:g}")
        parts.append("\n".join(lines))
    parts.append(f"Current observation (turn {turn}):\n{observation.strip()}")
    parts.append(prompts.format_instruction(enable_think))
    return "\n".join(p for p in parts if p)


class ConversationLayout(Protocol):
    """The ``full`` layout of a trajectory, as ``ctx_manager.mode=full`` renders it: the condensed context manager
    hands its condenser one (:class:`agent_trainer.agents.ctx_manager.FullConversation`) through
    ``make_condenser(..., conversation=...)``."""

    def segments(self, traj) -> tuple[list[int], list[list[int]]]:
        """(first prompt ids, [o_k (+ eos) + observation-after-k ids for every step k])."""


def step_recaps(condenser, traj) -> list[TurnSummary]:
    """What a text layout shows of each past step: the observation it answered, its answer (or reply), its reward."""
    out = []
    for k, step in enumerate(traj.steps, start=1):
        text = condenser.decode(step.output_ids)
        if condenser.config.step_view == "reply":
            shown = text.strip() or NO_ANSWER
        else:
            shown = prompts.parse_response(text, condenser.action_sep, condenser.enable_think).answer or NO_ANSWER
        out.append(TurnSummary(turn=k, observation=traj.observation_before(k), answer=shown, reward=step.reward))
    return out


def recap_prompt_ids(condenser, instruction: str, recent: list[TurnSummary], traj) -> list[int]:
    """The recap layout's prompt: instruction, the ``recent`` steps, the current observation, the reply format."""
    user = condensed_user_message(instruction, recent, traj.current_observation, len(traj.steps) + 1,
                                  condenser.enable_think)
    return condenser.chat_prompt_ids(user)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
