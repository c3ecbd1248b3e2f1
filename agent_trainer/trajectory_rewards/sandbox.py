"""Run an untrusted Python program against tests in a locked-down subprocess.

``run_python(code, tests)`` never executes the code in the calling process. It
writes the program and the tests into a fresh temporary directory and starts
``_sandbox_child.py`` (a trusted launcher, stdlib only) under an isolated
interpreter (``python -I -S``: no environment variables, no user or site
packages, stdlib only), with:

- no network: new network, PID and mount namespaces (``unshare --net --pid
  --fork --kill-child --mount-proc``, util-linux: no interface but a downed
  loopback, and a /proc that shows only the sandbox's own processes) when the
  kernel allows it (as root, or through an unprivileged user namespace);
  otherwise every socket constructor raises inside the child (a weaker
  fallback, reported as ``isolation="sockets"``);
- as root, a per-run unprivileged uid (so ``RLIMIT_NPROC`` is enforced, which
  root ignores, and project files are read-only to the program), leased for the
  run under a host-wide lock: no two runs share one, whichever processes of the
  host (reward workers, env actors, test workers) start them;
- ``RLIMIT_CPU``, ``RLIMIT_AS`` (memory), ``RLIMIT_NPROC`` (fork bombs),
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` set by the launcher just before the
  program runs (not in ``preexec_fn``, which is unsafe in the threaded trainer
  and would run before ``unshare``);
- a wall-clock deadline after which the whole process group is killed
  (``start_new_session=True``, ``os.killpg``); with a PID namespace, processes
  that left the group die with the namespace;
- stdout and stderr read in chunks, and the run killed once either passes
  ``max_output_bytes`` (a huge print never fills the trainer's memory).

A program passes only when its tests ran to the end (the launcher then writes
a per-run nonce the program never sees); a timeout, a crash, a limit or an
exit before the tests is ``passed=False``, never an exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent_trainer.config.rewards import SandboxLimits

CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
UNSHARE = ("unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
SANDBOX_UID_BASE = 1_500_000
SANDBOX_UIDS = 4096
"""As root, each run leases one of the uids SANDBOX_UID_BASE .. + SANDBOX_UIDS - 1 (ids no account uses)."""
UID_LOCKS = Path(tempfile.gettempdir()) / "agent-trainer-sandbox-uids"
"""One lock file per leased uid (root's, mode 700): held with ``flock`` for the whole run, released by the kernel
when the holder dies."""
_TAIL_GRACE_S = 0.5
"""After the launcher exits, how long to wait for the pipes to close before killing the group."""


@dataclass
class SandboxResult:
    """What one sandboxed run did."""

    passed: bool
    """The program and its tests ran to the end without an exception."""
    timed_out: bool
    """Killed by the wall-clock deadline or the CPU-time limit."""
    exit_code: int | None
    """The program's exit status (negative: killed by that signal; None: no status reported)."""
    stdout_tail: str
    """The last ``max_output_bytes`` of stdout (the whole of it when it fits)."""
    stderr_tail: str
    seconds: float
    output_exceeded: bool = False
    """Killed because stdout or stderr passed ``max_output_bytes``."""
    isolation: str = ""
    """How the network was cut: "netns" (root), "userns" (unprivileged namespace) or "sockets" (fallback)."""


@dataclass(frozen=True)
class Isolation:
    """How this host runs sandboxes (probed once per interpreter)."""

    mode: str
    prefix: tuple[str, ...]
    """Command in front of the interpreter (unshare ...), or empty."""
    drop_root: bool
    """Run the program under a per-run unprivileged uid."""
    python: str


def run_python(code: str, tests: str = "", *, stdin: str = "", limits: SandboxLimits | None = None,
               python: str | None = None, **limit_overrides) -> SandboxResult:
    """Run ``code`` then ``tests`` (Python source, e.g. assert lines) in a fresh sandbox.

    ``stdin`` is fed to the program. Limits come from ``limits`` and keyword
    overrides (``wall_s``, ``cpu_s``, ``mem_mb``, ``max_output_bytes``, ...).
    ``python`` picks the interpreter; by default the first of this process's
    interpreter and the system ``python3`` that can run as the sandbox user.
    """
    limits = dataclasses.replace(limits or SandboxLimits(), **limit_overrides)
    iso = isolation(python)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sandbox-", ignore_cleanup_errors=True) as workdir:
        try:
            result = _run_in(Path(workdir), iso, code, tests, stdin, limits)
        except OSError as exc:  # could not even start (e.g. the host is out of processes): a failed run
            result = SandboxResult(False, False, None, "", f"sandbox could not start: {exc}", 0.0)
    result.seconds = time.monotonic() - start
    result.isolation = iso.mode
    return result


def _run_in(workdir: Path, iso: Isolation, code: str, tests: str, stdin: str, limits: SandboxLimits) -> SandboxResult:
    nonce = secrets.token_hex(16)
    for name, text in ((".nonce", nonce), ("solution.py", code), ("tests.py", tests), (".stdin", stdin)):
        (workdir / name).write_text(text, encoding="utf-8")
    with _leased_uid(iso.drop_root) as uid:
        return _run_as(workdir, iso, uid, nonce, limits)


def _run_as(workdir: Path, iso: Isolation, uid: int, nonce: str, limits: SandboxLimits) -> SandboxResult:
    if uid >= 0:
        os.chown(workdir, uid, uid)  # the program's cwd; the launcher reads and deletes the files before dropping root
        os.chmod(workdir, 0o700)
    read_fd, write_fd = os.pipe()
    settings = {"uid": uid, "block_sockets": iso.mode == "sockets", "result_fd": write_fd,
                "cpu_s": int(limits.cpu_s), "mem_mb": int(limits.mem_mb), "max_procs": int(limits.max_procs),
                "max_file_mb": int(limits.max_file_mb), "max_open_files": int(limits.max_open_files)}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "HOME": str(workdir)}
    try:
        with open(workdir / ".stdin", "rb") as stdin_file:
            proc = subprocess.Popen([*iso.prefix, iso.python, "-I", "-S", CHILD, json.dumps(settings)],
                                    cwd=workdir, env=env, stdin=stdin_file, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
    finally:
        os.close(write_fd)
    (workdir / ".stdin").unlink()
    try:
        outputs, wall_hit, exceeded = _collect(proc, read_fd, time.monotonic() + limits.wall_s,
                                               int(limits.max_output_bytes))
    finally:
        _kill_group(proc, uid)
        os.close(read_fd)
    lines = outputs["result"].decode(errors="replace").splitlines()
    exits = [line[len("exit "):] for line in lines if line.startswith("exit ")]
    exit_code = int(exits[-1]) if exits and exits[-1].lstrip("-").isdigit() else None
    passed = f"pass {nonce}" in lines and not exceeded and not wall_hit
    timed_out = wall_hit or (exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not exceeded)
    return SandboxResult(passed=passed, timed_out=timed_out, exit_code=exit_code,
                         stdout_tail=outputs["stdout"].decode(errors="replace"),
                         stderr_tail=outputs["stderr"].decode(errors="replace"), seconds=0.0,
                         output_exceeded=exceeded)


@contextlib.contextmanager
def _leased_uid(drop_root: bool):
    """A sandbox uid no other run on this host holds while the block runs (-1 when root is not dropped).

    Every run kills whatever is left under its uid when it ends, so two runs sharing one would kill each other's
    programs: the lease is an exclusive ``flock`` on the uid's lock file, tried from a random uid on."""
    if not drop_root:
        yield -1
        return
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    first = secrets.randbelow(SANDBOX_UIDS)
    for i in range(SANDBOX_UIDS):
        uid = SANDBOX_UID_BASE + (first + i) % SANDBOX_UIDS
        fd = os.open(UID_LOCKS / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)  # releases the lock
        return
    raise OSError(f"all {SANDBOX_UIDS} sandbox uids are in use on this host")


def _collect(proc: subprocess.Popen, result_fd: int, deadline: float, cap: int) -> tuple[dict[str, bytes], bool, bool]:
    """Read stdout, stderr and the result pipe until they close, the deadline, or a stream passes ``cap``.

    Returns (bytes per stream, wall deadline hit, output cap exceeded). Each
    buffer is trimmed to its last ``cap`` bytes, so memory stays bounded.
    """
    bufs = {"stdout": bytearray(), "stderr": bytearray(), "result": bytearray()}
    sel = selectors.DefaultSelector()
    for name, fd in (("stdout", proc.stdout.fileno()), ("stderr", proc.stderr.fileno()), ("result", result_fd)):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, name)
    wall_hit = exceeded = False
    exited_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                wall_hit = True
                break
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > _TAIL_GRACE_S:
                break  # something outside a PID namespace still holds a pipe open
            for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.data]
                buf += chunk
                if len(buf) > cap:
                    del buf[:-cap]
                    exceeded = key.data != "result"
            if exceeded:
                break
    finally:
        sel.close()
    return {k: bytes(v) for k, v in bufs.items()}, wall_hit, exceeded


