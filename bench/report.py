"""Markdown of one bench invocation: ``<results>/report.md`` and, on request, ``docs/benchmarks.md``.

Only the block between ``BEGIN`` and ``END`` in docs/benchmarks.md is rewritten, so
sections other people add around it (trainer-side optimisations, context
condensation) survive ``make bench ARGS=--update-docs``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from results import fmt, render_table, replace_block

BEGIN = "<!-- make bench: generated block, begin -->"
END = "<!-- make bench: generated block, end -->"
DOC_ASSETS = ("results.json", "step_breakdown.png", "ratios.png", "p7_scaling.png")


P1_ASYNC_RUNS = (("continuous", "continuous k = 2"), ("group", "groups refilled k = 2"),
                 ("group_one_rank", "groups refilled k = 2, one actor rank"))
"""P1's asynchronous runs (``bench/suites.py``, ``P1_RUNS``) and how their rows read."""
P1_ASYNC_LEADS = {"continuous": "The asynchronous producer", "group": "Groups refilled as they end",
                  "group_one_rank": "Groups refilled as they end, one actor rank"}
"""How the report's paragraph on each of :data:`P1_ASYNC_RUNS` begins."""


def ratio_rows(r: dict) -> list[tuple[str, float, float | None, bool]]:
    """(label, ratio, target, higher is better) of every headline figure present."""
    rows = []
    if r.get("main"):
        rows.append((f"main job speedup vs {r['main']['ref']}", r["main"]["speedup"], 2.0, True))
        for name, v in (r["main"].get("opt_in") or {}).items():
            rows.append((f"main job speedup vs {r['main']['ref']}, opt-in {name}", v["speedup"], 2.0, True))
    for name, p2 in (r.get("P2") or {}).items():
        if "error" not in p2:
            rows.append((f"P2 GRPO step speedup vs TRL ({name})", p2["speedup"], 2.0, True))
    if r.get("P1"):
        rows.append(("P1 rollout / raw engine tokens/s", r["P1"].get("ratio"), 0.9, True))
        for name, label in P1_ASYNC_RUNS:
            if r["P1"].get(name):
                rows.append((f"P1 {label}: tokens per step second / raw engine", r["P1"][name]["busy_ratio"], 0.9,
                             True))
    if r.get("P3"):
        rows.append(("P3 weight-sync share of step", r["P3"]["frozenlake_share"], 0.02, False))
    if r.get("P5"):
        rows.append(("P5 peak RSS, main job / TRL", r["P5"]["ratio"], 2.0, False))
        rows.append(("P5 peak RSS, GRPO run / TRL", r["P5"].get("grpo_ratio"), 2.0, False))
        if r["P5"].get("pss_ratio") is not None:
            rows.append(("P5 peak PSS (shared pages once), main job / TRL", r["P5"]["pss_ratio"], 2.0, False))
            rows.append(("P5 peak PSS, GRPO run / TRL", r["P5"].get("grpo_pss_ratio"), 2.0, False))
    if r.get("P6"):
        rows.append(("P6 rollout slow env / no latency", r["P6"]["rollout_slowdown"], None, False))
        rows.append(("P6 slow-env rollout, barrier-free speedup", r["P6"].get("barrier_free_speedup"), 2.0, True))
        if r["P6"].get("overlap_speedup") is not None:
            rows.append(("P6 slow-env step, one-step overlap speedup", r["P6"]["overlap_speedup"], None, True))
            rows.append(("P6 main-job step, one-step overlap speedup", r["P6"]["main_overlap_speedup"], None, True))
        if r["P6"].get("reset_prefetch_speedup") is not None:
            rows.append(("P6 slow-reset step, prefetched reset speedup", r["P6"]["reset_prefetch_speedup"], None, True))
    for name, v in (r.get("P8") or {}).items():
        if name != "sync":
            rows.append((f"P8 slow-env trained episodes/s, {name} / sync", v["episodes_speedup"],
                         2.5 if name == "continuous_k2" else None, True))
            if name.endswith("_one_rank") and not name.startswith("sync") and v.get("vs_best_sync") is not None:
                rows.append((f"P8 slow-env trained episodes/s, {name} / the faster synchronous run",
                             v["vs_best_sync"], 2.5, True))
    for name, v in (r.get("P9") or {}).items():
        rows.append((f"P9 log-prob head, bytes kept for the backward, chunked / plain ({name})", v["saved_ratio"],
                     1.0, False))
        rows.append((f"P9 log-prob head, peak bytes of the head, chunked / plain ({name})",
                     v.get("head_peak_ratio"), 1.0, False))
    return [row for row in rows if row[1] is not None]


