"""Learning benchmark (not a test): do the RL algorithms improve on an SFT warm start, and on the baselines?

    python bench/learning.py                                   # the full grid: about 1.5 h on 2 CPU cores
    python bench/learning.py --envs nodeadends --seeds 1 --steps 10    # a reduced run (the doc says so)
    python bench/learning.py --pipeline-seeds 5                # make train SEED=0..4, about 1 h on 2 CPU cores

``--pipeline-seeds N`` measures make train itself over pipeline seeds: for each seed s in 0..N-1 it runs
``make train SEED=s`` (the model build seeded with s, the careless walker's warm start with its demonstrations and
batch order seeded with s, GiGPO with trainer.seed=s, the held-out table), each seed in its own folders, and
writes the second generated block of ``docs/results.md``: each seed's held-out greedy curve, its
``learning_summary.json`` against make train's bar (``bench/baselines.py``'s GOAL_GAIN and GOAL_MARGIN), the
warm start's sampled hole choice, the model build's bytes, min / median / max of the RL end, the rate at which
the bar is met, and ``docs/results/pipeline_seeds.png``. The pipeline seed varies every source of variance a
user's machine varies (the model's bytes differ between CPUs), not only the RL seed.

For each environment: one SFT warm start, then each algorithm from that start, for each seed, with the
same budget (the environment's RL steps of 8 maps x 8 episodes or 8 x 4, the same per-turn token budget
and turns):

- PPO + GAE (``config/frozenlake.yaml``), bi-level GAE (``frozenlake_bilevel``), GRPO
  (``frozenlake_grpo``), multi-turn GRPO with context condensation (``frozenlake_grpo_multiturn``), and on
  make train's task also GiGPO (``frozenlake_gigpo``, make train's recipe); on request (``--algos``) GiGPO
  with a LoRA adapter (``gigpo_lora``: rank 16, lr 1e-3; ``bench/lora.py --learning`` compares it with GiGPO);
- environments (default: ``nodeadends`` and ``sokoban``):
  ``nodeadends``, make train's task (``FrozenLakeNoDeadEnds``, 4x4 maps where stepping Down or Right onto
  ice always reaches the goal) from make train's warm start (``config/sft_frozenlake_nodeadends.yaml``: a
  careless walker that knows the format, greedy success 0), with make train's layout (8 maps x 8
  episodes, actor lr 5e-4) for every algorithm, 45 steps, evaluated every 15;
  ``sokoban``, Sokoban 6x6 with one box (``SimpleSokoban``) from an SFT on deliberately imperfect expert
  demonstrations (``config/sft_frozenlake.yaml`` with the env's tag), 8 x 4 episodes, 20 steps, evaluated
  every 5; and, on request, the earlier FrozenLake 4x4 tasks with slippery ice off and on
  (``frozenlake``, ``frozenlake_slippery``, same layout as Sokoban).

The held-out seeds are the same for every run (``es_manager.seed=0``; the run's ``trainer.seed``
varies the sampling, the batch order and the training maps' order only through the policy).
Greedy held-out success and mean reward come from each run's ``metrics.jsonl``
(``val/success_rate``, ``val/episode_reward_mean``; step 0 is the SFT start); the baselines
(``bench/baselines.py``: uniform random valid actions, the best heuristic, the expert solver)
are played on the same seeds. ``docs/results.md``'s generated block gets the table (mean and
spread over seeds, and the sampled training success RL trains on), PNG curves (mean with a
min-max band) under ``docs/results/``, the command, the machine and the wall time of the
training processes (each recorded in ``<run>.log.seconds``); the reading below the block is
written by hand. Run folders go to ``--out`` (default ``outputs/learning``); an existing run
folder with a finished ``metrics.jsonl`` is reused (``--fresh`` redoes everything).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import baselines as bl  # noqa: E402
from bench.results import replace_block  # noqa: E402


@dataclass(frozen=True)
class EnvSpec:
    """One benchmark environment: its env tag, turn limit, warm start and RL budget."""

    label: str
    tag: str
    max_turn: int
    sft_config: str = "sft_frozenlake"
    """The SFT config of the warm start (its RL config's env tags are replaced by ``tag``)."""
    steps: int = 20
    """RL steps per run (``--steps`` overrides every environment's)."""
    test_freq: int = 5
    """Held-out evaluation every N RL steps (``--test-freq`` overrides every environment's)."""
    rl_overrides: tuple[str, ...] = ()
    """key=value of every RL run on this environment (the layout every algorithm shares)."""
    extra_algos: tuple[str, ...] = ()
    """Algorithms run on this environment only, after the shared ones."""
    layout: str = "8 maps x 4 episodes"


# make train's layout: 8 maps x 8 episodes per step and the actor lr of config/frozenlake_nodeadends.yaml
MAKE_TRAIN_LAYOUT = ("es_manager.train.env_groups=8", "es_manager.train.group_size=8",
                     "es_manager.train.env_configs.n_groups=[8]", "actor_rollout_ref.actor.optim.lr=5e-4")
ENVS = {
    "nodeadends": EnvSpec("FrozenLake 4x4 without dead ends (make train's task)", "FrozenLakeNoDeadEnds", 6,
                          sft_config="sft_frozenlake_nodeadends", steps=45, test_freq=15,
                          rl_overrides=MAKE_TRAIN_LAYOUT, extra_algos=("gigpo",), layout="8 maps x 8 episodes"),
    "sokoban": EnvSpec("Sokoban 6x6, 1 box", "SimpleSokoban", 10),
    "frozenlake": EnvSpec("FrozenLake 4x4, p 0.8", "FrozenLakeDescribed", 6),
    "frozenlake_slippery": EnvSpec("FrozenLake 4x4, p 0.8, slippery", "SlipperyFrozenLakeDescribed", 10),
}
DEFAULT_ENVS = ("nodeadends", "sokoban")
ALGOS = {
    "ppo_gae": ("PPO + GAE", "frozenlake"),
    "bilevel_gae": ("bi-level GAE", "frozenlake_bilevel"),
    "grpo": ("GRPO", "frozenlake_grpo"),
    "grpo_multiturn": ("multi-turn GRPO (condensed)", "frozenlake_grpo_multiturn"),
    "gigpo": ("GiGPO (make train's recipe)", "frozenlake_gigpo"),
    "gigpo_lora": ("GiGPO, LoRA rank 16 (lr 1e-3)", "frozenlake_gigpo"),
}
ALGO_OVERRIDES = {  # key=value after the env's own (the later value of a key wins)
    "gigpo_lora": ("actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                   "actor_rollout_ref.actor.optim.lr=1e-3"),
}
SHARED_ALGOS = ("ppo_gae", "bilevel_gae", "grpo", "grpo_multiturn")
DOC = REPO / "docs" / "results.md"
BEGIN = "<!-- bench/learning.py: generated block, begin -->"
END = "<!-- bench/learning.py: generated block, end -->"
PIPELINE_BEGIN = "<!-- bench/learning.py --pipeline-seeds: generated block, begin -->"
PIPELINE_END = "<!-- bench/learning.py --pipeline-seeds: generated block, end -->"
MAKE_TRAIN_CONFIG = "frozenlake_nodeadends"
FIG_DIR = REPO / "docs" / "results"


def env_overrides(env: EnvSpec, val_groups: int) -> list[str]:
    """RL overrides that put ``env`` in the train and validation splits, with fixed held-out seeds."""
    return [f"es_manager.train.env_configs.tags=[{env.tag}]", f"es_manager.val.env_configs.tags=[{env.tag}]",
            f"agent_proxy.max_turn={env.max_turn}", f"es_manager.val.env_groups={val_groups}",
            f"es_manager.val.env_configs.n_groups=[{val_groups}]", "es_manager.seed=0"]


def budget(env: EnvSpec, args) -> tuple[int, int]:
    """The RL steps and evaluation frequency of ``env``'s runs (the command line's, where given)."""
    return args.steps or env.steps, args.test_freq or env.test_freq


def algos_of(env: EnvSpec, args) -> list[str]:
    """The algorithms run on ``env``: the command line's, else the shared ones and the env's own."""
    return list(args.algos) if args.algos else [*SHARED_ALGOS, *env.extra_algos]


def finished(run_dir: Path, last_step: int) -> bool:
    """Whether ``run_dir`` holds the metrics of a run that reached ``last_step`` (reused, not rerun)."""
    return any(step == last_step for step, _ in bl.val_points(bl.read_metrics(run_dir)))


def run(cmd: list[str], log: Path) -> None:
    """Run one training process, output to ``log``, its wall time to ``<log>.seconds``; a failure stops the
    benchmark naming the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print("$", " ".join(cmd), flush=True)
    start = time.time()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode:
        raise SystemExit(f"bench/learning.py: {cmd[2]} failed (exit {proc.returncode}); see {log}")
    seconds_file(log).write_text(f"{time.time() - start:.1f}\n")


def log_file(run_dir: Path) -> Path:
    """The log of the process that wrote ``run_dir`` (beside it: ``<run_dir>.log``)."""
    return run_dir.with_suffix(".log")


def seconds_file(log: Path) -> Path:
    """Where :func:`run` records the wall time of the process that wrote ``log``."""
    return log.with_name(log.name + ".seconds")


def recorded_seconds(logs: list[Path]) -> tuple[float, int]:
    """Summed recorded wall time of the runs that wrote ``logs``, and how many have no record."""
    found = [float(seconds_file(log).read_text()) for log in logs if seconds_file(log).is_file()]
    return sum(found), len(logs) - len(found)


def own_rl_overrides(sft_config: str, config_dir: Path = REPO / "config") -> list[str]:
    """The ``rl_overrides`` of the SFT config ``sft_config`` (a LoRA adapter, say). A command line's
    ``rl_overrides`` replaces the config's list, so :func:`sft` passes these again before the env's."""
    from agent_trainer.checks.prepare import compose  # registers the SFT schema the config's defaults name

    return list(compose(sft_config, config_dir=config_dir).rl_overrides)


def sft(env_key: str, args) -> Path:
    """The env's SFT warm start (reused when its final model exists); returns the model folder."""
    env = ENVS[env_key]
    out = args.out / f"sft_{env_key}"
    if args.fresh or not (out / "final" / "config.json").is_file():
        rl = json.dumps([*own_rl_overrides(env.sft_config), *env_overrides(env, args.val_groups)])
        run([sys.executable, "-m", "agent_trainer.sft", "--config-name", env.sft_config, f"rl_overrides={rl}",
             f"trainer.default_local_dir={out}", f"trainer.experiment_name=sft_{env_key}", "eval.test_freq=0",
             *args.sft_overrides], log_file(out))
    return out / "final"


def rl(env_key: str, algo: str, seed: int, model: Path, args) -> Path:
    """One RL run from ``model`` (reused when it already finished); returns its folder."""
    out = args.out / f"{env_key}_{algo}_seed{seed}"
    env = ENVS[env_key]
    steps, test_freq = budget(env, args)
    if args.fresh or not finished(out, steps):
        run([sys.executable, "-m", "agent_trainer.main", "--config-name", ALGOS[algo][1], f"model_path={model}",
             *env_overrides(env, args.val_groups), *env.rl_overrides, f"trainer.seed={seed}",
             f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}",
             "trainer.val_before_train=true", "trainer.resume_mode=disable", f"trainer.default_local_dir={out}",
             f"trainer.experiment_name={env_key}_{algo}_seed{seed}", *ALGO_OVERRIDES.get(algo, ()),
             *args.rl_overrides], log_file(out))
    return out


def spread(values: list[float]) -> str:
    """``mean ± std`` (population std over seeds; ``mean`` alone for one value)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.pstdev(values):.3f}"


def curves(run_dirs: list[Path], key: str) -> tuple[list[int], list[list[float]]]:
    """The steps every run evaluated at, and each run's ``key`` at those steps."""
    points = [dict(bl.val_points(bl.read_metrics(d), key)) for d in run_dirs]
    steps = sorted(set.intersection(*(set(p) for p in points))) if points else []
    return steps, [[p[s] for s in steps] for p in points]


def plot(env_key: str, results: dict[str, list[Path]], baseline: dict[str, float]) -> Path:
    """Mean held-out greedy success over seeds with a min-max band, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    # curves that coincide stay visible: shrinking markers of different shapes, different dashes
    styles = zip("osD^v", (11, 9, 7, 5, 4), ("-", "--", "-.", ":", (0, (1, 3))))
    for (algo, dirs), (marker, size, line) in zip(results.items(), styles):
        steps, runs = curves(dirs, "val/success_rate")
        if not steps:
            continue
        mean = [statistics.fmean(col) for col in zip(*runs)]
        ax.plot(steps, mean, marker=marker, markersize=size, linestyle=line, label=ALGOS[algo][0])
        ax.fill_between(steps, [min(c) for c in zip(*runs)], [max(c) for c in zip(*runs)], alpha=0.2)
    for i, (name, value) in enumerate(sorted(baseline.items(), key=lambda kv: kv[1])):
        ax.axhline(value, linestyle=":", linewidth=1, color="grey")
        # neighbouring baselines' labels alternate between the left edge and the middle, so close ones stay legible
        ax.annotate(name, (0.02 + 0.4 * (i % 2), value), xycoords=("axes fraction", "data"), fontsize=7,
                    color="grey", va="bottom")
    ax.set(xlabel="RL step (0 = SFT start)", ylabel="held-out greedy success", ylim=(-0.02, 1.02),
           title=ENVS[env_key].label)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    FIG_DIR.mkdir(parents=True, exist_ok=True)
    path = FIG_DIR / f"{env_key}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def machine() -> str:
    """CPU model and core count, OS, Python."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    system = f"{platform.system()} {platform.release()}"
    return f"{model}, {os.cpu_count()} cores, {system}, Python {platform.python_version()}"


def env_section(env_key: str, results: dict[str, list[Path]],
                base: dict[str, bl.Score]) -> tuple[list[str], list[str]]:
    """The env's table rows and the sentences on what did not learn."""
    label = ENVS[env_key].label
    rows, notes, sft_start = [], [], []
    for algo, dirs in results.items():
        records = [bl.read_metrics(d) for d in dirs]  # each run's metrics.jsonl, read once
        success = [bl.val_points(r) for r in records]
        reward = [bl.val_points(r, "val/episode_reward_mean") for r in records]
        start, end = [s[0][1] for s in success], [s[-1][1] for s in success]
        sampled = [m for m in map(bl.training_window_means, records) if m is not None]
        trend = (f"{statistics.fmean(m[0] for m in sampled):.3f} -> {statistics.fmean(m[1] for m in sampled):.3f}"
                 if sampled else "")
        sft_start += start
        rows.append(f"| {label} | {ALGOS[algo][0]} | {spread(end)} | {spread([r[-1][1] for r in reward])} | "
                    f"{spread([e - s for s, e in zip(start, end)])} | {trend} | {len(dirs)} |")
        best_blind = max((s.success for n, s in base.items() if not bl.READS_OBSERVATION.get(n, True)), default=0.0)
        gain = statistics.fmean(end) - statistics.fmean(start)
        if gain < 0.05 or statistics.fmean(end) <= best_blind:
            notes.append(f"{ALGOS[algo][0]} on {label}: {statistics.fmean(start):.3f} -> {statistics.fmean(end):.3f} "
                         f"(best policy blind to the observation {best_blind:.3f})")
    rows.insert(0, f"| {label} | SFT start (RL step 0) | {spread(sft_start)} | | | | {len(sft_start)} |")
    for name, score in base.items():
        rows.append(f"| {label} | {name} | {score.success:.3f} | {score.reward:.3f} | | | {score.episodes} episodes |")
    return rows, notes


def write_doc(argv: list[str], args, sections: dict[str, tuple[list[str], list[str]]], figures: list[Path],
              wall_s: float, unrecorded: int) -> None:
    """docs/results.md's generated block: command, machine, wall time, the table, the curves, what did not learn.

    The text around the block (the reading of the results) is written by hand and kept."""
    full = (set(args.envs) >= set(DEFAULT_ENVS) and not args.algos and args.seeds >= 3 and not args.steps
            and not args.test_freq)
    lines = [f"- Command: `{' '.join(['python bench/learning.py', *argv])}`",
             f"- Machine: {machine()} (CPU only: FSDP2 over gloo, the vLLM CPU engine, the tiny model)",
             f"- Wall time: {wall_s / 60:.1f} min for the training processes (SFT and RL, summed from each run's "
             "`.log.seconds`)" + (f"; {unrecorded} of them without a recorded time" if unrecorded else ""),
             f"- Budget per run: " + "; ".join(
                 f"{ENVS[e].label}: {budget(ENVS[e], args)[0]} RL steps of {ENVS[e].layout}, greedy evaluation "
                 f"every {budget(ENVS[e], args)[1]} steps" for e in args.envs)
             + f"; {args.val_groups} held-out seeds; RL seeds {list(range(args.seeds))}",
             "- " + ("The full grid." if full else "**A reduced run** (not the full grid of the default "
                                                   "environments x every algorithm x 3 seeds at their budgets)."),
             "", "| environment | policy | held-out greedy success | mean reward | gain over SFT start | "
             "sampled training success, first 5 -> last 5 steps | runs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for rows, _ in sections.values():
        lines += rows
    lines += ["", "Success and reward: mean ± standard deviation over seeds at the last step. Sampled training "
              "success: the episodes RL trains on (temperature 1), mean over seeds. Baselines are played by "
              "`bench/baselines.py` on the same held-out seeds (random policies: 8 episodes per seed).", ""]
    lines += [f"![{p.stem}](results/{p.name})" for p in figures]
    notes = [n for _, ns in sections.values() for n in ns]
    lines += ["", "## What did not learn", ""]
    lines += ([f"- {n}" for n in notes] if notes else ["Every algorithm gained at least 5 points over its SFT start "
                                                        "and ended above every policy blind to the observation."])
    if any("grpo_multiturn" in algos_of(ENVS[e], args) for e in args.envs):
        lines += ["", "Multi-turn GRPO runs with ctx_manager.mode=condensed: every turn's prompt is rebuilt from a "
                  "summary of the last turns, a layout the SFT warm start (trained on full episodes, the only "
                  "layout SFT supports) never saw; its step 0 is that start under the condensed layout."]
    lines += ["", "Listed: algorithms whose mean over seeds gained less than 5 points over the SFT start or did not end "
              "above the best baseline blind to the observation (random, fixed sequences; not the map-reading safe "
              "Down/Right, not the expert)."]
    replace_block(DOC, "\n".join(lines) + "\n", BEGIN, END)


@dataclass
class PipelineRun:
    """What ``make train SEED=seed`` left: its summary, its held-out curve, its warm start and its wall time."""

    seed: int
    summary: dict
    curve: list[tuple[int, float]]
    warm_start: dict
    model_md5: str
    wall_s: float | None

    @property
    def gain(self) -> float:
        return self.summary["rl_end"] - self.summary["rl_start"]

    @property
    def best_blind(self) -> float:
        return max(b["success"] for b in self.summary["baselines"] if not b["reads_observation"])

    @property
    def passes(self) -> bool:
        return self.gain >= bl.GOAL_GAIN and self.summary["rl_end"] - self.best_blind >= bl.GOAL_MARGIN


def make_train_dirs(seed: int) -> tuple[Path, Path]:
    """make train's model folder and RL run folder for a pipeline seed (the Makefile's TRAIN_MODEL and RL_RUN)."""
    model = REPO / "models" / f"tiny-qwen2-train-seed{seed}"
    return model, REPO / "outputs" / "agent_trainer" / f"{MAKE_TRAIN_CONFIG}_seed{seed}"


def pipeline_run(seed: int, args) -> PipelineRun:
    """``make train SEED=seed`` (reused when its summary exists and ``--fresh`` is not given), then its results."""
    import hashlib

    model, rl_dir = make_train_dirs(seed)
    log = args.out / f"make_train_seed{seed}.log"
    if args.fresh or not (rl_dir / "learning_summary.json").is_file():
        run(["make", "--no-print-directory", "train", f"SEED={seed}"], log)
    warm = {}
    if log.is_file():  # the JSON line launch.warm_start_report prints before RL
        for line in log.read_text().splitlines():
            if line.startswith("{") and "chose_hole" in line:
                warm = next(iter(json.loads(line).values()))
    summary = json.loads((rl_dir / "learning_summary.json").read_text())
    md5 = hashlib.md5((model / "model.safetensors").read_bytes()).hexdigest()[:8]
    return PipelineRun(seed, summary, bl.val_points(bl.read_metrics(rl_dir)), warm, md5, summary.get("wall_s"))


def plot_pipeline(runs: list[PipelineRun]) -> Path:
    """Each pipeline seed's held-out greedy curve, with the best policy blind to the map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for run_, marker in zip(runs, "osD^v<>ph*"):
        ax.plot(*zip(*run_.curve), marker=marker, label=f"SEED={run_.seed}" + ("" if run_.passes else " (short)"))
    blind = max(r.best_blind for r in runs)
    ax.axhline(blind, linestyle=":", color="grey")
    ax.annotate(f"best policy blind to the map ({blind:.3f})", (0.02, blind), xycoords=("axes fraction", "data"),
                fontsize=7, color="grey", va="bottom")
    ax.set(xlabel="RL step (0 = the warm start)", ylabel="held-out greedy success", ylim=(-0.02, 1.02),
           title="make train over pipeline seeds (model build, warm start, RL)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    FIG_DIR.mkdir(parents=True, exist_ok=True)
    path = FIG_DIR / "pipeline_seeds.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pipeline_block(argv: list[str], runs: list[PipelineRun], figure: Path) -> str:
    """docs/results.md's pipeline-seed block: one row per seed, the spread, the rate at which the bar is met."""
    steps = sorted({s for r in runs for s, _ in r.curve})
    ends = [r.summary["rl_end"] for r in runs]
    passed = sum(r.passes for r in runs)
    lines = [f"- Command: `{' '.join(['python bench/learning.py', *argv])}`",
             f"- Machine: {machine()} (CPU only)",
             f"- Each seed is `make train SEED=s`: the model build (`--seed s`), the warm start (demonstration seed "
             f"s x 1000, batch order s), GiGPO with `trainer.seed=s`; {runs[0].summary['held_out_episodes']} "
             "held-out seeds (they follow the seed), baselines by `bench/baselines.py` on the same seeds.",
             f"- **The bar (held-out greedy success up {bl.GOAL_GAIN:.2f} from the RL start and {bl.GOAL_MARGIN:.2f} "
             f"above every policy blind to the map) is met by {passed} of {len(runs)} pipeline seeds.** RL end: "
             f"min {min(ends):.3f}, median {statistics.median(ends):.3f}, max {max(ends):.3f}.",
             "", "| SEED | model bytes (md5) | warm start, sampled: chose_hole / success | "
             + " | ".join(f"step {s}" for s in steps) + " | gain | best blind | bar | wall time |",
             "| --- | --- | --- | " + " | ".join("---:" for _ in steps) + " | ---: | ---: | --- | ---: |"]
    for r in runs:
        curve = dict(r.curve)
        warm = (f"{r.warm_start.get('chose_hole', float('nan')):.2f} / {r.warm_start.get('success', float('nan')):.3f}"
                if r.warm_start else "")
        wall = f"{r.wall_s / 60:.1f} min" if r.wall_s else ""
        lines.append(f"| {r.seed} | {r.model_md5} | {warm} | "
                     + " | ".join(f"{curve[s]:.3f}" if s in curve else "" for s in steps)
                     + f" | {r.gain:+.3f} | {r.best_blind:.3f} | {'met' if r.passes else 'short'} | {wall} |")
    lines += ["", "Wall time: `learning_summary.json`'s `wall_s`, from after the venv install to the end of the "
              "table (model build, warm start, RL, baselines).", "", f"![pipeline seeds](results/{figure.name})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the grid (reusing finished runs), then write docs/results.md."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=list(DEFAULT_ENVS), choices=list(ENVS))
    parser.add_argument("--algos", nargs="+", choices=list(ALGOS),
                        help="default: the four shared estimators, plus GiGPO on make train's task")
    parser.add_argument("--seeds", type=int, default=3, help="RL seeds per (env, algorithm): 0..N-1")
    parser.add_argument("--steps", type=int, help="RL steps per run, every env and algorithm (default: the env's)")
    parser.add_argument("--test-freq", type=int, help="held-out evaluation every N RL steps (default: the env's)")
    parser.add_argument("--val-groups", type=int, default=128, help="held-out seeds")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "learning")
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results exist")
    parser.add_argument("--sft-overrides", nargs="*", default=[], help="extra key=value of every SFT run")
    parser.add_argument("--rl-overrides", nargs="*", default=[], help="extra key=value of every RL run")
    parser.add_argument("--pipeline-seeds", type=int, default=0,
                        help="instead of the grid: make train SEED=0..N-1 and docs/results.md's pipeline-seed block")
    args = parser.parse_args(argv)
    if args.pipeline_seeds:
        args.out.mkdir(parents=True, exist_ok=True)
        runs = [pipeline_run(seed, args) for seed in range(args.pipeline_seeds)]
        replace_block(DOC, pipeline_block(argv, runs, plot_pipeline(runs)), PIPELINE_BEGIN, PIPELINE_END)
        print(f"wrote {DOC}", flush=True)
        return
    from agent_trainer.episode.es_manager import held_out_seeds
    from agent_trainer.checks.prepare import compose_and_prepare

    sections, figures, logs = {}, [], []
    for env_key in args.envs:
        env = ENVS[env_key]
        model = sft(env_key, args)
        results = {algo: [rl(env_key, algo, seed, model, args) for seed in range(args.seeds)]
                   for algo in algos_of(env, args)}
        logs += [log_file(model.parent)] + [log_file(d) for dirs in results.values() for d in dirs]
        cfg, env_tags = compose_and_prepare(env_overrides(env, args.val_groups), config_name="frozenlake")
        base = bl.baselines(env.tag, env_tags, held_out_seeds(cfg), env.max_turn)
        sections[env_key] = env_section(env_key, results, base)
        figures.append(plot(env_key, results, {n: s.success for n, s in base.items()}))
    write_doc(argv, args, sections, figures, *recorded_seconds(logs))
    print(f"wrote {DOC}", flush=True)


if __name__ == "__main__":
    main()
