"""MetaMathQA: answer a math question; retry on a wrong answer.

Records follow MetaMathQA's format (``query``, ``response`` ending in
"The answer is: X"; ``type`` optional) in JSON, JSONL or parquet. The
default ``data_path`` is a sample of a few hundred generated problems shipped
in ``envs/data`` (regenerate with ``python -m envs.data.make_metamathqa_sample``);
point ``data_path`` at the real MetaMathQA-395K.json to train on it.

The action is the final answer text (``\\boxed{}``, ``$...$`` and an "The answer
is:" prefix are accepted). Answers compare as equal when they are the same
number (``0.5``, ``1/2``, ``\\frac{1}{2}``, ``1,000``) or the same text after
LaTeX spacing is normalised. A correct answer on attempt k (0-based) pays
``1 / 2**k`` and ends the episode; a wrong one pays 0 and the episode ends
after ``max_attempts`` answers.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import BaseEnv, make_info, read_records

DEFAULT_DATA = str(Path(__file__).parent / "data" / "metamathqa_sample.jsonl")
MAX_ANSWER_CHARS = 500
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_FRAC = re.compile(r"^([-+]?)\\frac\{([-+]?[\d.]+)\}\{([-+]?[\d.]+)\}$")
_FRAC_SHORT = re.compile(r"^([-+]?)\\frac(\d)(\d)$")
_SLASH = re.compile(r"^([-+]?[\d.]+)/([-+]?[\d.]+)$")


def _unwrap_boxed(text: str) -> str:
    """Content of the last \\boxed{...} (brace-matched), or the text unchanged."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return text
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += text[j] == "{"
        depth -= text[j] == "}"
        if depth == 0:
            return text[i + 1:j]
    return text


def normalize_answer(text: Any) -> str:
    """Canonical string form of an answer (LaTeX spacing, $, boxes, units of % removed)."""
    if not isinstance(text, str):
        return ""
    text = text.strip()[:MAX_ANSWER_CHARS]
    text = re.split(r"answer is:?", text, flags=re.IGNORECASE)[-1]
    text = _unwrap_boxed(text).strip().strip("$").strip()
    for old, new in [("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""),
                     ("\\%", ""), ("%", ""), ("\\$", ""), ("$", "")]:
        text = text.replace(old, new)
    text = re.sub(r"\s+", "", text).rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", text):  # 1,000 -> 1000
        text = text.replace(",", "")
    return text


def to_number(text: str) -> Fraction | None:
    """Exact value of a normalised answer that is a number or simple fraction."""
    try:
        if _NUMBER.match(text):
            return Fraction(text)
        for pattern in (_FRAC, _FRAC_SHORT):
            m = pattern.match(text)
            if m:
                value = Fraction(m.group(2)) / Fraction(m.group(3))
                return -value if m.group(1) == "-" else value
        m = _SLASH.match(text)
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(predicted: Any, gold: Any) -> bool:
    """True when the answers are equal numbers or equal normalised text."""
    p, g = normalize_answer(predicted), normalize_answer(gold)
    if not p or not g:
        return False
    pn, gn = to_number(p), to_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    return p == g


def extract_gold(response: str) -> str:
    """The final answer of a MetaMathQA response ("The answer is: X", else \\boxed{X})."""
    idx = response.rfind("The answer is")
    if idx >= 0:
        return response[idx:].split(":", 1)[-1].strip()
    boxed = _unwrap_boxed(response)
    return boxed if boxed != response else response.strip().splitlines()[-1]


@functools.lru_cache(maxsize=4)
def load_records(path: str | Path) -> list[dict]:
    """Read MetaMathQA records (query, response) from JSON, JSONL or parquet.

    Cached per path: every episode of a run shares one read-only copy.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"MetaMathQA data_path {str(path)!r} does not exist")
    records = read_records(path)
    for i, rec in enumerate(records):
        if "query" not in rec or "response" not in rec:
            raise ValueError(f"{path} record {i} needs 'query' and 'response'; has keys {sorted(rec)}")
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


@dataclass
class MetaMathQAConfig:
    """Options of the MetaMathQA environment."""

    data_path: str = DEFAULT_DATA
    """JSON / JSONL / parquet file of MetaMathQA records."""
    max_attempts: int = 3
    """Answers allowed per question."""

    def __post_init__(self):
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be a positive int, got {self.max_attempts!r}")
        if not Path(self.data_path).exists():
            raise ValueError(f"data_path {self.data_path!r} does not exist")


class MetaMathQAEnv(BaseEnv):
    """Question answering with retries and a halving reward per attempt."""

    config_cls = MetaMathQAConfig

    def __init__(self, config: MetaMathQAConfig | None = None):
        """Load the records."""
        super().__init__(config)
        self.records = load_records(str(self.config.data_path))
        self.question, self.gold = "", ""
        self.attempts, self.done, self.success, self.feedback = 0, False, False, ""

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Pick the question for ``seed``."""
        rec = self.records[int(np.random.default_rng(seed).integers(len(self.records)))]
        self.question, self.gold = str(rec["query"]), extract_gold(str(rec["response"]))
        self.attempts, self.done, self.success, self.feedback = 0, False, False, ""
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Check the answer; empty or overlong text is invalid and costs no attempt."""
        valid = isinstance(action, str) and 0 < len(action.strip()) <= MAX_ANSWER_CHARS
        if not valid or self.done:
            return self.render(), 0.0, self.done, make_info(self.success, valid, False)
        correct = answers_match(action, self.gold)
        reward = 1.0 / (2 ** self.attempts) if correct else 0.0
        self.attempts += 1
        self.success = correct
        self.done = correct or self.attempts >= self.config.max_attempts
        left = self.config.max_attempts - self.attempts
        self.feedback = "Correct." if correct else f"Incorrect. Attempts left: {left}."
        return self.render(), reward, self.done, make_info(correct, True, True)

    def render(self) -> str:
        """The question, and feedback on the last answer."""
        return self.question + (f"\n{self.feedback}" if self.feedback else "")

    def action_description(self) -> str:
        """What an answer looks like."""
        return "the final answer only, e.g. 42 or \\frac{3}{4}"

    def expert_action(self) -> str:
        """The reference answer (an oracle)."""
        return self.gold