def _phase_table(runs: dict[str, dict[str, float]]) -> str:
    phases = ("rollout", "log_prob", "ref", "values", "update_critic", "update_actor", "sync", "step")
    rows = [[p, *(runs[label].get(p, 0.0) for label in runs)] for p in phases]
    return render_table(["phase (s, median of steps 2..N)", *runs], rows)


def render(r: dict, asset_prefix: str) -> str:
    """The Markdown block for results ``r``; images referenced as ``<asset_prefix><name>.png``."""
    m = r["meta"]
    loaded = " **Numbers from a loaded machine** (load average above half the cores at the start)." \
        if m["loaded"] else ""
    out = [f"Run `{m['command']}` on {m['date']} (UTC): {m['machine'].get('cores')} cores "
           f"({m['machine'].get('cpu', '?')}), {m['machine'].get('memory_gib', '?')} GiB, no GPU; load average "
           f"{fmt(m['machine'].get('load_avg_1m'))} at the start, {m['steps']} steps per run.{loaded} "
           "Every figure is a ratio of two measurements taken one after the other in this run; every number "
           f"and command is in [`{asset_prefix}results.json`]({asset_prefix}results.json).", ""]
    rows = ratio_rows(r)
    if rows:
        out += [render_table(["figure", "measured", "target"],
                             [[label, value, "-" if t is None else (f">= {t}" if hi else f"<= {t}")]
                              for label, value, t, hi in rows]), "", f"![ratios]({asset_prefix}ratios.png)", ""]
    out += _main_section(r)
    if r.get("runs"):
        out += ["Phases of every trainer run of this invocation (medians of steps 2..N):", "",
                f"![step breakdown]({asset_prefix}step_breakdown.png)", ""]
    out += _p2_section(r) + _other_sections(r)
    if r.get("P7"):
        out += [f"![scaling]({asset_prefix}p7_scaling.png)", ""]
    return "\n".join(out).rstrip() + "\n"


def _main_section(r: dict) -> list[str]:
    main = r.get("main")
    if not main:
        return []
    return ["### Main job: working tree vs the previous commit", "",
            f"`config/frozenlake.yaml` (PPO + GAE, 32 episodes x up to 6 turns), `{main['ref']}` "
            f"({main['ref_sha'][:10]}, a `git worktree`) then the working tree, same seeds, back to back"
            f"{_repeats(main)}: "
            f"{fmt(main['ref_step_s'])} s -> {fmt(main['current_step_s'])} s per step, "
            f"**{fmt(main['speedup'])}x**. Mean load average during each run: {fmt(main.get('ref_load'), 1)} and "
            f"{fmt(main.get('current_load'), 1)} (2 cores).", "",
            *_opt_in_text(main),
            _phase_table({f"{main['ref']}": main["ref_phases"], "working tree": main["current_phases"],
                          **{f"tree, {name}": v["phases"] for name, v in (main.get("opt_in") or {}).items()}}), ""]


def _opt_in_text(main: dict) -> list[str]:
    """The working tree's opt-in switches on the same job, against the same previous-commit runs."""
    opt_in = main.get("opt_in") or {}
    if not opt_in:
        return []
    parts = [f"{name} (`{' '.join(v['overrides'])}`): {fmt(v['step_s'])} s, **{fmt(v['speedup'])}x**"
             for name, v in opt_in.items()]
    return ["The same job with the working tree's opt-in switches, one run each after the pairs above, against "
            f"the same {main['ref']} figure: " + "; ".join(parts) + ".", ""]


def _repeats(main: dict) -> str:
    n = main.get("repeats", 1)
    return f", alternating, {n} runs each (median)" if n > 1 else ""


