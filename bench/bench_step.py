"""Per-phase timing breakdown of a training step, one run per rollout backend (a benchmark, not a test).

Runs the real trainer (local Ray, FSDP2 actor/critic, rollout engine, env actors)
for a few steps per backend, one after the other, and prints the median seconds of
every phase over steps 2..N (step 1 pays compilation and cache warm-up). Writes
``step_<backend>.json`` and ``step_breakdown.png`` to a results folder
(``bench/results/<UTC stamp>`` unless ``--out``), never to the tracked docs;
``bench/run.py`` is the whole suite.

    python bench/bench_step.py [--steps 4] [--backends vllm hf] [--out DIR] [key=value overrides ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plots  # noqa: E402
import project_run  # noqa: E402
from results import results_dir  # noqa: E402


def main() -> None:
    """Run each backend and print the breakdown table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backends", nargs="+", default=["vllm", "hf"])
    parser.add_argument("--model", default=str(project_run.REPO / "models" / "tiny-qwen2"))
    parser.add_argument("--out", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for backend in args.backends:
        spec = project_run.RunSpec(f"step_{backend}", steps=args.steps, overrides=[
            f"model_path={args.model}", f"actor_rollout_ref.rollout.name={backend}", *overrides])
        run = project_run.run(spec, out / "logs")
        results[backend] = {**run.phases, "generated_tokens": run.generated_tokens, "total_tokens": run.total_tokens}
        (out / f"step_{backend}.json").write_text(json.dumps(run.to_json(), indent=2))
    print(f"{'phase':<16}" + "".join(f"{b:>12}" for b in results))
    for key in (*project_run.PHASES, "generated_tokens", "total_tokens"):
        print(f"{key:<16}" + "".join(f"{results[b][key]:>12.3f}" for b in results))
    plots.step_breakdown(results, out / "step_breakdown.png", "seconds per step (median of steps 2..N)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
