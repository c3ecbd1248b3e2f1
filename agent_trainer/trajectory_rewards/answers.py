"""Answer extraction, format rules and the per-domain correctness checks.

Model output is untrusted text: nothing here evaluates it. Math answers are
compared by ``envs.metamathqa.answers_match`` (numbers, fractions, simple LaTeX);
coding answers run only inside ``sandbox.run_python``'s subprocess.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from agent_trainer.common import prompts
from agent_trainer.config.rewards import FormatValidationConfig, SandboxLimits
from agent_trainer.trajectory_rewards.base import FinishedTrajectory, GroundTruth
from agent_trainer.trajectory_rewards.sandbox import run_python
from envs.metamathqa import answers_match

_CODE_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_FINAL_ANSWER = re.compile(r"final answer\s*(?:is)?\s*:?", re.IGNORECASE)
_ASSIGNMENT = re.compile(r"^\s*[A-Za-z]\s*=\s*(.+)$", re.DOTALL)


@dataclass
class Verdict:
    """The outcome of one rule or check: ok, and why not."""

    ok: bool
    reason: str = "ok"


def extract_answer(final_output: str, rules: FormatValidationConfig) -> tuple[str, Verdict]:
    """The answer text of the final output, and whether the trajectory's final output meets the format rules.

    The answer is the content of the first <answer> block (parsed by
    ``prompts.parse_response``), or the whole output when there is none and
    ``require_answer_tag`` is off.
    """
    parsed = prompts.parse_response(final_output, action_sep="", enable_think=rules.require_think_tag)
    has_tag = bool(re.search(r"<answer>.*?</answer>", final_output or "", re.DOTALL))
    answer = parsed.answer if has_tag else (final_output or "").strip()
    if rules.require_answer_tag and not has_tag:
        return answer, Verdict(False, "format: no <answer>...</answer> block")
    if rules.require_think_tag and not parsed.think:
        return answer, Verdict(False, "format: no non-empty <think>...</think> block before the answer")
    if not answer:
        return answer, Verdict(False, "format: empty answer")
    if rules.max_answer_chars and len(answer) > rules.max_answer_chars:
        return answer, Verdict(False, f"format: answer has {len(answer)} characters > {rules.max_answer_chars}")
    if rules.require_boxed and "\\boxed{" not in answer:
        return answer, Verdict(False, "format: no \\boxed{...} in the answer")
    if rules.require_code_block and not _CODE_BLOCK.search(answer):
        return answer, Verdict(False, "format: no ``` code block in the answer")
    return answer, Verdict(True)


def check_format(trajectory: FinishedTrajectory, rules: FormatValidationConfig) -> tuple[str, Verdict]:
    """Every format rule over the whole trajectory; returns the extracted answer too."""
    if not trajectory.outputs:
        return "", Verdict(False, "format: the trajectory has no output")
    if rules.require_nonempty_outputs:
        blank = [k + 1 for k, text in enumerate(trajectory.outputs) if not (text or "").strip()]
        if blank:
            return "", Verdict(False, f"format: step {blank[0]} has an empty output")
    return extract_answer(trajectory.final_output, rules)


# --------------------------------------------------------------------------- domains


def normalize_text(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = (text or "").lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def check_general(answer: str, truth: GroundTruth) -> Verdict:
    """Normalised exact match against any reference answer."""
    pred = normalize_text(answer)
    ok = bool(pred) and any(pred == normalize_text(gold) for gold in truth.answers)
    return Verdict(ok, "ok" if ok else "wrong answer")


def math_answer(answer: str) -> str:
    """The final value of a math answer: after "final answer:", and "x = 5" -> "5".

    ``answers_match`` then unwraps the last \\boxed{} and "The answer is:" itself.
    """
    answer = _FINAL_ANSWER.split(answer or "")[-1]
    if "\\boxed{" not in answer:
        m = _ASSIGNMENT.match(answer.strip().strip("$"))
        if m:
            answer = m.group(1)
    return answer.strip()


def check_math(answer: str, truth: GroundTruth) -> Verdict:
    """Numeric, fraction or normalised-LaTeX equality with any reference answer (MetaMathQA's comparison)."""
    pred = math_answer(answer)
    ok = any(answers_match(pred, gold) for gold in truth.answers)
    return Verdict(ok, "ok" if ok else "wrong answer")


def program_of(answer: str) -> str:
    """The program in an answer: the first fenced code block (python or untagged), else the whole answer."""
    blocks = _CODE_BLOCK.findall(answer or "")
    for lang, body in blocks:
        if lang.lower() in ("", "python", "py", "python3"):
            return body
    return blocks[0][1] if blocks else (answer or "")


def check_coding(answer: str, truth: GroundTruth, limits: SandboxLimits) -> Verdict:
    """Run the answer's program against the tests in the sandbox; any failure, timeout or crash is wrong."""
    if not truth.tests and not truth.io_cases:
        raise ValueError("a coding ground truth needs 'tests' (assert code or stdin/stdout cases)")
    program = program_of(answer)
    if truth.tests:
        result = run_python(program, truth.tests, limits=limits)
        if not result.passed:
            return Verdict(False, _failure("tests", result))
    for i, case in enumerate(truth.io_cases):
        result = run_python(program, "", stdin=case.input, limits=limits)
        if not result.passed:
            return Verdict(False, _failure(f"io case {i}", result))
        if _lines(result.stdout_tail) != _lines(case.output):
            return Verdict(False, f"io case {i}: wrong output")
    return Verdict(True)


def _lines(text: str) -> list[str]:
    """Output compared line by line, trailing whitespace and trailing blank lines ignored."""
    lines = [line.rstrip() for line in (text or "").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _failure(what: str, result) -> str:
    if result.timed_out:
        return f"{what}: timed out"
    if result.output_exceeded:
        return f"{what}: output limit exceeded"
    return f"{what}: failed (exit code {result.exit_code})"
