"""``make bench``: the benchmark suite (P1-P8 and the main job) in one command, results in a folder of their own.

    python bench/run.py                        # full suite -> bench/results/<UTC stamp>/
    python bench/run.py --quick                # smoke run: fewer steps, tiny model only, no P7
    python bench/run.py --only main,P2 --steps 6 --ref HEAD~1
    make bench ARGS="--quick --update-docs"    # or BENCH_UPDATE_DOCS=1 make bench

Parts: main (config/frozenlake.yaml step time, working tree vs ``--ref`` in a git
worktree), P1 rollout vs raw vLLM tokens/s, P2 GRPO step vs TRL GRPOTrainer (tiny and
~19M model; TRL in bench/.venv-trl), P3 weight-sync share, P4 env-actor overhead,
P5 peak RSS of the process tree vs TRL, P6 slow env (turn barrier, overlap, prefetched reset),
P7 scaling (rows, turns, actor ranks, 19M model), P8 synchronous vs one-step-off vs asynchronous
training (continuous, k = 1, 2, 4) on the slow env, P9 the log-prob head, plain vs chunked (P2's models). Writes ``results.json``,
``report.md``, PNG charts and every run's log to the results folder and prints its
path; ``docs/benchmarks.md`` and ``docs/bench/`` change only with ``--update-docs``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plots  # noqa: E402
import report  # noqa: E402
import suites  # noqa: E402
from results import is_loaded, machine_info, results_dir  # noqa: E402

REPO = suites.REPO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring); ``--only`` is checked against the known parts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(suites.PARTS)}")
    p.add_argument("--quick", action="store_true", help="3 steps per run, tiny model only, P7 skipped")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 6, quick 3)")
    p.add_argument("--ref", default="", help="git ref the main job is compared with (default: HEAD when the "
                                             "working tree has changes, else HEAD~1)")
    p.add_argument("--tree", type=Path, default=REPO, help="checkout measured as the current code (default: this "
                                                           "working tree)")
    p.add_argument("--repeats", type=int, default=None, help="alternating ref / working-tree runs of the main "
                                                               "job (default 2, quick 1)")
    p.add_argument("--models", default="", help="P2's and P9's models: comma-separated of tiny,20m (default both; "
                                                 "quick: tiny)")
    p.add_argument("--trl-threads", default="0", help="comma-separated torch thread counts for TRL's process, "
                                                      "one TRL run each (0: torch's default, all cores)")
    p.add_argument("--precision", default="", help="P2's training precisions, comma-separated of fp32,bf16 (bf16: "
                                                   "the project's fsdp.mixed_precision=bf16 against TRL's bf16=True; "
                                                   "default both; quick: fp32)")
    p.add_argument("--p8-runs", default="", help=f"P8's runs besides sync, comma-separated of "
                                                 f"{','.join(suites.ASYNC_MODES)} (default every one)")
    p.add_argument("--p1-runs", default="", help=f"P1's runs, comma-separated of {','.join(suites.P1_RUNS)} "
                                                 "(default every one)")
    p.add_argument("--render-only", type=Path, default=None,
                   help="redraw the charts and report of an earlier results folder (with --update-docs: publish it)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<UTC stamp>)")
    p.add_argument("--update-docs", action="store_true", default=os.environ.get("BENCH_UPDATE_DOCS") == "1",
                   help="rewrite the generated block of docs/benchmarks.md and docs/bench/ (BENCH_UPDATE_DOCS=1)")
    a = p.parse_args(argv)
    parts = [x.strip() for x in a.only.split(",") if x.strip()] or \
        [x for x in suites.PARTS if not (a.quick and x == "P7")]
    unknown = sorted(set(parts) - set(suites.PARTS))
    if unknown:
        p.error(f"--only {a.only}: unknown part(s) {unknown}; known: {','.join(suites.PARTS)}")
    a.parts = [x for x in suites.PARTS if x in parts]
    a.p8_runs = tuple(x.strip() for x in a.p8_runs.split(",") if x.strip())
    if set(a.p8_runs) - set(suites.ASYNC_MODES):
        p.error(f"--p8-runs {','.join(a.p8_runs)}: known runs are {','.join(suites.ASYNC_MODES)}")
    a.p1_runs = tuple(x.strip() for x in a.p1_runs.split(",") if x.strip())
    if set(a.p1_runs) - set(suites.P1_RUNS):
        p.error(f"--p1-runs {','.join(a.p1_runs)}: known runs are {','.join(suites.P1_RUNS)}")
    a.steps = a.steps or (3 if a.quick else 6)
    a.repeats = a.repeats or (1 if a.quick else 2)
    a.models = [x.strip() for x in a.models.split(",") if x.strip()] or (["tiny"] if a.quick else ["tiny", "20m"])
    if set(a.models) - set(suites.MODELS):
        p.error(f"--models {','.join(a.models)}: known models are {','.join(suites.MODELS)}")
    a.precision = tuple(x.strip() for x in a.precision.split(",") if x.strip()) or \
        (("fp32",) if a.quick else suites.PRECISIONS)
    if set(a.precision) - set(suites.PRECISIONS):
        p.error(f"--precision {','.join(a.precision)}: known precisions are {','.join(suites.PRECISIONS)}")
    try:
        a.trl_threads = tuple(int(t) for t in a.trl_threads.split(","))
    except ValueError:
        p.error(f"--trl-threads {a.trl_threads}: expected comma-separated integers, e.g. 0,1")
    if a.steps < 2:
        p.error(f"--steps {a.steps}: need at least 2 (medians are over steps 2..N)")
    return a


def default_ref() -> str:
    """The previous commit: HEAD when the working tree differs from it, else HEAD~1."""
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.strip()
    return "HEAD" if dirty else "HEAD~1"


def ensure_20m_model() -> None:
    """Build the ~19M-parameter model with the tiny model's builder when it is missing (idempotent)."""
    if not (suites.MODEL_20M / "build_info.json").exists():
        print(f"[bench] building {suites.MODEL_20M} (launch/build_tiny_model.py --size 20m) ...", flush=True)
        subprocess.run([sys.executable, "-m", "launch.build_tiny_model", "--size", "20m", "--out",
                        str(suites.MODEL_20M)], cwd=REPO, check=True)


