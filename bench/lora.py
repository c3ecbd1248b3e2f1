"""LoRA against full fine-tuning on the same job: step time, weight-sync time, peak memory and checkpoint size.

    python bench/lora.py                       # the ~19M model, GRPO + KL loss, 5 steps per run, 2 rounds
    python bench/lora.py --model models/tiny-qwen2 --rounds 1 --steps 3

Both runs are the same trainer command (``config/frozenlake_grpo.yaml`` with a KL loss, so the full run hosts a
reference copy and the LoRA run takes the reference from the adapter switched off), differing only in
``actor_rollout_ref.model.lora_rank`` / ``lora_alpha``; each saves a checkpoint at its last step. The runs
alternate (full, LoRA, full, LoRA, ...) so both sides see the same machine load; every figure is the median of a
side over its rounds, and the ratios are LoRA / full from this one invocation. Writes ``docs/bench/lora.json``
and prints the table docs/lora.md shows.

    python bench/lora.py --learning            # held-out success of LoRA vs full RL on make train's task

``--learning`` runs (or reuses, from ``outputs/learning``) bench/learning.py's GiGPO runs on make train's task and
its ``gigpo_lora`` variant (a rank-16 adapter at lr 1e-3, the pilots' choice; docs/lora.md) for seeds 0..2 from
the same warm start, and prints the held-out greedy success of both at every evaluation (mean, spread, each seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning  # noqa: E402
import project_run as pr  # noqa: E402
import baselines as bl  # noqa: E402
from suites import MODEL_20M  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "bench" / "lora.json"
ROWS = [  # (label, how to read it from a RunResult, unit)
    ("step time", lambda r: r.phases["step"], "s"),
    ("actor update", lambda r: r.phases["update_actor"], "s"),
    ("weight sync", lambda r: r.phases["sync"], "s"),
    ("reference log-probs", lambda r: r.phases["ref"], "s"),
    ("peak RSS (process tree)", lambda r: r.peak_rss_bytes / 2**20, "MiB"),
    ("peak PSS (process tree)", lambda r: r.peak_pss_bytes / 2**20, "MiB"),
    ("checkpoint on disk", lambda r: r.checkpoint_bytes["total"] / 2**20, "MiB"),
    ("actor checkpoint", lambda r: r.checkpoint_bytes.get("actor", 0) / 2**20, "MiB"),
]


def specs(model: Path, steps: int, rank: int) -> dict[str, pr.RunSpec]:
    common = [f"model_path={model}", "actor_rollout_ref.actor.use_kl_loss=true", "agent_proxy.max_turn=2",
              "trainer.save_hf_model=true"]
    lora = [f"actor_rollout_ref.model.lora_rank={rank}", f"actor_rollout_ref.model.lora_alpha={2 * rank}"]
    return {"full": pr.RunSpec("full", "frozenlake_grpo", common, steps=steps, save_last=True),
            "lora": pr.RunSpec(f"lora_r{rank}", "frozenlake_grpo", common + lora, steps=steps, save_last=True)}


def ensure_model(model: Path) -> None:
    if model == MODEL_20M and not (model / "build_info.json").exists():
        subprocess.run([sys.executable, "-m", "launch.build_tiny_model", "--size", "20m", "--out", str(model)],
                       cwd=REPO, check=True)


def table(results: dict[str, list[pr.RunResult]]) -> tuple[str, dict]:
    lines = ["| | full fine-tuning | LoRA | LoRA / full |", "| --- | ---: | ---: | ---: |"]
    figures = {}
    for label, read, unit in ROWS:
        full = statistics.median(read(r) for r in results["full"])
        lora = statistics.median(read(r) for r in results["lora"])
        figures[label] = {"full": full, "lora": lora, "unit": unit, "ratio": lora / full if full else None}
        ratio = f"{lora / full:.2f}" if full else "-"
        digits = 2 if unit == "s" else 1
        lines.append(f"| {label} | {full:.{digits}f} {unit} | {lora:.{digits}f} {unit} | {ratio} |")
    return "\n".join(lines), figures


def learning_table(seeds: int) -> str:
    """Held-out greedy success of full and LoRA GiGPO on make train's task, same warm start and seeds."""
    args = argparse.Namespace(out=REPO / "outputs" / "learning", fresh=False, val_groups=128, steps=None,
                              test_freq=None, sft_overrides=[], rl_overrides=[])
    model = learning.sft("nodeadends", args)
    runs = {algo: [learning.rl("nodeadends", algo, seed, model, args) for seed in range(seeds)]
            for algo in ("gigpo", "gigpo_lora")}
    steps = sorted(set.intersection(*(set(dict(bl.val_points(bl.read_metrics(d)))) for ds in runs.values()
                                      for d in ds)))
    lines = ["| step | " + " | ".join(learning.ALGOS[a][0] for a in runs) + " |", "| ---: |" + " ---: |" * len(runs)]
    for step in steps:
        cells = []
        for dirs in runs.values():
            values = [dict(bl.val_points(bl.read_metrics(d)))[step] for d in dirs]
            cells.append(f"{learning.spread(values)} ({', '.join(f'{v:.3f}' for v in values)})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL_20M, help="default: the ~19M model (built if missing)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (medians over steps 2..N)")
    parser.add_argument("--rounds", type=int, default=2, help="full/LoRA pairs, alternating")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--learning", action="store_true", help="the held-out comparison instead (see above)")
    parser.add_argument("--seeds", type=int, default=3, help="with --learning: RL seeds 0..N-1")
    args = parser.parse_args(argv)
    if args.learning:
        print(learning_table(args.seeds))
        return 0
    ensure_model(args.model)
    runs = specs(args.model.resolve(), args.steps, args.rank)
    results: dict[str, list[pr.RunResult]] = {"full": [], "lora": []}
    logs = REPO / "outputs" / "bench_lora"
    for _ in range(args.rounds):
        for side, spec in runs.items():
            print(f"[bench/lora] {spec.label} ...", flush=True)
            results[side].append(pr.run(spec, logs))
    text, figures = table(results)
    record = {"model": str(args.model), "steps": args.steps, "rounds": args.rounds, "lora_rank": args.rank,
              "figures": figures, "runs": {side: [r.to_json() for r in rs] for side, rs in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
