"""The bench's pure parts: results-folder naming, steady-state medians, ratio tables, docs block, replay."""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import report  # noqa: E402
import results  # noqa: E402
import run as bench_run  # noqa: E402
from suites import P1_CONTINUOUS, P1_GROUP, p7_variants, p8_speedups, replay_turns, vs_raw_figures  # noqa: E402

NOON = dt.datetime(2026, 11, 22, 12, 0, 5, tzinfo=dt.timezone.utc)


def test_results_dir_is_utc_stamp_and_never_reused(tmp_path):
    first = results.results_dir(tmp_path, NOON)
    assert first == tmp_path / "20261122T120005Z"
    first.mkdir()
    assert results.results_dir(tmp_path, NOON) == tmp_path / "20261122T120005Z-1"
    # A local time names the same UTC instant.
    cet = NOON.astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert results.results_dir(tmp_path / "other", cet).name == "20261122T120005Z"


def test_steady_median_skips_the_first_step():
    assert results.steady_median([100.0, 3.0, 1.0, 2.0]) == 2.0
    assert results.steady_median([100.0, 4.0, 2.0]) == 3.0
    assert results.steady_median([7.0]) == 7.0  # a single step is all there is
    with pytest.raises(ValueError):
        results.steady_median([])


def test_ratio_and_table_rendering():
    assert results.ratio(3.0, 1.5) == 2.0
    assert results.ratio(1.0, 0.0) is None
    table = results.render_table(["figure", "measured", "target"], [["P1", 0.912, ">= 0.9"], ["P3", None, "-"]])
    assert table.splitlines() == [
        "| figure | measured | target |",
        "| --- | ---: | ---: |",
        "| P1 | 0.91 | >= 0.9 |",
        "| P3 | n/a | - |",
    ]


