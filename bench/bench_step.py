"""Per-phase timing breakdown of a training step on the tiny model (a benchmark, not a test).

Runs the real trainer (local Ray, FSDP2 actor/critic, rollout engine, env
actors) for a few steps and prints, per phase, the mean seconds over the
steps after the first (the first pays compilation and cache warm-up).
Results go to ``docs/bench/step_<backend>.json`` and a bar chart
``docs/bench/step_breakdown.png``.

    python bench/bench_step.py [--steps 4] [--backends vllm hf] [key=value overrides ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "bench"
PHASES = ("rollout", "log_prob", "ref", "values", "adv", "update_critic", "update_actor", "sync", "step")


def run_backend(backend: str, steps: int, model: str, overrides: list[str]) -> dict:
    """Train ``steps`` steps in a fresh process (own Ray cluster); return the per-step metrics."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake", f"model_path={model}",
               f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
               "trainer.test_freq=0", "trainer.progress_bar=false", f"actor_rollout_ref.rollout.name={backend}",
               *overrides]
        subprocess.run(cmd, cwd=REPO, check=True)
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def summarize(history: list[dict]) -> dict[str, float]:
    """Mean seconds per phase over the steps after the first, plus throughput."""
    steady = history[1:] or history
    out = {p: statistics.mean(h.get(f"timing_s/{p}", 0.0) for h in steady) for p in PHASES}
    out["generated_tokens"] = statistics.mean(h["perf/generated_tokens"] for h in steady)
    out["total_tokens"] = statistics.mean(h["perf/total_tokens"] for h in steady)
    return out


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    """Stacked bars: one per backend, one segment per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (backend, res) in enumerate(results.items()):
        left = 0.0
        for j, phase in enumerate(PHASES[:-1]):  # one fixed colour per phase across bars
            ax.barh(i, res[phase], left=left, color=f"C{j}", label=phase if i == 0 else None)
            left += res[phase]
    ax.set_yticks(range(len(results)), list(results))
    ax.set_xlabel("seconds per training step (mean over steady-state steps)")
    ax.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    """Run each backend side by side in one invocation and print the breakdown."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backends", nargs="+", default=["vllm", "hf"])
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-qwen2"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the chart from the saved JSON")
    args, overrides = parser.parse_known_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for backend in args.backends:
        if args.plot_only:
            results[backend] = json.loads((OUT / f"step_{backend}.json").read_text())
            continue
        results[backend] = summarize(run_backend(backend, args.steps, args.model, overrides))
        (OUT / f"step_{backend}.json").write_text(json.dumps(results[backend], indent=2))
    print(f"{'phase':<15}" + "".join(f"{b:>12}" for b in results))
    for phase in PHASES:
        print(f"{phase:<15}" + "".join(f"{results[b][phase]:>12.3f}" for b in results))
    for key in ("generated_tokens", "total_tokens"):
        print(f"{key:<15}" + "".join(f"{results[b][key]:>12.0f}" for b in results))
    plot(results, OUT / "step_breakdown.png")
    print(f"wrote {OUT}/step_*.json and step_breakdown.png")


if __name__ == "__main__":
    main()
