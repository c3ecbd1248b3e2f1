"""The environment interface every task implements, plus small shared helpers.

An environment is a text game: ``reset`` returns the first observation as text,
``step`` takes the model's action text and returns
``(observation, reward, done, info)``. ``info`` always carries three booleans:

- ``success``: the task is solved (stays True once reached),
- ``action_is_valid``: the action text parsed into a legal action,
- ``action_is_effective``: the action changed the environment state.

Any string is a legal *input* to ``step``: garbage text must never raise; it is
answered with ``action_is_valid=False`` and an unchanged state. This module
imports neither Ray nor torch nor a tokenizer.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# Characters stripped around an action before matching it against a name table:
# models often write "Left.", "`Up`", "**Down**" or "[Right]".
_STRIP_CHARS = " \t\r\n.,;:!?'\"`*()[]{}<>"
# Longer action strings are never a valid discrete action; skip the work.
MAX_DISCRETE_ACTION_CHARS = 200


class ServiceError(RuntimeError):
    """The service an environment talks to failed: unreachable, the connection lost, no answer within its timeout.

    An env raises it (instead of any other exception) when the fault is the service's, not the episode's: the
    env-state manager ends the episode as for any exception, and the rollout counts it
    (``<prefix>/service_failures``) and leaves it out of training and of its group's statistics
    (docs/reliability.md)."""


@dataclass
class EmptyConfig:
    """Config for environments that take no options."""


def make_info(
    success: bool = False,
    action_is_valid: bool = False,
    action_is_effective: bool = False,
    **extra: Any,
) -> dict:
    """Build a step ``info`` dict carrying the three keys every env must report."""
    info = {
        "success": bool(success),
        "action_is_valid": bool(action_is_valid),
        "action_is_effective": bool(action_is_effective),
    }
    info.update(extra)
    return info


def read_records(path: str | Path) -> list[dict]:
    """Read a data file of records: parquet, JSON (a list of objects) or JSONL (one object a line)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pandas as pd  # only data-file environments need it

        return pd.read_parquet(path).to_dict("records")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def parse_choice(action: Any, choices: Sequence[str]) -> str | None:
    """Match free text against a table of action names, case-insensitively.

    Returns the canonical name from ``choices`` or None when nothing matches.
    Surrounding whitespace, quotes, brackets and trailing punctuation are
    ignored. Never raises, whatever ``action`` is.
    """
    if not isinstance(action, str) or len(action) > MAX_DISCRETE_ACTION_CHARS:
        return None
    text = action.strip(_STRIP_CHARS).lower()
    for name in choices:
        if text == name.lower():
            return name
    return None


class BaseEnv(abc.ABC):
    """A text environment: observations and actions are strings.

    Subclasses set ``config_cls`` (a dataclass; its fields are the env's
    options, validated by the registry) and implement ``reset``, ``step``,
    ``render`` and ``action_description``. ``close``, ``legend`` and
    ``expert_action`` have defaults.

    Discrete-action environments parse the action text against a name table
    (see ``parse_choice``); free-text environments (math answers, shopping
    commands) parse it themselves. Either way ``step`` must accept any string.
    """

    config_cls: type = EmptyConfig

    def __init__(self, config: Any = None):
        """Store the config (an instance of ``config_cls``; defaults when None)."""
        self.config = config if config is not None else self.config_cls()

    @abc.abstractmethod
    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start a new episode; the same seed must give the same observation."""

    @abc.abstractmethod
    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Apply one action text; return (observation, reward, done, info)."""

    @abc.abstractmethod
    def render(self) -> str:
        """The current state as text (what the model sees)."""

    @abc.abstractmethod
    def action_description(self) -> str:
        """Text describing the valid actions, e.g. ``"Left | Down | Right | Up"``."""

    def legend(self) -> str:
        """Text explaining the symbols used by ``render`` ("" when none)."""
        return ""

    def close(self) -> None:
        """Release resources (files, subprocesses). Safe to call twice."""

    def note(self) -> str | None:
        """A short note of what the current observation says that matters for the next move, in the
        observation's own words (FrozenLake with ``describe_surroundings``: ``Down: ice, Right: hole.``), or None.

        The model build's warm-up writes it as the think of its replies (random actions still), so the model
        learns to copy what it reads before it answers; demonstrators may think it too (docs/tiny_model.md).
        None (the default): the warm-up thinks a template."""
        return None

    def expert_action(self) -> str:
        """The action an expert solver takes from the current state.

        Used by tests (every generated level is solvable), SFT warm starts and
        the oracle line in benchmarks. Environments without a solver raise.
        """
        raise NotImplementedError(f"{type(self).__name__} has no expert solver")