def test_ratio_rows_and_block_from_results():
    r = {"meta": {"command": "python bench/run.py --quick", "date": "2026-11-22 12:00", "steps": 3,
                  "loaded": True, "machine": {"cores": 2, "cpu": "x", "memory_gib": 24, "load_avg_1m": 3.0}},
         "main": {"ref": "HEAD", "ref_sha": "abcdef1234567", "ref_step_s": 6.0, "current_step_s": 3.0,
                  "speedup": 2.0, "ref_phases": {"step": 6.0}, "current_phases": {"step": 3.0}},
         "P1": {"ratio": 0.8, "ratio_vs_tokens_only": 0.7, "pooled_ratio": 0.79, "rollout_tokens_per_s": 100.0,
                "raw_engine_tokens_per_s": 126.6, "raw_repeats": 3, "label": "frozenlake_p1",
                "steps": [{"step": 2, "generated_tokens": 100.0, "rollout_seconds": 1.0, "raw_seconds": 0.8,
                           "raw_pass_seconds": [0.8, 0.9, 0.7], "ratio": 0.8, "ratio_vs_tokens_only": 0.7}]},
         "P3": {"frozenlake_share": 0.01, "sync_s": 0.03, "step_s": 3.0}}
    rows = report.ratio_rows(r)
    assert [(label.split()[0], value, target) for label, value, target, _ in rows] == [
        ("main", 2.0, 2.0), ("P1", 0.8, 0.9), ("P3", 0.01, 0.02)]
    block = report.render(r, asset_prefix="bench/")
    assert "**Numbers from a loaded machine**" in block
    assert "| main job speedup vs HEAD | 2.00 | >= 2.0 |" in block
    assert "![ratios](bench/ratios.png)" in block
    assert "Median over the steps: **0.80**; pooled over the steps (100 vs 127 tokens/s): 0.79" in block
    assert "| 2 | 100 | 1.00 | 0.80 | 0.80 / 0.90 / 0.70 | 0.80 | 0.70 |" in block
    r["P2"] = {"tiny-qwen2": {"error": "trainer exited 1"}}
    assert report.ratio_rows(r)[1][0].startswith("P1")  # a failed row has no ratio
    assert "Failed: tiny-qwen2: trainer exited 1" in report.render(r, asset_prefix="")
    r["P5"] = {"project_peak_gib": 6.0, "project_processes": 3, "trl_peak_gib": 0.5, "trl_processes": 1, "ratio": 12.0,
               "project_by_kind": {"driver": [1, 0.5], "VLLMRolloutWorker": [1, 1.9], "ActorWorker": [2, 1.4]}}
    by_kind = report.render(r, asset_prefix="").split("The main job's peak by process")[1].splitlines()
    assert by_kind[4:7] == ["| VLLMRolloutWorker | 1 | 1.90 | n/a |", "| ActorWorker | 2 | 1.40 | n/a |",
                            "| driver | 1 | 0.50 | n/a |"]  # results from before PSS was recorded
    r["P5"].update(project_peak_pss_gib=4.0, trl_peak_pss_gib=0.5, pss_ratio=8.0, grpo_peak_pss_gib=3.0,
                   grpo_pss_ratio=6.0, project_by_kind={"driver": [1, 0.5, 0.4], "ActorWorker": [2, 1.4, 0.9]})
    assert [row[:2] for row in report.ratio_rows(r) if "PSS" in row[0]] == [
        ("P5 peak PSS (shared pages once), main job / TRL", 8.0), ("P5 peak PSS, GRPO run / TRL", 6.0)]
    block = report.render(r, asset_prefix="")
    assert "the main job 4.00 GiB vs TRL 0.50 GiB: **8.00x**" in block
    assert "| ActorWorker | 2 | 1.40 | 0.90 |" in block
    r["P6"] = {"rollout_s": 0.5, "slow_rollout_s": 10.0, "rollout_slowdown": 20.0, "step_s": 3.0, "slow_step_s": 12.5,
               "async_rollout_s": 4.0, "async_step_s": 6.5, "barrier_free_speedup": 2.5}
    assert report.ratio_rows(r)[-1][1:3] == (2.5, 2.0)
    assert "rollout 4.00 s, step 6.50 s: **2.50x** faster rollout" in report.render(r, asset_prefix="")
    r["P6"].update(overlap_step_s=5.0, overlap_wait_s=0.2, overlap_speedup=1.3, slow_total_speedup=2.5,
                   main_overlap_step_s=3.3, main_overlap_speedup=0.91)
    assert [row[1] for row in report.ratio_rows(r)[-2:]] == [1.3, 0.91]
    text = report.render(r, asset_prefix="")
    assert "step 5.00 s (of which waiting for the prefetched rollout 0.20 s), **1.30x** the barrier-free" in text
    assert "step 3.30 s vs 3.00 s, **0.91x**" in text
    r["P6"].update(slow_reset_at_start_rollout_s=1.8, slow_reset_at_start_step_s=3.4,
                   slow_reset_prefetched_rollout_s=1.0, slow_reset_prefetched_step_s=2.7, reset_prefetch_speedup=1.26)
    assert report.ratio_rows(r)[-1][:2] == ("P6 slow-reset step, prefetched reset speedup", 1.26)
    assert "the step trains (the default): rollout 1.00 s, step 2.70 s: **1.26x**." in report.render(r, asset_prefix="")