def _p2_section(r: dict) -> list[str]:
    p2 = r.get("P2")
    if not p2:
        return []
    failed = [f"{name}: {v['error']}" for name, v in p2.items() if "error" in v]
    p2 = {name: v for name, v in p2.items() if "error" not in v}
    if not p2:
        return ["### P2: GRPO step vs TRL GRPOTrainer", "", "Failed: " + "; ".join(failed), ""]
    rows = [[name, f"{v['n_params']/1e6:.1f}M", v.get("precision", "fp32"), v["trl_threads"], v["project_step_s"],
             v["trl_step_s"], v["speedup"], f"{fmt(v.get('project_load'), 1)} / {fmt(v.get('trl_load'), 1)}"]
            for name, v in p2.items()]
    first = next(iter(p2.values()))
    return ["### P2: GRPO step vs TRL GRPOTrainer", "",
            "32 rows = 8 groups x 4, one turn of at most 64 new tokens, one optimizer step, micro-batch 4, "
            f"KL 0.001 against a reference model; TRL {first['trl_version']} in `bench/.venv-trl` (same torch "
            "and transformers as the project), HF `generate`, activation checkpointing off (GRPOConfig's default is "
            "on; the project's is off); same first-turn prompts (one per group). Precision fp32: both sides in "
            "float32; bf16: the project's `actor_rollout_ref.actor.fsdp.mixed_precision=bf16` against TRL's "
            "`bf16=True` (its default), both `torch.autocast`. Speedup = TRL seconds / project seconds.", "",
            render_table(["model", "params", "precision", "TRL threads", "project s/step", "TRL s/step", "speedup",
                          "mean load (project / TRL)"], rows), "",
            f"Project: `{first['project_command']}`", "", f"TRL: `{first['trl_command']}`", "",
            *([f"Failed: {'; '.join(failed)}", ""] if failed else [])]


