"""The text the policy sees and the format it must answer in.

One place defines the chat messages built from environment observations and
the parser for the policy's reply, so the rollout, the tiny-model warm-up and
the tests all agree on the format:

    <think>free reasoning</think><answer>Action1 || Action2</answer>

Model output is untrusted text: the parser never raises and never evaluates
anything; an unparsable reply yields no actions (the environment manager then
charges ``es_manager.format_penalty``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SYSTEM_PROMPT = "You are a helpful agent that solves tasks by acting in an environment."

THINK_ANSWER_FORMAT = "Reply exactly as <think>your reasoning</think><answer>your action</answer>."
ANSWER_ONLY_FORMAT = "Reply exactly as <answer>your action</answer>."


@dataclass
class _Block:
    """A ``<tag>inner</tag>`` span: where it starts and ends in the text, and its inner text."""

    start: int
    end: int
    inner: str


def _first_block(text: str, tag: str) -> _Block | None:
    """The first complete ``<tag>...</tag>`` block (the shortest one from the first opening tag).

    Two ``str.find`` calls, so linear in the text's length whatever it holds. The
    same result as a non-greedy DOTALL regex search, which instead backtracks
    quadratically on many unclosed opening tags. Stray text around the block is allowed.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    start = text.find(opening)
    if start < 0:
        return None
    end = text.find(closing, start + len(opening))
    if end < 0:  # no closing tag after the first opening one, so none after any later one either
        return None
    return _Block(start, end + len(closing), text[start + len(opening) : end])


def format_instruction(enable_think: bool) -> str:
    """Return the sentence that tells the policy how to format its reply."""
    return THINK_ANSWER_FORMAT if enable_think else ANSWER_ONLY_FORMAT


def first_user_message(instruction: str, observation: str, enable_think: bool = True) -> str:
    """Build the first user turn: task instruction, initial observation, reply format."""
    parts = [instruction.strip(), f"Observation:\n{observation.strip()}", format_instruction(enable_think)]
    return "\n".join(p for p in parts if p)


def next_user_message(observation: str, reward: float, enable_think: bool = True) -> str:
    """Build a later user turn: the reward of the last turn and the new observation."""
    return f"Reward: {reward:g}\nObservation:\n{observation.strip()}\n{format_instruction(enable_think)}"


@dataclass
class ParsedResponse:
    """The policy's reply split into reasoning and actions.

    ``actions`` is empty when the reply has no well-formed ``<answer>`` block
    (or, with ``enable_think``, no ``<think>`` block before it): a format error.
    """

    think: str = ""
    answer: str = ""
    actions: list[str] = field(default_factory=list)
    format_ok: bool = False


def parse_response(text: str, action_sep: str = "||", enable_think: bool = True) -> ParsedResponse:
    """Parse ``<think>..</think><answer>..</answer>`` into a list of action strings.

    Never raises: any input (including non-text garbage a tiny model emits)
    gives a ``ParsedResponse``; malformed replies have ``format_ok=False`` and
    no actions.
    """
    if not isinstance(text, str):
        return ParsedResponse()
    answer_block = _first_block(text, "answer")
    if answer_block is None:
        return ParsedResponse()
    think = ""
    if enable_think:
        think_block = _first_block(text, "think")
        if think_block is None or think_block.end > answer_block.start:
            return ParsedResponse(answer=answer_block.inner.strip())
        think = think_block.inner.strip()
    answer = answer_block.inner.strip()
    actions = [a.strip() for a in answer.split(action_sep)] if action_sep else [answer]
    actions = [a for a in actions if a]
    return ParsedResponse(think=think, answer=answer, actions=actions, format_ok=bool(actions))
