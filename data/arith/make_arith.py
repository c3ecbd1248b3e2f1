"""Generate the shipped arithmetic prompt set: ``python data/arith/make_arith.py``.

``train_prompts.txt`` holds the training prompts alone, one a line (TXT format, no ground
truth: with it only a reward model scores the answers). Rows follow verl's parquet layout (``data_source``, ``prompt`` as chat messages,
``reward_model.ground_truth``, ``extra_info``), one JSON object a line. The set is small
and seeded, so the files in the repository are exactly what this script writes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {"train": 256, "val": 32}


def make_rows(split: str, n: int, seed: int) -> list[dict]:
    """``n`` questions ``a <op> b`` with small operands and their integer answers."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({
            "data_source": "arith",
            "prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": i},
        })
    return rows


def main() -> None:
    """Write train.jsonl and val.jsonl, and the training prompts alone as train_prompts.txt (no ground truth)."""
    for seed, (split, n) in enumerate(SIZES.items()):
        rows = make_rows(split, n, seed)
        (HERE / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if split == "train":  # for reward-model-only training (config/arith_ppo_rm.yaml)
            (HERE / "train_prompts.txt").write_text("".join(r["prompt"][0]["content"] + "\n" for r in rows))


if __name__ == "__main__":
    main()
