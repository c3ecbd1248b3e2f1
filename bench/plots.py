"""PNG charts of one bench invocation (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

PHASE_ORDER = ("rollout", "log_prob", "ref", "values", "adv", "update_critic", "update_actor", "sync")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_breakdown(runs: dict[str, dict[str, float]], path: Path, xlabel: str) -> None:
    """Stacked horizontal bars: one per run, one fixed colour per phase; the rest of the step in grey."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(runs) + 1.6))
    for i, (label, phases) in enumerate(runs.items()):
        left = 0.0
        for j, phase in enumerate(PHASE_ORDER):
            ax.barh(i, phases.get(phase, 0.0), left=left, color=f"C{j}", label=phase if i == 0 else None)
            left += phases.get(phase, 0.0)
        other = max(phases.get("step", left) - left, 0.0)
        ax.barh(i, other, left=left, color="0.8", label="other" if i == 0 else None)
    ax.set_yticks(range(len(runs)), list(runs))
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def ratios(rows: list[tuple[str, float, float | None, bool]], path: Path, title: str) -> None:
    """One dot per figure (measured ratio, log scale: shares and speedups differ by 100x) and its target.

    ``rows``: (label, measured, target, higher_is_better). Green when the target is met, red when not,
    grey without a target; the target is a black bar.
    """
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
    for i, (label, value, target, higher) in enumerate(rows):
        met = None if target is None else (value >= target if higher else value <= target)
        color = {None: "0.4", True: "tab:green", False: "tab:red"}[met]
        ax.plot([value], [i], "o", color=color, ms=8)
        # the number right of the dot and of a target bar close to it, which would cross it
        anchor = max(value, target) if target is not None and 0.5 < value / target < 2 else value
        ax.annotate(f"{value:.3g}", (anchor, i), textcoords="offset points", xytext=(7, 4), fontsize=8)
        if target is not None:
            ax.plot([target], [i], "|", color="black", ms=18, mew=2)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    values = [r[1] for r in rows] + [r[2] for r in rows if r[2] is not None] + [1.0]
    ax.set_xlim(min(values) / 2, max(values) * 2)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.axvline(1.0, color="0.5", lw=0.8, ls=":")
    ax.grid(axis="x", which="both", alpha=0.2)
    ax.set_xlabel("measured ratio, log scale (black bar: the target; green met, red not)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def scaling(p7: dict[str, dict], path: Path) -> None:
    """Step time against rows, turns and actor ranks (P7), one panel per axis, the base run in each."""
    plt = _pyplot()
    axes_spec = [("rows", "rows per step", {"rows_8": 8, "base": 32, "rows_128": 128}),
                 ("turns", "max turns", {"turns_1": 1, "turns_3": 3, "base": 6}),
                 ("ranks", "actor FSDP ranks", {"ranks_1": 1, "base": 2})]
    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    for ax, (_, xlabel, points) in zip(axes, axes_spec):
        pts = sorted((x, p7[name]["step_s"]) for name, x in points.items() if name in p7)
        if pts:
            ax.plot(*zip(*pts), marker="o")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("step seconds (median)")
        ax.grid(alpha=0.3)
    if "model_20m" in p7:
        axes[0].set_title(f"19M model, 32 rows: {p7['model_20m']['step_s']:.1f} s", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
