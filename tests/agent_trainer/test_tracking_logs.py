"""Worker logs: every line into the run's workers.log, each distinct warning once on the console."""

from __future__ import annotations

from agent_trainer.run_logs import WorkerLogRouter, dedup_key

STEP_LINES = [
    "\x1b[36m(VLLMRolloutWorker pid=28804)\x1b[0m (MainProcess pid=28804) INFO 11-22 10:38:{s:02d} [inplace.py:91] "
    "Reloading weights inplace...",
    "(MainProcess pid=28804) WARNING 11-22 10:38:{s:02d} [layerwise.py:266] RotaryEmbedding: Failed to load weights",
    "(MainProcess pid=28804) INFO 11-22 10:38:{s:02d} [inplace.py:113] Reloading and processing weights took 0.0{s} "
    "seconds",
    "(MainProcess pid=28804) INFO 11-22 10:38:{s:02d} [block_pool.py:861] Successfully reset prefix cache",
]


def test_info_lines_go_to_the_file_and_a_repeated_warning_reaches_the_console_once(tmp_path):
    session = tmp_path / "session_logs"
    session.mkdir()
    shown: list[str] = []
    router = WorkerLogRouter(session, tmp_path / "run" / "logs" / "workers.log", echo=shown.append)
    out = session / "worker-abc-01000000-28804.err"
    for step in range(3):  # three training steps, each printing the four lines
        with out.open("a") as f:
            f.write("".join(line.format(s=step) + "\n" for line in STEP_LINES))
            f.write("Traceback (most recent call" if step == 2 else "")  # an incomplete line waits
        router.poll()
    assert len(shown) == 1 and "RotaryEmbedding: Failed to load weights" in shown[0]
    written = (tmp_path / "run" / "logs" / "workers.log").read_text().splitlines()
    assert len(written) == 12 and sum("Successfully reset prefix cache" in line for line in written) == 3
    assert all(line.startswith(f"[{out.name}] ") and "\x1b" not in line for line in written)
    with out.open("a") as f:
        f.write(" last):\nValueError: boom\n")
    router.poll()
    assert shown[1:] == ["(worker) Traceback (most recent call last):", "(worker) ValueError: boom"]


def test_dedup_ignores_times_pids_and_addresses():
    assert dedup_key("WARNING 11-22 10:38:41 pid=1 at 0x7f00") == dedup_key("WARNING 11-23 09:01:02 pid=99 at 0xab")
    assert dedup_key("WARNING a") != dedup_key("WARNING b")