def test_p1_continuous_figures_count_step_time_and_render_beside_the_synchronous_run():
    history = [{"timing_s/rollout": 9.0, "timing_s/step": 9.0, "perf/generated_tokens": 1.0}] * 3 + [
        {"timing_s/rollout": 2.0, "timing_s/step": 1.0, "perf/generated_tokens": 100.0},
        {"timing_s/rollout": 3.0, "timing_s/step": 1.5, "perf/generated_tokens": 150.0}]
    raw = {"repeats": 3, "steps": [
        {"generated_tokens": 100, "seconds": 0.5, "pass_seconds": [0.5], "tokens_only_seconds": 0.25, "turns": 6},
        {"generated_tokens": 150, "seconds": 1.0, "pass_seconds": [1.0], "tokens_only_seconds": 0.5, "turns": 6}]}
    c = vs_raw_figures(history, [4, 5], raw, "frozenlake_p1_continuous")
    # 250 tokens in 2.5 s of steps against the raw engine's 250 tokens in 1.5 s
    assert c["busy_ratio"] == pytest.approx((250 / 2.5) / (250 / 1.5))
    assert c["pooled_ratio"] == pytest.approx((250 / 5.0) / (250 / 1.5))  # each rollout against its own time
    assert [s["step"] for s in c["steps"]] == [4, 5]
    r = {"meta": {"command": "python bench/run.py --only P1", "date": "2026-12-04 09:00", "steps": 6, "loaded": False,
                  "machine": {"cores": 2}},
         "P1": {**vs_raw_figures(history, [4, 5], raw, "frozenlake_p1"),
                "continuous": {**c, "overrides": P1_CONTINUOUS}}}
    assert [label for label, *_ in report.ratio_rows(r)] == [
        "P1 rollout / raw engine tokens/s", "P1 continuous k = 2: tokens per step second / raw engine"]
    block = report.render(r, asset_prefix="")
    assert "trainer.async_mode=continuous" in block and f"**{c['busy_ratio']:.2f}**" in block

    # the groups refilled as they end: no rollout time of their own, each row's is its step's; P1 without its
    # synchronous run renders the asynchronous rows alone
    streamed = [{"timing_s/step": 1.0, "perf/generated_tokens": 100.0}] * 5
    g = vs_raw_figures(streamed, [4, 5], raw, "frozenlake_p1_group")
    assert g["busy_ratio"] == g["pooled_ratio"] == pytest.approx((200 / 2.0) / (250 / 1.5))
    r["P1"] = {"group": {**g, "overrides": P1_GROUP}}
    assert [label for label, *_ in report.ratio_rows(r)] == [
        "P1 groups refilled k = 2: tokens per step second / raw engine"]
    block = report.render(r, asset_prefix="")
    assert "trainer.refill=group" in block and f"**{g['busy_ratio']:.2f}**" in block
    assert "synchronous run above" not in block


def test_opt_in_main_runs_and_p2_precisions_are_reported():
    r = {"meta": {"command": "python bench/run.py", "date": "2026-11-23 01:00", "steps": 6, "loaded": False,
                  "machine": {"cores": 2, "cpu": "x", "memory_gib": 24, "load_avg_1m": 0.1}},
         "main": {"ref": "HEAD", "ref_sha": "abcdef1234567", "ref_step_s": 3.0, "current_step_s": 2.5,
                  "speedup": 1.2, "ref_phases": {"step": 3.0}, "current_phases": {"step": 2.5},
                  "opt_in": {"bf16": {"step_s": 2.0, "speedup": 1.5, "phases": {"step": 2.0},
                                      "overrides": ["actor_rollout_ref.actor.fsdp.mixed_precision=bf16"]}}},
         "P2": {"tiny-qwen2, bf16 both sides": {
             "project_step_s": 0.5, "trl_step_s": 0.6, "speedup": 1.2, "precision": "bf16", "trl_threads": 2,
             "n_params": 6e5, "trl_version": "1.16.0", "project_command": "p", "trl_command": "t"}}}
    assert report.ratio_rows(r)[:3] == [("main job speedup vs HEAD", 1.2, 2.0, True),
                                        ("main job speedup vs HEAD, opt-in bf16", 1.5, 2.0, True),
                                        ("P2 GRPO step speedup vs TRL (tiny-qwen2, bf16 both sides)", 1.2, 2.0, True)]
    block = report.render(r, asset_prefix="")
    assert "bf16 (`actor_rollout_ref.actor.fsdp.mixed_precision=bf16`): 2.00 s, **1.50x**" in block
    assert "| phase (s, median of steps 2..N) | HEAD | working tree | tree, bf16 |" in block
    assert "| tiny-qwen2, bf16 both sides | 0.6M | bf16 | 2 | 0.50 | 0.60 | 1.20 |" in block


def test_update_docs_replaces_only_the_generated_block(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\nintro\n{report.BEGIN}\nold numbers\n{report.END}\n"
                   "## Trainer-side optimisations\nkept\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.json").write_text("{}")
    report.update_docs(folder, "new numbers\n", doc, tmp_path / "assets")
    assert doc.read_text() == (f"# Benchmarks\nintro\n{report.BEGIN}\nnew numbers\n{report.END}\n"
                               "## Trainer-side optimisations\nkept\n")
    assert (tmp_path / "assets" / "results.json").exists()
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        report.update_docs(folder, "x", doc, tmp_path / "assets")


