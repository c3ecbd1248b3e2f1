"""The coding sandbox: real subprocesses running hostile programs, each reward 0 in time, the host unaffected."""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from agent_trainer.trajectory_rewards import (
    FinishedTrajectory,
    GroundTruth,
    RewardComputationConfig,
    SandboxLimits,
    make_reward_computer,
    run_python,
)
from agent_trainer.trajectory_rewards.sandbox import SANDBOX_UID_BASE, SANDBOX_UIDS, isolation

REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1, mem_mb=256, max_output_bytes=64 * 1024)
"""For the programs a deadline must stop."""
ROOMY = dataclasses.replace(LIMITS, wall_s=30.0)
"""For every other program: the same limits but the wall time, which a loaded machine stretches (the interpreter's
start alone has taken more than 2 s there), so that only the limit a test is about can stop its program."""
HANG_S = 120
"""A sandbox whose deadline did not fire hangs the test: pytest-timeout fails it after this long. The deadline
itself is checked by what load cannot fake (the limit named in the result, the CPU seconds the program got),
never by the wall time a loaded machine stretches (2 s programs took 9 s beside a benchmark)."""
CPU_SLACK_S = 0.5
"""CPU seconds past ``cpu_s`` a program may get before the kernel's SIGXCPU lands."""


def children_cpu_s() -> float:
    """CPU seconds of this process's reaped children (the sandboxed programs once run_python has waited)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sandbox_processes() -> list[psutil.Process]:
    """Processes under this test process, and those running under a sandbox uid whose parent is one of them or is
    gone (an orphan: a fork bomb's children); compare with a set taken before a run: earlier tests in the session
    may leave long-lived helpers, e.g. multiprocessing's resource tracker. Another test process's sandboxes (a
    parallel test worker's) are not this one's."""
    leftovers = psutil.Process().children(recursive=True)
    mine = {p.pid for p in leftovers} | {os.getpid()}
    for p in psutil.process_iter(["uids", "ppid"]):
        uids, parent = p.info["uids"], p.info["ppid"]
        if uids and SANDBOX_UID_BASE <= uids.real < SANDBOX_UID_BASE + SANDBOX_UIDS and p.pid not in mine and (
                parent in mine or parent <= 1 or not psutil.pid_exists(parent)):
            leftovers.append(p)
    return leftovers


@pytest.fixture(scope="module")
def coding():
    return make_reward_computer(RewardComputationConfig(domain="coding", sandbox=ROOMY))


def reward_of(coding, program: str, tests: str):
    traj = FinishedTrajectory("q", [f"<answer>```python\n{program}\n```</answer>"], max_context_length=100,
                              ground_truth=GroundTruth(tests=tests))
    return coding.compute(traj)


def test_a_correct_program_passes_and_wrong_or_evasive_ones_do_not():
    ok = run_python("def f(x):\n    return x + 1\nprint('hi')", "assert f(1) == 2", limits=ROOMY)
    assert ok.passed and ok.exit_code == 0 and ok.stdout_tail == "hi\n" and not ok.timed_out
    assert ok.isolation in ("netns", "userns", "sockets")
    wrong = run_python("def f(x):\n    return x", "assert f(1) == 2", limits=ROOMY)
    assert not wrong.passed and wrong.exit_code == 1 and "AssertionError" in wrong.stderr_tail
    # sys.exit(0) does not skip the tests; os._exit(0) before them is not a pass
    exits = run_python("import sys\nsys.exit(0)\ndef f(x):\n    return x + 1", "assert f(1) == 2", limits=ROOMY)
    assert not exits.passed and "NameError" in exits.stderr_tail
    hard_exit = run_python("import os\nos._exit(0)", "assert False", limits=ROOMY)
    assert not hard_exit.passed and hard_exit.exit_code == 0
    echo = run_python("print(int(input()) * 2)", stdin="21\n", limits=ROOMY)
    assert echo.passed and echo.stdout_tail == "42\n"


HOSTILE = {
    "infinite loop": ("while True:\n    pass", "timed out", LIMITS),
    "sleeping forever": ("import time\nwhile True:\n    time.sleep(1)", "timed out", LIMITS),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n        os.setsid()\n"
                  "    except OSError:\n        pass", "timed out", LIMITS),
    "10 GB allocation": ("x = bytearray(10 * 1024 ** 3)", "failed", ROOMY),
    "huge print": ("while True:\n    print('x' * 100000)", "output limit exceeded", ROOMY),
}


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_programs_get_reward_0_in_time_and_leave_the_host_alone(name):
    program, reason, limits = HOSTILE[name]
    coding = make_reward_computer(RewardComputationConfig(domain="coding", sandbox=limits))
    present_before = {p.pid for p in sandbox_processes()}
    rss_before = psutil.Process().memory_info().rss
    cpu_before = children_cpu_s()
    result = reward_of(coding, program, "assert True")
    assert result.reward == 0.0 and not result.correct and result.format_ok
    assert reason in result.reason, result.reason  # stopped by the limit it broke (a hang fails at HANG_S)
    if name != "fork bomb":  # its children are reaped by init, not counted here
        assert children_cpu_s() - cpu_before < LIMITS.cpu_s + CPU_SLACK_S
    leftovers = [p for p in sandbox_processes() if p.pid not in present_before]
    assert leftovers == []  # the fork bomb's children died with the run
    assert psutil.Process().memory_info().rss - rss_before < 64 * 1024 * 1024


@pytest.mark.timeout(HANG_S)
def test_the_raw_results_say_which_limit_stopped_the_program():
    mem = run_python("x = bytearray(10 * 1024 ** 3)", limits=ROOMY)
    assert "MemoryError" in mem.stderr_tail and not mem.timed_out
    loop = run_python("while True:\n    pass", limits=LIMITS)
    # a busy loop is stopped by a limit, and not before it has had its CPU second (load only makes that later)
    assert loop.timed_out and loop.seconds >= LIMITS.cpu_s
    printer = run_python("while True:\n    print('x' * 100000)", limits=ROOMY)
    assert printer.output_exceeded and len(printer.stdout_tail.encode()) <= LIMITS.max_output_bytes


def test_a_network_connect_fails_and_nothing_reaches_the_host(coding):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    received: list[bytes] = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            received.append(conn.recv(16))
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    program = ("import socket\ntry:\n"
               f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n"
               "    connected = True\nexcept OSError:\n    connected = False")
    try:
        result = reward_of(coding, program, "assert connected")
        socket.create_connection(("127.0.0.1", port), timeout=1).sendall(b"control")  # the server does listen
        deadline = time.monotonic() + 2
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert result.reward == 0.0 and "failed" in result.reason
    assert received == [b"control"]  # only the host's own connection arrived


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root host drops the program to an unprivileged uid")
def test_as_root_the_program_cannot_write_outside_its_directory(tmp_path):
    assert isolation().drop_root
    target = tmp_path / "owned_by_root.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", limits=ROOMY)
    assert not result.passed and "PermissionError" in result.stderr_tail and not target.exists()
    local = run_python("open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())", limits=ROOMY)
    assert local.passed and local.stdout_tail == "x\n"


def test_with_namespaces_the_program_sees_only_its_own_processes():
    if isolation().mode == "sockets":
        pytest.skip("no namespaces on this host: the socket-blocking fallback is in use")
    result = run_python("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", limits=ROOMY)
    assert result.passed and result.stdout_tail == "[1, 2]\n"  # the launcher (init) and the program


RUN_ONE = """import sys
from agent_trainer.trajectory_rewards.sandbox import run_python
result = run_python(sys.argv[1], wall_s=60.0, cpu_s=5)
print(result.passed, result.exit_code, result.stderr_tail[-300:].replace(chr(10), ' '), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root host drops the program to an unprivileged uid")
def test_runs_of_two_processes_at_once_never_kill_each_others_programs():
    """Each process that computes rewards (env actors, reward workers, test workers) starts sandboxes of its own,
    and a run that ends kills whatever is left under its uid: a uid two processes' runs shared would let the first
    to end kill the other's program. Process B's program runs until the test says; process A runs a whole program
    meanwhile; B's program must still pass."""
    signals = Path(tempfile.mkdtemp(prefix="sandbox-pair-"))
    signals.chmod(0o777)  # the programs run as unprivileged uids
    started, done = signals / "started", signals / "done"
    waiting = (f"import os, time\nopen({str(started)!r}, 'w').close()\ndeadline = time.monotonic() + 45\n"
               f"while not os.path.exists({str(done)!r}) and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
               f"assert os.path.exists({str(done)!r})")
    b = subprocess.Popen([sys.executable, "-c", RUN_ONE, waiting], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 120  # a hang guard: the start of B's sandbox, however loaded the machine
        while not started.exists():
            assert b.poll() is None and time.monotonic() < deadline, b.stdout.read()
            time.sleep(0.05)
        a = subprocess.run([sys.executable, "-c", RUN_ONE, "print(1)"], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
        assert a.stdout.startswith("True 0"), a.stdout + a.stderr
        done.touch()
        out, _ = b.communicate(timeout=120)
    finally:
        if b.poll() is None:
            b.kill()
        shutil.rmtree(signals, ignore_errors=True)
    assert out.startswith("True 0"), out  # not killed by A's end
