"""Countdown: combine the given numbers with + - * / to reach the target.

Problems are generated per seed (a random expression over random numbers, so
every problem has a solution) or read from a parquet / JSON / JSONL file with
``target`` and ``nums`` columns (TinyZero's Countdown-Tasks format). Each
number may be used at most once (exactly once with ``use_all_numbers``).

The answer is parsed by a whitelist over Python's ``ast`` (integers,
parentheses, + - * /, nothing else) and evaluated on exact fractions: never
``eval``. Rewards (TinyZero's): 1 for a correct expression, 0.1 for a
well-formed one that is wrong (wrong value or wrong numbers), 0 for text that
is not an arithmetic expression (``action_is_valid=False``). One answer ends
the episode; invalid text does not.
"""

from __future__ import annotations

import ast
import functools
import warnings
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import BaseEnv, make_info, read_records
from envs.experts import countdown_solve

MAX_EXPRESSION_CHARS = 200
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def parse_expression(text: Any) -> tuple[Fraction | None, list[int]] | None:
    """Parse and evaluate an arithmetic expression safely.

    Returns (value, integers used) or None when the text is not an expression
    of integers, parentheses and + - * /. A trailing "= ..." is ignored.
    The value is None on division by zero (well-formed, but has no value).
    """
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION_CHARS:
        return None
    text = text.strip()
    if text.count("=") == 1:
        text = text.split("=")[0].strip()
    try:
        with warnings.catch_warnings():  # "1e" and friends warn before failing; stay quiet
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        raise _NotArithmetic

    try:
        return walk(tree.body), numbers
    except _NotArithmetic:
        return None
    except ZeroDivisionError:
        return None, numbers
    except RecursionError:
        return None


class _NotArithmetic(Exception):
    """A node outside the whitelist."""


@dataclass
class CountdownConfig:
    """Options of the Countdown environment."""

    num_operands: int = 3
    """How many numbers a generated problem has."""
    min_number: int = 1
    """Smallest generated number."""
    max_number: int = 99
    """Largest generated number."""
    max_target: int = 100
    """Generated targets lie in [1, max_target]."""
    use_all_numbers: bool = True
    """Every number must be used exactly once (TinyZero's rule); else at most once."""
    data_path: str | None = None
    """Parquet / JSON / JSONL file with ``target`` and ``nums``; None generates problems."""

    def __post_init__(self):
        if not isinstance(self.num_operands, int) or not 2 <= self.num_operands <= 6:
            raise ValueError(f"num_operands must be an int in [2, 6], got {self.num_operands!r}")
        if not 1 <= self.min_number <= self.max_number:
            raise ValueError(f"need 1 <= min_number <= max_number, got {self.min_number}, {self.max_number}")
        if self.max_target < 1:
            raise ValueError(f"max_target must be >= 1, got {self.max_target!r}")
        if self.data_path is not None and not Path(self.data_path).exists():
            raise ValueError(f"data_path {self.data_path!r} does not exist")


@functools.lru_cache(maxsize=4)
def load_problems(path: str | Path) -> list[dict]:
    """Read ``target`` / ``nums`` records from parquet, JSON (a list) or JSONL (cached per path)."""
    path = Path(path)
    records = read_records(path)
    problems = []
    for i, rec in enumerate(records):
        nums = rec.get("nums", rec.get("numbers"))
        if nums is None or "target" not in rec:
            raise ValueError(f"{path} record {i} needs 'target' and 'nums'; has keys {sorted(rec)}")
        problems.append({"target": int(rec["target"]), "nums": [int(n) for n in nums]})
    if not problems:
        raise ValueError(f"{path} holds no problems")
    return problems


def generate_problem(config: CountdownConfig, rng: np.random.Generator) -> dict:
    """Random numbers combined by a random expression into a positive integer target."""
    while True:
        nums = [int(n) for n in rng.integers(config.min_number, config.max_number + 1, config.num_operands)]
        order = list(rng.permutation(nums)) if config.use_all_numbers else \
            list(rng.permutation(nums))[: int(rng.integers(2, config.num_operands + 1))]
        value = Fraction(int(order[0]))
        for n in order[1:]:
            op = ["+", "-", "*", "/"][int(rng.integers(4))]
            if op == "/" and value % n != 0:
                op = "+"  # keep intermediate values integral, like hand-made puzzles
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
        if value.denominator == 1 and 1 <= value <= config.max_target:
            return {"target": int(value), "nums": nums}


class CountdownEnv(BaseEnv):
    """Reach the target with the numbers; answer with an arithmetic expression."""

    config_cls = CountdownConfig

    def __init__(self, config: CountdownConfig | None = None):
        """Create the env (and load the problem file, if any)."""
        super().__init__(config)
        self.problems = load_problems(str(self.config.data_path)) if self.config.data_path else None
        self.target, self.nums = 0, []
        self.done, self.success, self.answer = False, False, None

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Pick (file) or generate the problem for ``seed``."""
        rng = np.random.default_rng(seed)
        if self.problems is not None:
            problem = self.problems[int(rng.integers(len(self.problems)))]
        else:
            problem = generate_problem(self.config, rng)
        self.target, self.nums = problem["target"], list(problem["nums"])
        self.done, self.success, self.answer = False, False, None
        return self.render()

    def _numbers_ok(self, used: list[int]) -> bool:
        have, want = Counter(used), Counter(self.nums)
        if self.config.use_all_numbers:
            return have == want
        return all(have[n] <= want[n] for n in have)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Score the expression: 1 correct, 0.1 well-formed but wrong, 0 invalid."""
        parsed = parse_expression(action)
        if parsed is None or self.done:
            return self.render(), 0.0, self.done, make_info(self.success, parsed is not None, False)
        value, used = parsed
        self.success = value is not None and value == self.target and self._numbers_ok(used)
        self.done, self.answer = True, action.strip()
        reward = 1.0 if self.success else 0.1
        return self.render(), reward, True, make_info(self.success, True, True)

    def render(self) -> str:
        """The numbers and the target (and the verdict after an answer)."""
        rule = "each exactly once" if self.config.use_all_numbers else "each at most once"
        text = f"Numbers: {self.nums}. Target: {self.target}. Use the numbers ({rule}) with + - * / and parentheses."
        if self.answer is not None:
            text += f"\nYour answer {self.answer} is {'correct' if self.success else 'wrong'}."
        return text

    def action_description(self) -> str:
        """What an answer looks like."""
        return "an arithmetic expression over the numbers, e.g. (3 + 5) * 2"

    def expert_action(self) -> str:
        """A solving expression found by exhaustive search."""
        found = countdown_solve(self.nums, self.target, use_all=self.config.use_all_numbers)
        if found is None:
            raise RuntimeError(f"no solution for {self.nums} -> {self.target}")
        return found
