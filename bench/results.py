"""Pure parts of the bench: results-folder naming, steady-state medians, ratios, tables.

No timing, no subprocesses: ``tests/bench/test_results.py`` checks these directly.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
from pathlib import Path

RESULTS_ROOT = Path(__file__).resolve().parent / "results"  # git-ignored
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"


def results_dir(root: Path = RESULTS_ROOT, now: dt.datetime | None = None) -> Path:
    """``<root>/<UTC timestamp>``, e.g. ``bench/results/20261122T131500Z``; a suffix keeps it new."""
    now = now or dt.datetime.now(dt.timezone.utc)
    base = root / now.astimezone(dt.timezone.utc).strftime(STAMP_FORMAT)
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def steady_median(values: list[float]) -> float:
    """Median over steps 2..N: step 1 pays compilation and cache warm-up (all steps when there is one)."""
    if not values:
        raise ValueError("steady_median needs at least one step")
    return statistics.median(values[1:] or values)


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``; None when the denominator is missing or zero."""
    if not denominator:
        return None
    return numerator / denominator


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table cell; "n/a" for a missing one."""
    return "n/a" if value is None else f"{value:,.{digits}f}"


def render_table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table; numbers are formatted with :func:`fmt`, the first column left-aligned."""
    cells = [[fmt(c) if isinstance(c, float) or c is None else str(c) for c in row] for row in rows]
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def machine_info() -> dict:
    """What the numbers were measured on: cores, memory, CPU, load when the run started."""
    info = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        info["memory_gib"] = round(mem_kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def is_loaded(load_avg: float | None, cores: int | None) -> bool:
    """A machine is 'loaded' when other work kept more than half its cores busy at the start."""
    return load_avg is not None and bool(cores) and load_avg > 0.5 * cores


def replace_block(doc: Path, block: str, begin: str, end: str) -> None:
    """Rewrite the text between the ``begin`` and ``end`` lines of ``doc``; the hand-written rest stays."""
    text = doc.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{doc} lacks the markers {begin!r} / {end!r}; add them where the block goes")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{block}{end}{tail}")
