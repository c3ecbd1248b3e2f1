"""Typed inputs and outputs of trajectory reward computers, their config, and the registry.

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
from dataclasses import dataclass, field

from agent_trainer.plugins import PluginRegistry
from agent_trainer.trajectory_rewards.sandbox import SandboxLimits

DOMAINS = ("general", "math", "coding")
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


@dataclass
class FormatValidationConfig:
    """``reward_computation.format_validation``: rules a trajectory must meet, else reward 0."""

    require_answer_tag: bool = True
    """The final output holds <answer>...</answer>; the answer is its content (else the whole final output)."""
    require_think_tag: bool = False
    """A <think>...</think> block comes before the <answer> block in the final output."""
    max_answer_chars: int = 4096
    """Longest accepted answer in characters (0 = no limit)."""
    require_nonempty_outputs: bool = True
    """Every step's output has non-blank text."""
    require_boxed: bool = False
    """Math: the answer contains \\boxed{...}."""
    require_code_block: bool = False
    """Coding: the answer contains a fenced ``` code block."""

    def __post_init__(self):
        if isinstance(self.max_answer_chars, bool) or not isinstance(self.max_answer_chars, int) \
                or self.max_answer_chars < 0:
            raise ValueError(f"reward_computation.format_validation.max_answer_chars = {self.max_answer_chars!r} "
                             "must be an int >= 0 (0 = no limit)")


@dataclass
class RewardComputationConfig:
    """``reward_computation``: how a finished trajectory becomes one reward, and how it meets the env rewards."""

    enable: bool = False
    """Score every finished trajectory with the computer below (needs ctx_manager.mode=condensed and the
    question environment, data.train_files). The reward sits on the last generated token of the trajectory's
    last turn: R_total = env_reward_weight x (sum of the env's turn rewards) + trajectory_reward_weight x R."""
    env_reward_weight: float = 1.0
    """Weight of the environment's per-turn rewards (format penalty included) when enable; 0 = the trajectory
    reward alone (seed 004's R)."""
    trajectory_reward_weight: float = 1.0
    """Weight of the computer's trajectory reward R when enable."""
    type: str = "grpo"
    """Registered reward computer name, or "package.module:ClassName"."""
    domain: str = "general"
    """How answers are checked: general (normalised exact match), math (numeric / LaTeX equivalence),
    coding (the answer is a Python program run against the row's tests in a sandbox)."""
    ground_truth_file: str | None = None
    """JSON or JSONL of ground truths keyed by question id; used when a row carries none."""
    format_validation: FormatValidationConfig = field(default_factory=FormatValidationConfig)
    """Format rules; a trajectory breaking one gets reward 0."""
    efficiency_scale: float = 1000.0
    """A correct trajectory earns efficiency_scale / max_context_length (1000: per thousand tokens, so a
    correct answer whose longest row is 500 tokens earns 2.0; 1.0 gives the seed's literal 1/L)."""
    num_workers: int = 2
    """Threads of BatchTrajectoryRewardComputer (each coding check is a sandboxed subprocess)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits of each coding sandbox run (wall_s, cpu_s, mem_mb, max_output_bytes, ...)."""

    def __post_init__(self):
        if isinstance(self.format_validation, dict):
            self.format_validation = FormatValidationConfig(**self.format_validation)
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxLimits(**self.sandbox)
        if self.domain not in DOMAINS:
            raise ValueError(f"reward_computation.domain = {self.domain!r} is not one of {list(DOMAINS)}; "
                             "set it to one of them")
        if not isinstance(self.efficiency_scale, (int, float)) or self.efficiency_scale <= 0:
            raise ValueError(f"reward_computation.efficiency_scale = {self.efficiency_scale!r} must be > 0")
        for name in ("env_reward_weight", "trajectory_reward_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"reward_computation.{name} = {value!r} must be a finite number >= 0")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"reward_computation.num_workers = {self.num_workers!r} must be an int >= 1")
        REWARD_COMPUTERS.get(self.type)  # an unknown type fails here, before any worker starts


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