def test_replay_turns_rebuilds_each_turns_context():
    episode = {"turns": [{"token_ids": [1, 2, 3, 4], "mask": [0, 0, 1, 1]},
                         {"token_ids": [5, 6, 7], "mask": [0, 1, 1]},
                         {"token_ids": [8], "mask": [0]}]}  # last observation, no reply
    short = {"turns": [{"token_ids": [9, 10], "mask": [0, 1]}]}
    assert replay_turns([episode, short]) == [
        [{"ids": [1, 2], "n": 2}, {"ids": [9], "n": 1}],
        [{"ids": [1, 2, 3, 4, 5], "n": 2}],
    ]


def test_cli_parts_and_sizes():
    assert "P7" not in bench_run.parse_args(["--quick"]).parts
    assert bench_run.parse_args(["--quick"]).steps == 3
    assert bench_run.parse_args(["--only", "P5,main"]).parts == ["main", "P5"]  # suite order
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--only", "P10"])
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--steps", "1"])
    assert bench_run.parse_args(["--trl-threads", "0,1"]).trl_threads == (0, 1)
    assert bench_run.parse_args(["--quick"]).models == ["tiny"]
    assert bench_run.parse_args([]).precision == ("fp32", "bf16")
    assert bench_run.parse_args(["--quick"]).precision == ("fp32",)
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--precision", "fp8"])
    assert bench_run.parse_args([]).models == ["tiny", "20m"]
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--models", "7b"])
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--trl-threads", "all"])
    rows = {name: axis for name, (axis, _) in p7_variants(with_20m=True).items()}
    assert rows == {"rows_8": "rows", "rows_128": "rows", "turns_1": "turns", "turns_3": "turns",
                    "ranks_1": "ranks", "model_20m": "model"}


def test_process_kinds_name_ray_workers_by_class_and_ray_daemons_by_role():
    from rss import process_kind, tree_memory

    assert process_kind("ray::ActorWorker.update_actor", "ray::ActorWorker.update_actor") == "ActorWorker"
    assert process_kind("python", "ray::VLLMRolloutWorker") == "VLLMRolloutWorker"
    assert process_kind("ray::IDLE", "ray::IDLE") == "IDLE"
    assert process_kind("ray-dashboard-JobHead-0", "ray-dashboard-JobHead-0") == "dashboard"
    assert process_kind("python", "/x/python -m agent_trainer.main --config-name frozenlake") == "driver"
    assert process_kind("gcs_server", "/x/gcs_server --port 1") == "gcs_server"
    assert process_kind("bash", "bash -c true") == "bash"
    by_kind: dict = {}
    total, pss, count = tree_memory(os.getpid(), by_kind)  # this very process: one kind, the whole total
    assert count >= 1 and sum(v[0] for v in by_kind.values()) == count
    assert sum(v[1] for v in by_kind.values()) == total and sum(v[2] for v in by_kind.values()) == pss
    assert 0 < pss <= total  # a shared page is split, never counted more than once
    assert tree_memory(os.getpid(), with_pss=False)[1] == 0  # the cheap sample: RSS only


def test_peak_sampler_reads_pss_on_every_nth_sample_only():
    import time

    from rss import PeakRSS

    with PeakRSS(os.getpid(), interval=0.01, pss_every=4) as sampler:
        deadline = time.monotonic() + 60  # a loaded machine samples late: wait for the samples, not for a time
        while len(sampler.loads) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sampler.peak_bytes > 0 and 0 < sampler.peak_pss_bytes <= sampler.peak_bytes
    assert sum(v[0] for v in sampler.peak_by_kind.values()) >= 1 and len(sampler.loads) >= 8


def test_p8_reports_each_mode_over_the_synchronous_run():
    r = {"meta": {"command": "python bench/run.py --only P8", "date": "2026-12-02 17:00", "steps": 6,
                  "loaded": False, "machine": {"cores": 2, "cpu": "x", "memory_gib": 24, "load_avg_1m": 0.1}},
         "P8": {"sync": {"step_s": 8.0, "episodes_per_step": 32.0, "episodes_per_s": 4.0, "episodes_speedup": 1.0,
                         "trained_tokens_per_s": 100.0, "tokens_speedup": 1.0, "max_staleness": 0.0},
                "continuous_k2": {"step_s": 4.0, "episodes_per_step": 28.0, "episodes_per_s": 7.0,
                                  "episodes_speedup": 1.75, "trained_tokens_per_s": 180.0, "tokens_speedup": 1.8,
                                  "max_staleness": 2.0}}}
    assert report.ratio_rows(r) == [("P8 slow-env trained episodes/s, continuous_k2 / sync", 1.75, 2.5, True)]
    block = report.render(r, asset_prefix="")
    assert "### P8: synchronous, one-step-off and asynchronous training" in block
    assert "| continuous_k2 | 4.00 | 28.00 | 7.00 | 1.75 | 180.00 | 1.80 | 2.00 |" in block