def _has_exited(pid: int) -> bool:
    """True once ``pid`` has exited, without reaping it (so its process-group id cannot be reused yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen, uid: int) -> None:
    """SIGKILL the run (its process group, then anything left under its per-run uid) and wait until it is gone.

    Behind ``unshare`` the namespace's init (the leader's child) is killed
    first, so ``unshare`` reaps it (killing ``unshare`` first would leave the
    init to the host's init to reap); the kernel kills every process in the
    namespace before its init is gone. Then the group (started with
    start_new_session: pgid = the leader's pid, which the kernel does not reuse
    while it names a live group) is killed and the leader reaped.
    """
    for child in _children(proc.pid):
        _signal(os.kill, child)
    try:
        proc.wait(timeout=_TAIL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal(os.killpg, proc.pid)
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    deadline = time.monotonic() + _TAIL_GRACE_S * 4
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.01)
    if uid >= 0:
        while _kill_uid(uid) and time.monotonic() < deadline:
            time.sleep(0.01)


def _signal(kill, pid: int) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc/<pid>/stat)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    stat = fh.read()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is ``uid`` (a per-run sandbox uid); returns how many were found."""
    found = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as fh:
                real_uid = next(int(line.split()[1]) for line in fh if line.startswith("Uid:"))
            if real_uid == uid:
                found += 1
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, StopIteration, ValueError):
            continue
    return found


