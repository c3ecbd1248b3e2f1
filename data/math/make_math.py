"""Generate the shipped multi-step math set: ``python data/math/make_math.py``.

Questions for the question environment (multi-turn GRPO, ``config/multiturn_grpo_math.yaml``):
two-step integer expressions and fraction sums whose answer is an integer or a reduced
fraction, so ``reward_computation.domain=math`` checks them numerically (``7/6`` equals
``\\frac{7}{6}``). Rows follow verl's layout (``prompt`` as chat messages,
``reward_model.ground_truth``, ``extra_info.id``, the id trajectory rewards and
``reward_computation.ground_truth_file`` use). ``ground_truth.json`` maps every id to its
answer. Seeded: the files in the repository are exactly what this script writes.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPLITS = {"train": (128, 7), "val": (32, 8)}
"""split -> (rows, seed)."""


def question(rng: random.Random) -> tuple[str, str]:
    """One question and its answer: (a op b) op c with small integers, or a sum of two fractions."""
    if rng.random() < 0.3:
        x = Fraction(rng.randint(1, 5), rng.randint(2, 6))
        y = Fraction(rng.randint(1, 5), rng.randint(2, 6))
        return f"What is {x} + {y}? Give the answer as a reduced fraction or an integer.", str(x + y)
    a, b, c = rng.randint(1, 12), rng.randint(1, 12), rng.randint(2, 6)
    inner, outer = rng.choice("+-"), rng.choice("*+-")
    value = {"+": a + b, "-": a - b}[inner]
    value = {"*": value * c, "+": value + c, "-": value - c}[outer]
    return f"Compute ({a} {inner} {b}) {outer} {c} step by step.", str(value)


def rows_for(split: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text, answer = question(rng)
        out.append({"data_source": "math", "prompt": [{"role": "user", "content": text}],
                    "reward_model": {"style": "rule", "ground_truth": answer},
                    "extra_info": {"split": split, "index": i, "id": f"math-{split}-{i}"}})
    return out


def main() -> None:
    """Write train.jsonl, val.jsonl and ground_truth.json (id -> answer, both splits)."""
    truths = {}
    for split, (n, seed) in SPLITS.items():
        rows = rows_for(split, n, seed)
        (HERE / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        truths.update({r["extra_info"]["id"]: r["reward_model"]["ground_truth"] for r in rows})
    (HERE / "ground_truth.json").write_text(json.dumps(truths, indent=0) + "\n")


if __name__ == "__main__":
    main()
