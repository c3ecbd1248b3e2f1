"""Plot a run's learning curve from its ``metrics.jsonl``, or several runs' side by side.

    python bench/plot_run.py outputs/agent_trainer/frozenlake_ppo/metrics.jsonl \
        --out docs/bench/frozenlake_learning.png
    python bench/plot_run.py built-in=outputs/agent_trainer/frozenlake_nodeadends_seed0/metrics.jsonl \
        gateway=outputs/agent_trainer/frozenlake_gateway/metrics.jsonl --out docs/img/gateway_curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CURVES = (
    ("rollout/success_rate", "train success rate"),
    ("val/success_rate", "validation success rate"),
    ("rollout/episode_reward_mean", "train episode reward"),
)


def load(path: Path) -> list[dict]:
    """One dict per logged step."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    """Draw the curves that the runs logged (a run given as ``label=path`` is named by its label)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl, or label=metrics.jsonl to compare runs")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default=None)
    parser.add_argument("--curves", nargs="+", default=[key for key, _ in CURVES], choices=[key for key, _ in CURVES],
                        help="which metrics to draw (default: all three)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(label, Path(path)) if sep else (None, Path(label))
            for label, sep, path in (m.partition("=") for m in args.metrics)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, path in runs:
        records = load(path)
        for key, label in CURVES:
            if key not in args.curves:
                continue
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if key.startswith("val/") else None,
                        label=f"{name}: {label}" if name else label)
    ax.set_xlabel("training step")
    ax.set_title(args.title or runs[0][1].parent.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
