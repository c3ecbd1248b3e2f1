"""Generate ``metamathqa_sample.jsonl``: MetaMathQA-format problems with exact answers.

Deterministic (seeded) so the shipped file can be regenerated bit for bit::

    python -m envs.data.make_metamathqa_sample [--n 300] [--out path]
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ["Alice", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells"]


def _latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def shopping(rng):
    """Add-then-subtract word problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(5, 60), rng.randint(2, 30), rng.randint(1, 20)
    ans = a + b - c
    q = f"{name} has {a} {item}, buys {b} more and gives {c} to a friend. How many {item} does {name} have now?"
    r = f"{name} starts with {a} {item}. After buying {b} more, {name} has {a} + {b} = {a + b}. " \
        f"Giving away {c} leaves {a + b} - {c} = {ans}.\nThe answer is: {ans}"
    return q, r, "GSM_synthetic"


def rate(rng):
    """Hourly wage plus tip."""
    name = rng.choice(NAMES)
    per_hour, hours, bonus = rng.randint(8, 40), rng.randint(2, 12), rng.randint(0, 50)
    ans = per_hour * hours + bonus
    q = f"{name} earns ${per_hour} per hour and works {hours} hours, then gets a ${bonus} tip. How many dollars does {name} earn in total?"
    r = f"Wages are {per_hour} * {hours} = {per_hour * hours}. Adding the tip gives {per_hour * hours} + {bonus} = {ans}.\nThe answer is: {ans}"
    return q, r, "GSM_synthetic"


def fraction_sum(rng):
    """Sum or difference of two fractions, answered in \\frac form."""
    a, b = Fraction(rng.randint(1, 9), rng.randint(2, 12)), Fraction(rng.randint(1, 9), rng.randint(2, 12))
    op = rng.choice(["+", "-"])
    ans = a + b if op == "+" else a - b
    q = f"Compute ${_latex(a)} {op} {_latex(b)}$. Express your answer as a common fraction in lowest terms."
    r = f"Over a common denominator, ${_latex(a)} {op} {_latex(b)} = {_latex(ans)}$.\nThe answer is: {_latex(ans)}"
    return q, r, "MATH_synthetic"


def linear(rng):
    """One-variable linear equation with an integer root."""
    x, a, b = rng.randint(-20, 20), rng.randint(2, 9), rng.randint(-30, 30)
    c = a * x + b
    q = f"Solve for $x$: ${a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}$."
    r = f"Subtract {b} from both sides: ${a}x = {c - b}$. Divide by {a}: $x = {x}$.\nThe answer is: {x}"
    return q, r, "MATH_synthetic"


def percent(rng):
    """A percentage of a number."""
    p, n = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75]), rng.randint(2, 80) * 4
    ans = Fraction(p * n, 100)
    ans_s = str(ans.numerator) if ans.denominator == 1 else str(float(ans))
    q = f"What is {p}% of {n}?"
    r = f"{p}% of {n} is {p}/100 * {n} = {ans_s}.\nThe answer is: {ans_s}"
    return q, r, "MATH_synthetic"


def rectangle(rng):
    """Area or perimeter of a rectangle."""
    w, h = rng.randint(2, 25), rng.randint(2, 25)
    kind = rng.choice(["area", "perimeter"])
    ans = w * h if kind == "area" else 2 * (w + h)
    q = f"A rectangle is {w} units wide and {h} units tall. What is its {kind}?"
    formula = f"{w} * {h}" if kind == "area" else f"2 * ({w} + {h})"
    r = f"The {kind} is {formula} = {ans}.\nThe answer is: {ans}"
    return q, r, "MATH_synthetic"


GENERATORS = [shopping, rate, fraction_sum, linear, percent, rectangle]


def make_records(n: int = 300, seed: int = 0) -> list[dict]:
    """``n`` records cycling through the templates, deterministic per seed."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        q, r, kind = GENERATORS[i % len(GENERATORS)](rng)
        records.append({"query": q, "response": r, "type": kind})
    return records


def main() -> None:
    """Write the sample file."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--out", default=str(Path(__file__).parent / "metamathqa_sample.jsonl"))
    args = parser.parse_args()
    with open(args.out, "w") as fh:
        for rec in make_records(args.n):
            fh.write(json.dumps(rec) + "\n")
    print(f"wrote {args.n} records to {args.out}")


if __name__ == "__main__":
    main()
