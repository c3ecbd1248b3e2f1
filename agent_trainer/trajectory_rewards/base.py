"""Typed inputs and outputs of trajectory reward computers, and their registry (config: agent_trainer.config.rewards).

A computer maps one finished multi-turn trajectory to one reward (multi-turn
GRPO, ``docs/multiturn_grpo.md``)::

    R = 0                                      bad format (``format_validation``)
    R = 0                                      wrong answer (checked against the ground truth)
    R = efficiency_scale / max_context_length  otherwise

where ``max_context_length`` is the trajectory's longest training row in
tokens: max over its steps k of len(c_k) + len(o_k), the condensed context the
step was generated from plus the tokens it generated.

Computers are registered by name (``register_reward_computer("grpo")``) and
looked up by that name or by a "package.module:ClassName" import path, as
environments are (``envs/registry.py``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from agent_trainer.config.rewards import RewardComputationConfig
from agent_trainer.common.plugins import PluginRegistry

"""``reward_computation.domain`` values."""


@dataclass(frozen=True)
class IOCase:
    """One stdin/stdout test of a coding problem (APPS / CodeContests style)."""

    input: str
    output: str


@dataclass(frozen=True)
class GroundTruth:
    """What a correct answer must match: reference answers (general, math) or tests (coding)."""

    answers: tuple[str, ...] = ()
    """Accepted answers; any one matching is correct."""
    tests: str = ""
    """Coding: Python test code run after the program (e.g. MBPP's assert lines); passes when it runs to the end."""
    io_cases: tuple[IOCase, ...] = ()
    """Coding: stdin/stdout cases; every one must print the expected output (trailing whitespace ignored)."""

    @classmethod
    def from_record(cls, rec: dict, where: str) -> "GroundTruth":
        """From a data record: ``answer`` (str or list) and/or ``tests``.

        ``tests`` is Python test code, a list of lines of it (MBPP's ``test_list``),
        or a list of ``{input, output}`` stdin/stdout cases.
        """
        answers = rec.get("answer", rec.get("answers", ()))
        answers = (answers,) if isinstance(answers, (str, int, float)) else tuple(answers or ())
        tests = rec.get("tests", "")
        io_cases: tuple[IOCase, ...] = ()
        if isinstance(tests, list) and tests and all(isinstance(t, dict) for t in tests):
            try:
                io_cases = tuple(IOCase(input=str(t["input"]), output=str(t["output"])) for t in tests)
            except KeyError as exc:
                raise ValueError(f"{where}: every stdin/stdout test needs 'input' and 'output' "
                                 f"(missing {exc})") from None
            tests = ""
        elif isinstance(tests, list):
            tests = "\n".join(str(t) for t in tests)
        elif not isinstance(tests, str):
            raise ValueError(f"{where}: 'tests' must be a string, a list of strings or a list of {{input, output}}")
        gt = cls(answers=tuple(str(a) for a in answers), tests=tests, io_cases=io_cases)
        if not gt.answers and not gt.tests and not gt.io_cases:
            raise ValueError(f"{where}: a ground truth needs 'answer' or 'tests'; the record has keys {sorted(rec)}")
        return gt


@dataclass
class FinishedTrajectory:
    """One finished trajectory as the reward sees it (text of the outputs, lengths in tokens)."""

    question_id: str
    outputs: list[str]
    """Every step's decoded output o_k, in order; the last one holds the final answer."""
    max_context_length: int
    """max over steps k of len(c_k) + len(o_k), in tokens (the longest training row)."""
    ground_truth: GroundTruth | None = None
    """From the dataset row; None = look ``question_id`` up in ``ground_truth_file``."""

    @property
    def final_output(self) -> str:
        return self.outputs[-1] if self.outputs else ""


def longest_row(context_lengths: list[int], output_lengths: list[int]) -> int:
    """max_k len(c_k) + len(o_k): the ``max_context_length`` of a trajectory (0 for no step)."""
    return max((c + o for c, o in zip(context_lengths, output_lengths, strict=True)), default=0)


@dataclass
class TrajectoryReward:
    """One trajectory's reward and why."""

    reward: float
    format_ok: bool
    correct: bool
    reason: str
    """"ok", or the first rule that failed (e.g. "format: no <answer> tag", "wrong answer", "tests: timed out")."""
    max_context_length: int
    seconds: float = 0.0
    """Time this trajectory's reward took (the sandbox run included)."""


class TrajectoryRewardComputer(abc.ABC):
    """Maps a finished trajectory to one reward. Subclasses implement ``compute``.

    ``compute`` must not raise on anything the policy wrote: unparsable,
    crashing or non-terminating answers are reward 0.
    """

    def __init__(self, config: RewardComputationConfig):
        self.config = config

    @abc.abstractmethod
    def compute(self, trajectory: FinishedTrajectory) -> TrajectoryReward:
        """The trajectory's reward."""


REWARD_COMPUTERS: PluginRegistry[TrajectoryRewardComputer] = PluginRegistry(TrajectoryRewardComputer,
                                                                         "reward_computation.type")
register_reward_computer = REWARD_COMPUTERS.register
"""Class decorator: ``@register_reward_computer("name")`` makes a computer available as ``reward_computation.type``."""
list_reward_computers = REWARD_COMPUTERS.names
get_reward_computer_cls = REWARD_COMPUTERS.get