# --------------------------------------------------------------------------- host probe


@functools.lru_cache(maxsize=8)
def isolation(python: str | None = None) -> Isolation:
    """The strongest isolation this host supports, and an interpreter that runs under it (probed once).

    As root: network + PID namespaces with root dropped, else blocked sockets
    with root dropped (a user namespace is not tried: it would map the program
    to the real root). Otherwise: an unprivileged user namespace, else blocked
    sockets. Interpreters tried: ``python``, or this process's interpreter and
    the ``python3`` of /usr/local/bin, /usr/bin, /bin (an interpreter whose
    stdlib lives under a directory only root can read cannot run as the
    dropped uid).
    """
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    candidates = [python] if python else list(dict.fromkeys(p for p in (sys.executable, system) if p))
    root = os.geteuid() == 0
    unshare = shutil.which("unshare") is not None
    if root:
        modes = [("netns", UNSHARE, True)] if unshare else []
    else:
        modes = [("userns", ("unshare", "--user", "--map-root-user", *UNSHARE[1:]), False)] if unshare else []
    modes.append(("sockets", (), root))
    for mode, prefix, drop_root in modes:
        for exe in candidates:
            iso = Isolation(mode=mode, prefix=prefix, drop_root=drop_root, python=exe)
            if _probe(iso):
                return iso
    raise RuntimeError(f"no interpreter among {candidates} could run the coding sandbox (as root it must be readable "
                       "by an unprivileged uid); set the sandbox interpreter to a system python3")


def _probe(iso: Isolation) -> bool:
    """Can the launcher run a stdlib import under ``iso``? (An interpreter under /root fails once root is dropped.)"""
    with tempfile.TemporaryDirectory(prefix="sandbox-probe-", ignore_cleanup_errors=True) as workdir:
        try:
            result = _run_in(Path(workdir), iso, "import json, math, collections", "", "", SandboxLimits(wall_s=10))
        except OSError:
            return False
    return result.passed