def _other_sections(r: dict) -> list[str]:
    out = []
    if (r.get("P1") or {}).get("steps"):
        p = r["P1"]
        rows = [[str(s["step"]), fmt(s["generated_tokens"], 0), fmt(s["rollout_seconds"]), fmt(s["raw_seconds"]),
                 " / ".join(fmt(x) for x in s["raw_pass_seconds"]), fmt(s["ratio"]), fmt(s["ratio_vs_tokens_only"])]
                for s in p["steps"]]
        out += ["### P1: multi-turn rollout vs the raw engine", "",
                f"The main job on the working tree (run `{p['label']}`, every step's episodes logged); for each of "
                "its steps 2..N, the rollout's generated tokens/s (env steps, resets and batch building included) "
                "against the raw vLLM engine's on the same contexts, per-turn batches and reply lengths, asked for "
                "the same outputs (the sampled token's logprob, no text), each pass from an empty prefix cache, "
                f"median of {p['raw_repeats']} passes per step. Median over the steps: **{fmt(p['ratio'])}**; "
                f"pooled over the steps ({fmt(p['rollout_tokens_per_s'], 0)} vs "
                f"{fmt(p['raw_engine_tokens_per_s'], 0)} tokens/s): {fmt(p['pooled_ratio'])}. Against vLLM's "
                f"default outputs (text, no logprobs, which the rollout cannot train on): "
                f"{fmt(p['ratio_vs_tokens_only'])}.", "",
                render_table(["step", "tokens", "rollout s", "raw s (median)", "raw passes (s)", "ratio",
                              "ratio vs text outputs"], rows), ""]
    for name, _ in P1_ASYNC_RUNS:
        if not (r.get("P1") or {}).get(name):
            continue
        p, c = r["P1"], r["P1"][name]
        rows = [[str(s["step"]), fmt(s["generated_tokens"], 0), fmt(s["rollout_seconds"]), fmt(s["step_seconds"]),
                 fmt(s["raw_seconds"]), fmt(s["ratio"])] for s in c["steps"]]
        own = (f"Each rollout alone, against its own time (two in flight share the engine): median "
               f"{fmt(c['ratio'])}." if name == "continuous" else
               "A stream of refilled groups has no rollout of its own: its rows' rollout seconds are the step's.")
        out += [f"{P1_ASYNC_LEADS[name]} (`" + " ".join(c["overrides"]) + f"`, run `{c['label']}`, steps "
                f"{c['steps'][0]['step']}..{c['steps'][-1]['step']}): its episodes overlap each other and the "
                "update, so the figure is the generated tokens per second of step time (what the producer "
                f"delivers) over the raw engine's: **{fmt(c['busy_ratio'])}** "
                f"({fmt(c['tokens_per_step_second'], 0)} vs {fmt(c['raw_engine_tokens_per_s'], 0)} tokens/s)"
                + (f"; the synchronous run above gives {fmt(p['busy_ratio'])} by the same measure. "
                   if p.get("busy_ratio") is not None else ". ") + own, "",
                render_table(["step", "tokens", "rollout s", "step s", "raw s (median)", "rollout ratio"], rows),
                ""]
    if r.get("P3"):
        out += [f"### P3: weight sync\n\n{fmt(r['P3']['sync_s'], 3)} s of a {fmt(r['P3']['step_s'])} s step: "
                f"**{fmt(100 * r['P3']['frozenlake_share'], 1)}%**.", ""]
    if r.get("P4"):
        p = r["P4"]
        out += [f"### P4: env actors\n\nOne turn of {p['episodes']} FrozenLake3x3 episodes: "
                f"{fmt(p['local_turn_ms'])} ms in-process, {fmt(p['actor_turn_ms'])} ms through a Ray actor "
                f"({fmt(p['ratio_actor_vs_local'], 1)}x); {fmt(p['overhead_ms_per_env_step'], 3)} ms of overhead per "
                f"env step" + (f", {fmt(100 * p['share_of_main_step'], 2)}% of a main-job step (6 turns)."
                               if p.get("share_of_main_step") else "."), ""]
    if r.get("P5"):
        p = r["P5"]
        out += [f"### P5: peak memory\n\nPeak RSS summed over the process tree: the main job "
                f"{fmt(p['project_peak_gib'])} GiB ({p['project_processes']} processes: driver, Ray, every worker) "
                f"vs TRL {fmt(p['trl_peak_gib'])} GiB ({p['trl_processes']} process) on the same model: "
                f"**{fmt(p['ratio'])}x**."
                + (f" On TRL's own work (P2's GRPO run, no critic): {fmt(p['grpo_peak_gib'])} GiB, "
                   f"{p['grpo_processes']} processes, **{fmt(p['grpo_ratio'])}x**." if p.get("grpo_ratio") else ""),
                ""]
        if p.get("pss_ratio") is not None:
            out += [f"Peak PSS (each shared page split among the processes that map it: the physical memory the "
                    f"tree occupies): the main job {fmt(p['project_peak_pss_gib'])} GiB vs TRL "
                    f"{fmt(p['trl_peak_pss_gib'])} GiB: **{fmt(p['pss_ratio'])}x**; the GRPO run "
                    f"{fmt(p['grpo_peak_pss_gib'])} GiB: **{fmt(p['grpo_pss_ratio'])}x**.", ""]
        if p.get("project_by_kind"):  # where the main job's peak is, largest first
            kinds = sorted(p["project_by_kind"].items(), key=lambda kv: -kv[1][1])
            out += ["The main job's peak by process (RSS counts shared library pages once per process; PSS "
                    "splits them):", "",
                    render_table(["process", "count", "RSS (GiB)", "PSS (GiB)"],
                                 [[k, v[0], v[1], v[2] if len(v) > 2 else None] for k, v in kinds]), ""]
    if r.get("P6"):
        p = r["P6"]
        out += [f"### P6: slow environment, with and without the turn barrier\n\n`SlowFrozenLake3x3` "
                "(`envs/slow_env.py`: FrozenLake whose steps sleep 50-500 ms, long tail, seeded), the main job's "
                "config otherwise: with the turn barrier (`actor_rollout_ref.rollout.mode=sync`, the default) the "
                f"rollout goes from {fmt(p['rollout_s'])} s without latency to {fmt(p['slow_rollout_s'])} s "
                f"(**{fmt(p['rollout_slowdown'])}x**; step {fmt(p['step_s'])} s -> {fmt(p['slow_step_s'])} s)."]
        if p.get("barrier_free_speedup") is not None:
            out[-1] += (f" Without it (`mode=async`): rollout {fmt(p['async_rollout_s'])} s, step "
                        f"{fmt(p['async_step_s'])} s: **{fmt(p['barrier_free_speedup'])}x** faster rollout.")
        if p.get("overlap_speedup") is not None:
            out[-1] += (f" With one-step off-policy overlap on top (`trainer.max_off_policy_steps=1`, token-level "
                        f"rollout correction): step {fmt(p['overlap_step_s'])} s"
                        + (f" (of which waiting for the prefetched rollout {fmt(p['overlap_wait_s'])} s)"
                           if p.get("overlap_wait_s") is not None else "")
                        + f", **{fmt(p['overlap_speedup'])}x** the "
                        f"barrier-free step and **{fmt(p['slow_total_speedup'])}x** the turn-synchronous one. "
                        f"The main job (no latency) with overlap: step {fmt(p['main_overlap_step_s'])} s vs "
                        f"{fmt(p['step_s'])} s, **{fmt(p['main_overlap_speedup'])}x**.")
        if p.get("reset_prefetch_speedup") is not None:
            out += ["", "`SlowResetFrozenLake3x3` (FrozenLake3x3 whose every reset sleeps 50 ms, 16 episodes per env "
                    "actor, instant steps): each rollout resetting its envs when it starts "
                    "(`es_manager.prefetch_reset=false`): rollout "
                    f"{fmt(p['slow_reset_at_start_rollout_s'])} s, step {fmt(p['slow_reset_at_start_step_s'])} s; "
                    "the next reset started as a rollout ends, while the step trains (the default): rollout "
                    f"{fmt(p['slow_reset_prefetched_rollout_s'])} s, step {fmt(p['slow_reset_prefetched_step_s'])} "
                    f"s: **{fmt(p['reset_prefetch_speedup'])}x**."]
        out += [""]
    if r.get("P7"):
        rows = [[name, v["axis"], v["step_s"], v["ratio_to_base"]] for name, v in r["P7"].items()]
        out += ["### P7: scaling", "", "Base: the main job (32 rows, 6 turns, 2 actor ranks, tiny model).", "",
                render_table(["run", "axis", "s/step", "ratio to base"], rows), ""]
    if r.get("P8"):
        rows = [[name, v["step_s"], v["episodes_per_step"], v["episodes_per_s"], v["episodes_speedup"],
                 v["trained_tokens_per_s"], v["tokens_speedup"], v["max_staleness"], v.get("stale_dropped"),
                 v.get("shared_calls")]
                for name, v in r["P8"].items()]
        out += ["### P8: synchronous, one-step-off and asynchronous training", "",
                "P6's `SlowFrozenLake3x3` with the barrier-free rollout (`actor_rollout_ref.rollout.mode=async`), "
                "GRPO (asynchronous training needs a critic-free estimator), the main job's config otherwise. "
                "sync: `trainer.max_off_policy_steps=0`; one_step_off: `max_off_policy_steps=1`; continuous_k: "
                "`max_off_policy_steps=k`, `trainer.async_mode=continuous` (k = 1, 2, 4), k rollouts in flight at "
                "once (`trainer.rollouts_in_flight`' default); continuous_k2_one_in_flight: k = 2, one rollout at a "
                "time (`trainer.rollouts_in_flight=1`); continuous_k2_calls_apart: k = 2, two in flight, each engine "
                "call carrying one rollout's requests (`trainer.share_engine_calls=false`; the others send the "
                "waiting requests of the rollouts in flight together). Every run with k >= 1 "
                "uses the token-level rollout correction. Episodes a step trains: its batch's, less the groups "
                "dropped as too stale; per second of step time. Each figure is the mean over steps k + 2..N (the "
                "steady state: those steps' rollouts were queued at step 2 or later; k = 0 for sync), at least "
                "16 steps per run.", "",
                render_table(["run", "s/step", "episodes/step", "episodes/s", "x sync", "trained tokens/s",
                              "x sync", "max staleness", "episodes dropped as stale",
                              "engine calls shared"], rows), ""]
    if r.get("P9"):
        rows = [[name, v["plain"]["n_params"], v["plain"]["scored_tokens"], v["plain"]["vocab"],
                 v["plain"]["seconds"], v["chunked"]["seconds"], v["speedup"],
                 v["plain"]["saved_bytes"] / 2 ** 20, v["chunked"]["saved_bytes"] / 2 ** 20,
                 v["plain"]["peak_rss_growth_bytes"] / 2 ** 20, v["chunked"]["peak_rss_growth_bytes"] / 2 ** 20,
                 *(v[side].get("head_peak_bytes", 0) / 2 ** 20 for side in ("plain", "chunked"))]
                for name, v in r["P9"].items()]
        out += ["### P9: the log-prob head, plain against chunked", "",
                "`bench/log_prob_head.py`, one process per variant: float32, 16 rows of 512 tokens, the last three "
                "quarters scored; the log-probs and the entropy of the scored tokens, forward and backward. plain: "
                "the scored positions projected to the vocabulary, log-softmax over the [N, V] logits (the workers' "
                "head before); chunked: `agent_trainer/workers/fused_head.py` (the workers' head now). Head peak: "
                "the head alone on the scored tokens' hidden states, forward and backward, the most bytes live at "
                "once (torch.profiler's memory timeline).", "",
                render_table(["model", "params", "scored tokens", "vocab", "plain s", "chunked s", "speedup",
                              "plain MiB kept for backward", "chunked MiB kept", "plain peak RSS growth MiB",
                              "chunked peak RSS growth MiB", "plain head peak MiB", "chunked head peak MiB"],
                             rows), ""]
    return out


def update_docs(results_folder: Path, block: str, doc: Path, assets: Path) -> None:
    """Replace the generated block of ``doc`` and copy the run's assets into ``assets``."""
    replace_block(doc, block, BEGIN, END)
    assets.mkdir(parents=True, exist_ok=True)
    for name in DOC_ASSETS:
        if (results_folder / name).exists():
            shutil.copy2(results_folder / name, assets / name)
