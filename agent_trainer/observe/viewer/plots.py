"""PNG learning curves of a run's ``metrics.jsonl`` (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = {
    "success": ("success rate", ("rollout/success_rate", "val/success_rate")),
    "reward": ("mean episode reward", ("rollout/episode_reward_mean", "val/episode_reward_mean")),
    "losses": ("losses", ("actor/pg_loss", "critic/vf_loss", "actor/kl_loss", "actor/entropy", "sft/loss",
                          "val/sft_loss")),
}
"""File stem -> (title, metrics drawn when present); ``timing.png`` stacks every ``timing_s/<phase>``."""
TIMING_TOTALS = ("timing_s/step",)
"""Timers that contain the others: drawn as a line over the stacked phases, not stacked."""


def read_metrics(jsonl: str | Path) -> list[dict]:
    """Every line of a metrics file, by step (the last line of a repeated step wins)."""
    by_step = {}
    for line in Path(jsonl).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def write_curves(jsonl: str | Path, out_dir: str | Path) -> list[Path]:
    """Write ``success.png``, ``reward.png``, ``losses.png`` and ``timing.png`` (those with data); return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (title, keys) in CURVES.items():
        series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            ax.plot(*zip(*points), marker="o", label=key)
        _finish(fig, ax, title, out / f"{stem}.png", plt)
        written.append(out / f"{stem}.png")
    phases = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k not in TIMING_TOTALS})
    if phases:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, *[[r.get(k, 0.0) for r in rows] for k in phases],
                     labels=[k.removeprefix("timing_s/") for k in phases])
        for key in TIMING_TOTALS:
            ax.plot(steps, [r.get(key, 0.0) for r in rows], "k--", label=key.removeprefix("timing_s/"))
        _finish(fig, ax, "seconds per step", out / "timing.png", plt)
        written.append(out / "timing.png")
    return written


def _finish(fig, ax, title: str, path: Path, plt) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