def test_p8_one_rank_runs_are_held_to_the_faster_synchronous_run():
    run = {"step_s": 1.0, "episodes_per_step": 32.0, "max_staleness": 0.0}
    out = p8_speedups({"sync": {**run, "episodes_per_s": 4.0, "trained_tokens_per_s": 100.0},
                       "sync_one_rank": {**run, "episodes_per_s": 5.0, "trained_tokens_per_s": 120.0},
                       "group_k2_one_rank": {**run, "episodes_per_s": 12.0, "trained_tokens_per_s": 300.0}})
    assert out["group_k2_one_rank"]["episodes_speedup"] == 3.0 and out["group_k2_one_rank"]["vs_best_sync"] == 2.4
    assert out["sync_one_rank"]["episodes_speedup"] == 1.25 and out["sync"]["vs_best_sync"] == 0.8
    r = {"meta": {"command": "python bench/run.py --only P8", "date": "2026-12-04 22:00", "steps": 16,
                  "loaded": False, "machine": {"cores": 2, "cpu": "x", "memory_gib": 24, "load_avg_1m": 0.1}},
         "P8": out}
    assert report.ratio_rows(r) == [
        ("P8 slow-env trained episodes/s, sync_one_rank / sync", 1.25, None, True),
        ("P8 slow-env trained episodes/s, group_k2_one_rank / sync", 3.0, None, True),
        ("P8 slow-env trained episodes/s, group_k2_one_rank / the faster synchronous run", 2.4, 2.5, True)]


def test_p9_runs_both_heads_on_the_tiny_model_and_the_chunked_one_keeps_less(tiny_model_path, tmp_path):
    """bench/log_prob_head.py for real, both variants (one process each), and P9's report of them."""
    import json
    import subprocess

    res = {}
    for variant in ("plain", "chunked"):
        out = tmp_path / f"{variant}.json"
        subprocess.run([sys.executable, str(Path(bench_run.__file__).with_name("log_prob_head.py")), "--model",
                        tiny_model_path, "--variant", variant, "--rows", "4", "--width", "64", "--repeats", "2",
                        "--out", str(out)], check=True, capture_output=True, text=True)
        res[variant] = json.loads(out.read_text())
    plain, chunked = res["plain"], res["chunked"]
    assert plain["scored_tokens"] == chunked["scored_tokens"] == 4 * 48
    # the plain head keeps the [N, V] float32 log-softmax (and its input) for the backward; the chunked one neither
    assert plain["saved_bytes"] - chunked["saved_bytes"] >= plain["scored_tokens"] * plain["vocab"] * 4
    # the head's own peak: the plain one holds at least two [N, V] float32 tensors at once, the chunked at most two
    assert plain["head_peak_bytes"] > chunked["head_peak_bytes"] >= plain["scored_tokens"] * plain["vocab"] * 4
    r = {"meta": {"command": "python bench/run.py --only P9", "date": "2026-12-03 17:00", "steps": 6,
                  "loaded": False, "machine": {"cores": 2, "cpu": "x", "memory_gib": 24, "load_avg_1m": 0.1}},
         "P9": {"tiny-qwen2": {"plain": plain, "chunked": chunked, "speedup": plain["seconds"] / chunked["seconds"],
                               "saved_ratio": chunked["saved_bytes"] / plain["saved_bytes"],
                               "head_peak_ratio": chunked["head_peak_bytes"] / plain["head_peak_bytes"],
                               "rss_growth_ratio": 1.0}}}
    assert [row[0] for row in report.ratio_rows(r)] == [
        "P9 log-prob head, bytes kept for the backward, chunked / plain (tiny-qwen2)",
        "P9 log-prob head, peak bytes of the head, chunked / plain (tiny-qwen2)"]
    assert "### P9: the log-prob head, plain against chunked" in report.render(r, asset_prefix="")
