"""Generate the shipped coding set: ``python data/coding/make_coding.py``.

Small Python function-writing tasks for the question environment
(``config/multiturn_grpo_coding.yaml``): each row's ground truth is ``{"tests": [assert
lines]}`` (MBPP style), run after the policy's program inside the coding sandbox by
``reward_computation.domain=coding``. One reference solution per task is kept in
``extra_info.reference`` (the unit tests check it passes its own tests). Seeded: the files
in the repository are exactly what this script writes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPLITS = {"train": (64, 11), "val": (16, 12)}
"""split -> (rows, seed)."""


def _add_k(rng):
    k = rng.randint(1, 9)
    xs = rng.sample(range(-5, 20), 3)
    return (f"Write a Python function add_{k}(x) that returns x plus {k}.",
            f"def add_{k}(x):\n    return x + {k}\n", [f"assert add_{k}({x}) == {x + k}" for x in xs])


def _scale_list(rng):
    k = rng.randint(2, 5)
    xs = [rng.randint(0, 9) for _ in range(3)]
    return (f"Write a Python function scale(xs) that returns a new list with every element of xs times {k}.",
            f"def scale(xs):\n    return [x * {k} for x in xs]\n",
            [f"assert scale({xs}) == {[x * k for x in xs]}", "assert scale([]) == []"])


def _count_char(rng):
    ch = rng.choice("aeiou")
    word = "".join(rng.choice("abcdeiou") for _ in range(8))
    return (f"Write a Python function count_{ch}(s) that returns how many times the letter '{ch}' occurs in s.",
            f"def count_{ch}(s):\n    return s.count('{ch}')\n",
            [f"assert count_{ch}({word!r}) == {word.count(ch)}", f"assert count_{ch}('') == 0"])


def _largest(rng):
    xs = rng.sample(range(-20, 50), 4)
    return ("Write a Python function largest(xs) that returns the largest number in the non-empty list xs.",
            "def largest(xs):\n    return max(xs)\n", [f"assert largest({xs}) == {max(xs)}", "assert largest([3]) == 3"])


def _reverse(rng):
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 7)))
    return ("Write a Python function rev(s) that returns the string s reversed.",
            "def rev(s):\n    return s[::-1]\n", [f"assert rev({word!r}) == {word[::-1]!r}", "assert rev('') == ''"])


TASKS = (_add_k, _scale_list, _count_char, _largest, _reverse)


def coding_rows(split: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text, reference, tests = rng.choice(TASKS)(rng)
        rows.append({"data_source": "coding", "prompt": [{"role": "user", "content": text}],
                     "reward_model": {"style": "rule", "ground_truth": {"tests": tests}},
                     "extra_info": {"split": split, "index": i, "id": f"coding-{split}-{i}", "reference": reference}})
    return rows


if __name__ == "__main__":
    for name, (size, split_seed) in SPLITS.items():
        lines = [json.dumps(row) for row in coding_rows(name, size, split_seed)]
        (HERE / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