def run_parts(b: suites.Bench, parts: list[str], quick: bool, models: list[Path]) -> dict:
    """Each requested part in order; a failing part is recorded with its error and the rest still run."""
    calls = {"main": lambda: suites.main_job(b), "P1": lambda: suites.p1_rollout_vs_engine(b),
             "P2": lambda: suites.p2_vs_trl(b, models), "P3": lambda: suites.p3_sync_share(b),
             "P4": lambda: suites.p4_env_actor(b), "P5": lambda: suites.p5_peak_rss(b),
             "P6": lambda: suites.p6_slow_env(b), "P7": lambda: suites.p7_scaling(b, with_20m=not quick),
             "P8": lambda: suites.p8_async(b), "P9": lambda: suites.p9_log_prob_head(b, models)}
    out, errors = {}, {}
    for part in parts:
        try:
            out[part] = calls[part]()
        except Exception as exc:  # one broken part must not lose the others' numbers
            traceback.print_exc()
            errors[part] = f"{type(exc).__name__}: {exc}"
    out["errors"] = errors
    return out


def write_outputs(folder: Path, r: dict) -> str:
    """results.json, the charts and report.md in ``folder``; returns the Markdown block."""
    (folder / "results.json").write_text(json.dumps(r, indent=2, default=str))
    runs = r.get("runs", {})
    breakdown = {label: v["phases"] for label, v in runs.items()}
    if breakdown:
        plots.step_breakdown(breakdown, folder / "step_breakdown.png", "seconds per step (median of steps 2..N)")
    rows = report.ratio_rows(r)
    if rows:
        plots.ratios(rows, folder / "ratios.png", f"make bench, {r['meta']['date']}")
    if r.get("P7"):
        plots.scaling(r["P7"], folder / "p7_scaling.png")
    block = report.render(r, asset_prefix="")
    (folder / "report.md").write_text("# make bench report\n\n" + block)
    return block


def main(argv: list[str] | None = None) -> Path:
    """Run the selected parts, write the results folder, optionally update the docs; print the folder."""
    a = parse_args(argv)
    if a.render_only:
        return publish(a.render_only, json.loads((a.render_only / "results.json").read_text()), a.update_docs)
    folder = a.out or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[bench] results folder: {folder}", flush=True)
    machine = machine_info()
    if (("P2" in a.parts or "P9" in a.parts) and "20m" in a.models) or ("P7" in a.parts and not a.quick):
        ensure_20m_model()
    b = suites.Bench(out=folder, steps=a.steps, ref=a.ref or default_ref(), tree=a.tree.resolve(),
                     repeats=a.repeats, trl_threads=a.trl_threads, precisions=a.precision, p8_runs=a.p8_runs,
                     p1_runs=a.p1_runs)
    r = {"meta": {"command": "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"), "machine": machine,
                  "loaded": is_loaded(machine.get("load_avg_1m"), machine.get("cores")),
                  "steps": a.steps, "parts": a.parts}}
    r.update(run_parts(b, a.parts, a.quick, [suites.MODELS[m] for m in a.models]))
    r["meta"]["load_avg_1m_end"] = machine_info().get("load_avg_1m")
    r["runs"] = {label: run.to_json() for label, run in b.runs.items()}
    return publish(folder, r, a.update_docs)


def publish(folder: Path, r: dict, update_docs: bool) -> Path:
    """Write the folder's outputs, print the block, update the docs when asked; return the folder."""
    print(write_outputs(folder, r))
    if update_docs:
        report.update_docs(folder, report.render(r, asset_prefix="bench/"), REPO / "docs" / "benchmarks.md",
                           REPO / "docs" / "bench")
        print("[bench] updated docs/benchmarks.md and docs/bench/")
    if r.get("errors"):
        print(f"[bench] failed parts: {r['errors']}")
    print(f"[bench] results folder: {folder}")
    return folder


if __name__ == "__main__":
    main()
