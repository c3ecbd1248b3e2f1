"""The parts of ``make bench`` (P1-P8 and the main job), each returning plain JSON.

Every figure is a ratio of two things measured in this invocation, one after the
other on the same machine. Runs are shared through :class:`Bench` (one trainer run
feeds the main job, P1, P3 and P5), so asking for several parts costs fewer runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import project_run
from project_run import REPO, RunResult, RunSpec
from results import ratio, steady_median
from trl_venv import ensure_trl_venv

PARTS = ("main", "P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9")
TINY = REPO / "models" / "tiny-qwen2"
MODEL_20M = REPO / "models" / "tiny-qwen2-20m"
MODELS = {"tiny": TINY, "20m": MODEL_20M}
PRECISIONS = ("fp32", "bf16")
BF16 = ["actor_rollout_ref.actor.fsdp.mixed_precision=bf16"]
"""The project's opt-in mixed precision (the colocated critic and reference follow the actor's fsdp section)."""
OVERLAP = ["trainer.max_off_policy_steps=1", "algorithm.rollout_correction.rollout_is=token"]
"""One-step off-policy overlap with its token-level correction (opt-in)."""
BYPASS = ["algorithm.rollout_correction.bypass_mode=true"]
"""The engine's log-probs as PPO's old policy, no old-log-prob forward (opt-in, verl's bypass mode)."""
OPT_IN = {"bypass": BYPASS, "bf16": BF16, "bf16 + overlap": [*BF16, *OVERLAP],
          "bf16 + overlap + bypass": [*BF16, "trainer.max_off_policy_steps=1", *BYPASS]}
"""The main job's opt-in runs: name -> overrides (with bypass, overlap needs no IS weights: PPO clips against
the policy that sampled)."""
# P2's matched GRPO work: 32 rows = 8 groups x 4, one turn of <= 64 new tokens, one optimizer step
# (mini-batch = all rows), micro-batch 4, KL loss 0.001 against the reference model.
GRPO_MATCHED = ["agent_proxy.max_turn=1", "ppo_mini_batch_size=32", "micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.response_length=64", "actor_rollout_ref.actor.use_kl_loss=true",
                "actor_rollout_ref.actor.kl_loss_coef=0.001"]
SLOW_RESET_ENV = ["envs_file=bench/slow_envs.yaml", "es_manager.train.env_configs.tags=[SlowResetFrozenLake3x3]",
                  "es_manager.val.env_configs.tags=[SlowResetFrozenLake3x3]"]
SLOW_ENV = ["envs_file=bench/slow_envs.yaml", "es_manager.train.env_configs.tags=[SlowFrozenLake3x3]",
            "es_manager.val.env_configs.tags=[SlowFrozenLake3x3]"]


@dataclass
class Bench:
    """Shared state of one invocation: sizes, the results folder, memoised runs."""

    out: Path
    steps: int
    ref: str = ""
    """Commit (any git ref) the main job is compared against."""
    tree: Path = REPO
    """The checkout measured as "current" (the working tree unless ``--tree``)."""
    repeats: int = 1
    """Alternating ref / working-tree runs of the main job."""
    trl_threads: tuple[int, ...] = (0,)
    """torch threads of the TRL process, one TRL run each; 0 = torch's default (all cores), what a TRL user
    gets. On a loaded machine multi-threaded OpenMP loses more than the project's one-thread workers."""
    precisions: tuple[str, ...] = ("fp32",)
    """P2's training precisions, one project and one TRL run each: fp32, or bf16 on both sides (the project's
    fsdp.mixed_precision=bf16, TRL's bf16=True, both torch.autocast)."""
    p8_runs: tuple[str, ...] = ()
    """P8's runs (names of ``ASYNC_MODES``); empty: every one."""
    p1_runs: tuple[str, ...] = ()
    """P1's runs (names of ``P1_RUNS``); empty: every one."""
    runs: dict[str, RunResult] = field(default_factory=dict)
    trl: dict[str, dict] = field(default_factory=dict)

    def project(self, spec: RunSpec) -> RunResult:
        """Run ``spec`` once per invocation (by label); log its result."""
        if spec.label not in self.runs:
            print(f"[bench] training {spec.label} ({spec.steps} steps) ...", flush=True)
            self.runs[spec.label] = project_run.run(spec, self.out / "logs")
            print(f"[bench]   step {self.runs[spec.label].phases['step']:.2f} s (median of steps 2..N)", flush=True)
        return self.runs[spec.label]

    def current(self, repeat: int = 0) -> RunResult:
        """The main job (``config/frozenlake.yaml``) on the working tree, episodes kept for P1."""
        return self.project(RunSpec(f"frozenlake_current{_suffix(repeat)}", steps=self.steps, code_dir=self.tree,
                                    overrides=[f"model_path={TINY}"]))

    def grpo(self, model: Path, precision: str = "fp32") -> RunResult:
        """P2's matched GRPO step on ``model``."""
        bf16 = precision == "bf16"
        return self.project(RunSpec(f"grpo_{model.name}{'_bf16' * bf16}", config="frozenlake_grpo",
                                    steps=self.steps, code_dir=self.tree, keep_trajectories=True,
                                    overrides=[f"model_path={model}", *GRPO_MATCHED, *(BF16 if bf16 else [])]))

    def trl_grpo(self, model: Path, threads: int = 0, precision: str = "fp32") -> dict:
        """TRL GRPOTrainer on ``model`` with the project run's first-turn prompts (own venv, subprocess)."""
        key = f"{model.name}_threads{threads}{'_bf16' * (precision == 'bf16')}"
        if key not in self.trl:
            firsts = {ep["group_id"]: ep["turns"][0]["prompt"] for ep in self.grpo(model).last_episodes}
            prompts = [firsts[g] for g in sorted(firsts)]  # one per group (maps may repeat across groups)
            work = self.out / "trl" / key
            work.mkdir(parents=True, exist_ok=True)
            (work / "prompts.json").write_text(json.dumps(prompts))
            print(f"[bench] TRL GRPOTrainer on {model.name}, {precision}, threads {threads or 'default'} ...",
                  flush=True)
            cmd = [str(ensure_trl_venv()), str(REPO / "bench" / "trl_grpo.py"), "--model", str(model),
                   "--prompts", str(work / "prompts.json"), "--out", str(work / "result.json"),
                   "--steps", str(self.steps), "--threads", str(threads),
                   *(["--bf16"] if precision == "bf16" else [])]
            _run_logged(cmd, work / "trl.log")
            res = json.loads((work / "result.json").read_text())
            res["step_median"] = steady_median(res["step_seconds"])
            res["command"] = " ".join(["bench/.venv-trl/bin/python", *cmd[1:]])
            self.trl[key] = res
        return self.trl[key]


def _suffix(repeat: int) -> str:
    """Run-label suffix of the main job's repeat ``repeat`` (none for the first)."""
    return f"_{repeat + 1}" if repeat else ""


def _run_logged(cmd: list[str], log: Path, **kwargs) -> None:
    """Run ``cmd`` with its output in ``log``; raise with the log's tail on failure."""
    with open(log, "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, **kwargs).returncode
    if code != 0:
        raise RuntimeError(f"{cmd[1]} exited {code}; log {log}:\n{project_run.log_tail(log)}")


def main_job(b: Bench) -> dict:
    """config/frozenlake.yaml step time: ``b.ref`` (a git worktree) vs the working tree, back to back.

    With ``b.repeats`` > 1 the two alternate (ref, tree, ref, tree, ...) and each side's figure is the
    median of its runs' medians, so a change of load on a shared machine hits both sides.
    """
    sha = subprocess.run(["git", "rev-parse", b.ref], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    before, after = [], []
    with tempfile.TemporaryDirectory(prefix="bench-ref-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), sha], cwd=REPO, check=True)
        try:
            for i in range(b.repeats):
                before.append(b.project(RunSpec(f"frozenlake_ref{_suffix(i)}", steps=b.steps, code_dir=tree,
                                                overrides=[f"model_path={TINY}"])))
                after.append(b.current(i))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    ref_s = statistics.median(r.phases["step"] for r in before)
    cur_s = statistics.median(r.phases["step"] for r in after)
    # the same job with the working tree's opt-in switches, against the same previous-commit runs
    opt_in = {}
    for name, overrides in OPT_IN.items():
        run = b.project(RunSpec(f"frozenlake_{name.replace(' + ', '_')}", steps=b.steps, code_dir=b.tree,
                                overrides=[f"model_path={TINY}", *overrides]))
        opt_in[name] = {"step_s": run.phases["step"], "speedup": ratio(ref_s, run.phases["step"]),
                        "load": run.mean_load_1m, "phases": run.phases, "overrides": overrides}
    return {"ref": b.ref, "ref_sha": sha, "ref_step_s": ref_s, "current_step_s": cur_s, "repeats": b.repeats,
            "ref_runs_s": [r.phases["step"] for r in before], "current_runs_s": [r.phases["step"] for r in after],
            "ref_load": statistics.mean(r.mean_load_1m or 0.0 for r in before),
            "current_load": statistics.mean(r.mean_load_1m or 0.0 for r in after),
            "speedup": ratio(ref_s, cur_s), "ref_phases": before[0].phases, "current_phases": after[0].phases,
            "command": after[0].command, "opt_in": opt_in}


def replay_turns(trajectories: list[dict]) -> list[list[dict]]:
    """Per turn, each live episode's context (ids before the reply) and its reply length.

    A turn's ``token_ids`` are its prompt span (mask 0) then its reply (mask 1); the
    context of turn k is every earlier turn's ids plus turn k's prompt span.
    """
    turns: list[list[dict]] = []
    for episode in trajectories:
        context: list[int] = []
        for k, turn in enumerate(episode["turns"]):
            prompt = [t for t, m in zip(turn["token_ids"], turn["mask"]) if m == 0]
            n = sum(turn["mask"])
            if n:
                while len(turns) <= k:
                    turns.append([])
                turns[k].append({"ids": context + prompt, "n": n})
            context += turn["token_ids"]
    return turns


def p1_rollout_vs_engine(b: Bench) -> dict:
    """Multi-turn rollout tokens/s vs the raw engine on the same contexts, step by step over steps 2..N.

    A run of its own (the main job on the working tree, every step's episodes logged); the raw engine
    replays each of its steps (``bench/raw_vllm.py``, median of its passes per step). The figure is the
    median over the steps of rollout tokens/s / raw tokens/s; one step against one pass moved by more
    than the 0.9 line between runs on this machine.

    ``continuous``: the same measurement with the asynchronous producer (k = 2, ``async_mode=continuous``, two
    rollouts in flight) over its steady state, steps k + 2..N. Its rollouts overlap each other and the update, so a
    rollout's own time is not the engines' time: the figure there is ``busy_ratio``, the generated tokens per
    second of step time (in the steady state the producer generates what the trainer takes) over the raw engine's
    tokens/s, which is what keeps the engines busy; the synchronous run's ``busy_ratio`` is beside it. ``group``:
    the same with the groups refilled as they end (``trainer.refill=group``), whose batches have no rollout time
    of their own (each row's rollout seconds are its step's).

    ``b.p1_runs`` picks the runs (names of :data:`P1_RUNS`; empty: every one).
    """
    wanted = b.p1_runs or P1_RUNS
    out: dict = {}
    if "sync" in wanted:
        run = b.project(RunSpec("frozenlake_p1", steps=b.steps, code_dir=b.tree, keep_trajectories=True,
                                every_step=True, overrides=[f"model_path={TINY}"]))
        out.update(_vs_raw_engine(b, run, first_step=2, work=b.out / "p1"))
    k = 2
    for name, overrides in (("continuous", P1_CONTINUOUS), ("group", P1_GROUP),
                            ("group_one_rank", [*P1_GROUP, *ONE_RANK])):
        if name not in wanted:
            continue
        run = b.project(RunSpec(f"frozenlake_p1_{name}", steps=max(b.steps, k + 4), code_dir=b.tree,
                                keep_trajectories=True, every_step=True, overrides=[f"model_path={TINY}", *overrides]))
        out[name] = _vs_raw_engine(b, run, first_step=k + 2, work=b.out / f"p1_{name}")
        out[name]["overrides"] = overrides
    return out


P1_CONTINUOUS = ["trainer.max_off_policy_steps=2", "trainer.async_mode=continuous",
                 "algorithm.rollout_correction.rollout_is=token", "algorithm.adv_estimator=grpo"]
"""P1's asynchronous run: two rollouts in flight (``rollouts_in_flight`` defaults to k), in-flight weight syncs;
GRPO, since asynchronous training refuses a critic (the rollout's work is the main job's)."""
P1_GROUP = [*P1_CONTINUOUS, "trainer.refill=group", "actor_rollout_ref.rollout.mode=async"]
"""P1's run with the groups refilled as they end (k x env_groups group slots, no turn barrier)."""
ONE_RANK = ["actor_rollout_ref.actor.fsdp.world_size=1"]
"""One actor rank (one intra-op thread) instead of the main job's two: on 2 cores the engine (one thread) then has a
core the trainer does not take, as engines on GPUs of their own have."""
P1_RUNS = ("sync", "continuous", "group", "group_one_rank")
"""P1's runs: the main job, the asynchronous producer with whole rollouts, with groups refilled, and with groups
refilled and one actor rank (:data:`ONE_RANK`)."""


def _vs_raw_engine(b: Bench, run: RunResult, first_step: int, work: Path) -> dict:
    """``run``'s steps ``first_step``..N (every step's episodes logged) against the raw engine replaying them."""
    steps = sorted(k for k in run.trajectories if k >= first_step) or sorted(run.trajectories)
    work.mkdir(parents=True, exist_ok=True)
    (work / "turns.json").write_text(json.dumps([replay_turns(run.trajectories[k]) for k in steps]))
    print(f"[bench] raw vLLM engine on the same contexts (steps {steps[0]}..{steps[-1]}) ...", flush=True)
    # One intra-op thread, like the rollout's engine actor (Ray gives a 1-CPU actor OMP_NUM_THREADS=1).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _run_logged([sys.executable, str(REPO / "bench" / "raw_vllm.py"), "--model", str(TINY), "--turns",
                 str(work / "turns.json"), "--out", str(work / "raw.json")], work / "raw_vllm.log", env=env)
    return vs_raw_figures(run.history, steps, json.loads((work / "raw.json").read_text()), run.label)


def vs_raw_figures(history: list[dict], steps: list[int], raw: dict, label: str) -> dict:
    """The ratios of :func:`p1_rollout_vs_engine` from the run's per-step metrics and the raw engine's passes."""
    per_step = []
    for k, raw_step in zip(steps, raw["steps"]):
        metrics = history[k - 1]
        # a stream of refilled groups has no rollout of its own: its batch's time is the step's
        rollout_s = metrics.get("timing_s/rollout", metrics["timing_s/step"])
        generated = metrics["perf/generated_tokens"]
        rollout_tps, raw_tps = generated / rollout_s, raw_step["generated_tokens"] / raw_step["seconds"]
        per_step.append({"step": k, "rollout_seconds": rollout_s, "step_seconds": metrics["timing_s/step"],
                         "generated_tokens": generated,
                         "raw_seconds": raw_step["seconds"], "raw_generated_tokens": raw_step["generated_tokens"],
                         "raw_pass_seconds": raw_step["pass_seconds"], "ratio": ratio(rollout_tps, raw_tps),
                         "ratio_vs_tokens_only": ratio(rollout_tps, raw_step["generated_tokens"]
                                                       / raw_step["tokens_only_seconds"]),
                         "turns": raw_step["turns"]})

    def pooled(key: str) -> float:
        return sum(s[key] for s in per_step)

    raw_tps = pooled("raw_generated_tokens") / pooled("raw_seconds")
    rollout_tps = pooled("generated_tokens") / pooled("rollout_seconds")
    step_tps = pooled("generated_tokens") / pooled("step_seconds")
    return {"ratio": statistics.median(s["ratio"] for s in per_step),
            "ratio_vs_tokens_only": statistics.median(s["ratio_vs_tokens_only"] for s in per_step),
            "pooled_ratio": ratio(rollout_tps, raw_tps), "busy_ratio": ratio(step_tps, raw_tps),
            "rollout_tokens_per_s": rollout_tps, "tokens_per_step_second": step_tps,
            "raw_engine_tokens_per_s": raw_tps,
            "steps": per_step, "raw_repeats": raw["repeats"], "label": label}


def p2_vs_trl(b: Bench, models: list[Path]) -> dict:
    """Matched GRPO step time, project vs TRL, per model (and TRL thread count): TRL s / project s."""
    out = {}
    for model, precision, threads in [(m, p, t) for m in models for p in b.precisions for t in b.trl_threads]:
        name = ", ".join([model.name, *(["bf16 both sides"] if precision == "bf16" else []),
                          *([f"TRL {threads} thread{'s' * (threads > 1)}"] if threads else [])])
        try:
            ours, theirs = b.grpo(model, precision), b.trl_grpo(model, threads, precision)
        except RuntimeError as exc:  # keep the other models' rows
            print(f"[bench] P2 {name} failed: {exc}", flush=True)
            out[name] = {"error": str(exc).splitlines()[0]}
            continue
        out[name] = {"project_step_s": ours.phases["step"], "trl_step_s": theirs["step_median"],
                     "speedup": ratio(theirs["step_median"], ours.phases["step"]),
                     "project_phases": ours.phases, "trl_threads": theirs["threads"], "precision": precision,
                     "trl_version": theirs["trl"], "n_params": theirs["n_params"],
                     "project_load": ours.mean_load_1m, "trl_load": theirs.get("mean_load_1m"),
                     "project_command": ours.command, "trl_command": theirs["command"]}
    return out


def p9_log_prob_head(b: Bench, models: list[Path]) -> dict:
    """The scored tokens' log-probs and entropy through the output head, the plain [N, V] head against the workers'
    chunked one (``bench/log_prob_head.py``, one process each): seconds of a forward and backward, bytes kept for
    the backward, growth of peak resident memory, the head's own peak bytes; per model."""
    out = {}
    for model in models:
        work = b.out / "p9" / model.name
        work.mkdir(parents=True, exist_ok=True)
        res = {}
        for variant in ("plain", "chunked"):
            print(f"[bench] P9 log-prob head on {model.name}, {variant} ...", flush=True)
            _run_logged([sys.executable, str(REPO / "bench" / "log_prob_head.py"), "--model", str(model),
                         "--variant", variant, "--out", str(work / f"{variant}.json")], work / f"{variant}.log")
            res[variant] = json.loads((work / f"{variant}.json").read_text())
        plain, chunked = res["plain"], res["chunked"]
        out[model.name] = {"plain": plain, "chunked": chunked,
                           "speedup": ratio(plain["seconds"], chunked["seconds"]),
                           "saved_ratio": chunked["saved_bytes"] / plain["saved_bytes"],
                           "head_peak_ratio": chunked["head_peak_bytes"] / plain["head_peak_bytes"],
                           "rss_growth_ratio": (chunked["peak_rss_growth_bytes"]
                                                / max(1, plain["peak_rss_growth_bytes"]))}
    return out


def p3_sync_share(b: Bench) -> dict:
    """Weight sync as a share of the step (main job and matched GRPO)."""
    run = b.current()
    return {"frozenlake_share": ratio(run.phases["sync"], run.phases["step"]), "sync_s": run.phases["sync"],
            "step_s": run.phases["step"]}


def p4_env_actor(b: Bench) -> dict:
    """Per-turn cost of stepping 16 episodes through a Ray env actor vs the same calls in-process."""
    import bench_envs

    r = bench_envs.bench_actor("FrozenLake3x3", 16, 200)
    step_s = b.runs["frozenlake_current"].phases["step"] if "frozenlake_current" in b.runs else None
    return {**r, "ratio_actor_vs_local": ratio(r["actor_turn_ms"], r["local_turn_ms"]),
            "overhead_ms_per_env_step": r["overhead_ms_per_turn"] / r["episodes"],
            # the main job calls each env actor once per turn, 6 turns a step
            "share_of_main_step": ratio(6 * r["overhead_ms_per_turn"] / 1e3, step_s) if step_s else None}


def p5_peak_rss(b: Bench) -> dict:
    """Peak memory of the trainer's whole process tree during the main job vs TRL's on the same model.

    RSS summed over the tree (the issue's figure: shared pages once per process) and PSS (each shared
    page split among the processes mapping it: the physical memory the tree occupies).
    """
    run, trl, grpo = b.current(), b.trl_grpo(TINY, b.trl_threads[0]), b.grpo(TINY)
    return {"project_peak_gib": run.peak_rss_bytes / 2**30, "project_processes": run.peak_processes,
            "trl_peak_gib": trl["peak_rss_bytes"] / 2**30, "trl_processes": trl["processes"],
            "ratio": ratio(run.peak_rss_bytes, trl["peak_rss_bytes"]),
            "project_peak_pss_gib": run.peak_pss_bytes / 2**30, "trl_peak_pss_gib": trl["peak_pss_bytes"] / 2**30,
            "pss_ratio": ratio(run.peak_pss_bytes, trl["peak_pss_bytes"]),
            # the same work as TRL's (P2's matched GRPO run: no critic)
            "grpo_peak_gib": grpo.peak_rss_bytes / 2**30, "grpo_processes": grpo.peak_processes,
            "grpo_ratio": ratio(grpo.peak_rss_bytes, trl["peak_rss_bytes"]),
            "grpo_peak_pss_gib": grpo.peak_pss_bytes / 2**30,
            "grpo_pss_ratio": ratio(grpo.peak_pss_bytes, trl["peak_pss_bytes"]),
            # where the main job's peak is: process kind -> [processes, RSS GiB, PSS GiB]
            "project_by_kind": {kind: [n, rss / 2**30, pss / 2**30]
                                for kind, (n, rss, pss) in run.peak_rss_by_kind.items()}}


def p6_slow_env(b: Bench) -> dict:
    """A 50-500 ms long-tailed env: the rollout with the turn barrier (rollout.mode=sync) and without it (async),
    and the same job without latency; then one-step off-policy overlap (trainer.max_off_policy_steps=1) on the
    barrier-free slow-env job and on the main job: whole-step time with and without it. Last, an env whose reset
    takes 50 ms per episode (``SlowResetFrozenLake3x3``): each rollout resetting when it starts
    (``es_manager.prefetch_reset=false``) vs the reset prefetched while the step trains (the default)."""
    fast = b.current()
    specs = {"sync": [*SLOW_ENV, "actor_rollout_ref.rollout.mode=sync"],
             "async": [*SLOW_ENV, "actor_rollout_ref.rollout.mode=async"],
             "async_overlap": [*SLOW_ENV, "actor_rollout_ref.rollout.mode=async", *OVERLAP],
             "main_overlap": OVERLAP,
             "reset_at_start": [*SLOW_RESET_ENV, "es_manager.prefetch_reset=false"],
             "reset_prefetched": SLOW_RESET_ENV}
    runs = {name: b.project(RunSpec(f"frozenlake_slow_env_{name}" if name != "main_overlap" else "frozenlake_overlap",
                                    steps=b.steps, code_dir=b.tree, overrides=[f"model_path={TINY}", *overrides]))
            for name, overrides in specs.items()}
    slow, free, both, main_overlap = runs["sync"], runs["async"], runs["async_overlap"], runs["main_overlap"]
    at_start, prefetched = runs["reset_at_start"], runs["reset_prefetched"]
    return {"rollout_s": fast.phases["rollout"], "slow_rollout_s": slow.phases["rollout"],
            "rollout_slowdown": ratio(slow.phases["rollout"], fast.phases["rollout"]),
            "step_s": fast.phases["step"], "slow_step_s": slow.phases["step"],
            "step_slowdown": ratio(slow.phases["step"], fast.phases["step"]),
            "async_rollout_s": free.phases["rollout"], "async_step_s": free.phases["step"],
            "barrier_free_speedup": ratio(slow.phases["rollout"], free.phases["rollout"]),
            "overlap_step_s": both.phases["step"], "overlap_wait_s": both.phases.get("wait_prefetch"),
            "overlap_speedup": ratio(free.phases["step"], both.phases["step"]),
            "slow_total_speedup": ratio(slow.phases["step"], both.phases["step"]),
            "main_overlap_step_s": main_overlap.phases["step"],
            "main_overlap_speedup": ratio(fast.phases["step"], main_overlap.phases["step"]),
            "command": slow.command, "async_command": free.command, "overlap_command": both.command,
            "main_overlap_command": main_overlap.command,
            "slow_reset_at_start_rollout_s": at_start.phases["rollout"],
            "slow_reset_at_start_step_s": at_start.phases["step"],
            "slow_reset_prefetched_rollout_s": prefetched.phases["rollout"],
            "slow_reset_prefetched_step_s": prefetched.phases["step"],
            "reset_prefetch_speedup": ratio(at_start.phases["step"], prefetched.phases["step"]),
            "slow_reset_command": prefetched.command}


CONTINUOUS = ["trainer.async_mode=continuous", "algorithm.rollout_correction.rollout_is=token"]
ASYNC_MODES = {"sync": [], "one_step_off": OVERLAP,
               **{f"continuous_k{k}": [f"trainer.max_off_policy_steps={k}", *CONTINUOUS] for k in (1, 2, 4)},
               "continuous_k2_one_in_flight": ["trainer.max_off_policy_steps=2", *CONTINUOUS,
                                               "trainer.rollouts_in_flight=1"],
               "continuous_k2_calls_apart": ["trainer.max_off_policy_steps=2", *CONTINUOUS,
                                             "trainer.share_engine_calls=false"],
               **{f"group_k{k}": [f"trainer.max_off_policy_steps={k}", *CONTINUOUS, "trainer.refill=group"]
                  for k in (2, 4)},
               "sync_one_rank": ONE_RANK,
               "group_k2_one_rank": ["trainer.max_off_policy_steps=2", *CONTINUOUS, "trainer.refill=group", *ONE_RANK]}
"""P8's runs: name -> overrides. sync: each rollout before its update (``max_off_policy_steps=0``); one_step_off:
the next rollout generated while the step trains (buffered, k = 1); continuous_k<k>: the producer keeps the next k
steps' rollouts generating, k of them at once (``trainer.rollouts_in_flight``' default), and the engines take new
weights between two engine calls (``async_mode=continuous``); continuous_k2_one_in_flight: k = 2 with one rollout
at a time, as before several could run at once; continuous_k2_calls_apart: k = 2, two rollouts in flight, each
engine call carrying one rollout's requests (``trainer.share_engine_calls=false``); group_k<k>: continuous with
each group refilled as soon as it ends (``trainer.refill=group``: k x env_groups group slots, ``rollouts_in_flight``'
default; a step takes each env tag's n_groups finished groups, the oldest versions first); sync_one_rank and
group_k2_one_rank: sync and group_k2 with one actor rank (:data:`ONE_RANK`), so that the one CPU engine has a core of
its own. Each run's ``vs_best_sync`` is its episodes per second over the faster of the synchronous runs made."""


P8_MIN_STEPS = 16
"""P8 trains at least this many steps per run: its figures are over steps k + 2..N (with k = 4: 11 steps)."""


def p8_async(b: Bench) -> dict:
    """Synchronous, one-step-off and asynchronous training (continuous, k = 1, 2, 4) side by side on the slow env
    (P6's ``SlowFrozenLake3x3``, barrier-free rollout), GRPO (asynchronous training needs a critic-free estimator),
    the main job's config otherwise: trained episodes and trained (generated) tokens per second of step time, each
    over the synchronous run's. Episodes a step trains: its batch's rows (one per episode in full mode).

    The window is the steady state, steps k + 2..N: their rollouts were queued at step 2 or later (step 1 queues
    the next k at once, which then run side by side with nothing to wait for), and each figure is its mean (a
    pipeline's steps alternate between waiting and not; the mean step time is its throughput)."""
    from omegaconf import OmegaConf

    train = OmegaConf.load(REPO / "config" / "frozenlake.yaml").es_manager.train
    per_step = float(train.env_groups * train.group_size)
    base = [f"model_path={TINY}", *SLOW_ENV, "actor_rollout_ref.rollout.mode=async", "algorithm.adv_estimator=grpo"]
    steps = max(b.steps, P8_MIN_STEPS)
    out: dict[str, dict] = {}
    for name, extra in ASYNC_MODES.items():
        if b.p8_runs and name not in b.p8_runs and name != "sync":
            continue
        k = next((int(o.split("=")[1]) for o in extra if o.startswith("trainer.max_off_policy_steps=")), 0)
        run = b.project(RunSpec(f"frozenlake_slow_env_grpo_{name}", steps=steps, code_dir=b.tree,
                                overrides=[*base, *extra]))
        steady = run.history[k + 1:]
        step_s = statistics.fmean(h["timing_s/step"] for h in steady)
        # trained episodes: the batch's rows (one per episode here); with whole rollouts, the batch less the
        # groups dropped as stale; with groups refilled, a dropped group's place is taken by the next one
        episodes = statistics.fmean(h.get("perf/num_rows", per_step - h.get("rollout/stale_dropped", 0.0))
                                    for h in steady)
        tokens = statistics.fmean(h["perf/generated_tokens"] for h in steady)
        out[name] = {"step_s": step_s, "episodes_per_step": episodes, "episodes_per_s": episodes / step_s,
                     "trained_tokens_per_s": tokens / step_s, "window": [k + 2, len(run.history)],
                     "max_staleness": max(h.get("rollout/policy_staleness", 0.0) for h in run.history),
                     "stale_dropped": sum(h.get("rollout/stale_dropped", 0.0) for h in run.history),
                     "shared_calls": shared_fraction(steady),
                     "command": run.command}
    return p8_speedups(out)


def p8_speedups(out: dict[str, dict]) -> dict[str, dict]:
    """Each P8 run's trained episodes and tokens per second over the ``sync`` run's (``episodes_speedup``,
    ``tokens_speedup``), and its episodes per second over the faster of the synchronous runs made (``vs_best_sync``:
    ``sync`` and ``sync_one_rank``)."""
    sync = out["sync"]
    best_sync = max(v["episodes_per_s"] for name, v in out.items() if name.startswith("sync"))
    for v in out.values():
        v["episodes_speedup"] = ratio(v["episodes_per_s"], sync["episodes_per_s"])
        v["tokens_speedup"] = ratio(v["trained_tokens_per_s"], sync["trained_tokens_per_s"])
        v["vs_best_sync"] = ratio(v["episodes_per_s"], best_sync)
    return out


def shared_fraction(history: list[dict]) -> float | None:
    """Of the engine calls of the rollouts in flight, the fraction that carried another rollout's requests too
    (None with one rollout at a time)."""
    calls = sum(h.get("rollout/engine_calls", 0.0) for h in history)
    return sum(h.get("rollout/engine_calls_shared", 0.0) for h in history) / calls if calls else None


def p7_variants(with_20m: bool) -> dict[str, tuple[str, list[str]]]:
    """name -> (axis, overrides) of the scaling runs; the base (32 rows, 6 turns, 2 ranks) is the main job."""
    variants = {}
    for rows in (8, 128):
        groups = rows // 4
        variants[f"rows_{rows}"] = ("rows", [f"es_manager.train.env_groups={groups}",
                                             f"es_manager.train.env_configs.n_groups=[{groups}]",
                                             f"ppo_mini_batch_size={min(16, rows)}"])
    for turns in (1, 3):
        variants[f"turns_{turns}"] = ("turns", [f"agent_proxy.max_turn={turns}"])
    variants["ranks_1"] = ("ranks", ["actor_rollout_ref.actor.fsdp.world_size=1"])
    if with_20m:
        variants["model_20m"] = ("model", [f"model_path={MODEL_20M}"])
    return variants


def p7_scaling(b: Bench, with_20m: bool) -> dict:
    """Step time per variant, and its ratio to the base run (the main job's config)."""
    base = b.current()
    out = {"base": {"axis": "base", "step_s": base.phases["step"], "ratio_to_base": 1.0}}
    for name, (axis, overrides) in p7_variants(with_20m).items():
        model = [] if any(o.startswith("model_path=") for o in overrides) else [f"model_path={TINY}"]
        run = b.project(RunSpec(f"p7_{name}", steps=b.steps, code_dir=b.tree, overrides=[*model, *overrides]))
        out[name] = {"axis": axis, "step_s": run.phases["step"],
                     "ratio_to_base": ratio(run.phases["step"], base.phases["step"]), "phases": run.phases}
    return out
