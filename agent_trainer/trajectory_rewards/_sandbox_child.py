"""The trusted launcher that runs inside the sandbox (started by ``sandbox.run_python``; never imported).

Runs as ``python -I -S _sandbox_child.py '<json settings>'`` in a fresh temporary
directory, usually as PID 1 of new network and PID namespaces. It forks:

- the child sets the resource limits, reads the program, the tests and the
  per-run nonce, deletes their files, drops root (to a per-run uid) when asked,
  blocks sockets when no network namespace could be made, then executes the
  program and the tests in one namespace. Only when both ran to the end does it
  write ``pass <nonce>`` to the result fd: ``sys.exit(0)`` inside the program
  does not skip the tests, and ``os._exit(0)`` never counts as a pass.
- the parent waits, writes ``exit <code>`` (negative = killed by that signal)
  and exits; as PID 1 of the namespace its exit kills every process left in it.

Running the program in a fork instead of in PID 1 itself keeps ordinary signal
semantics (the kernel shields a namespace's init from signals it has no handler
for, which would blunt the CPU-time limit). This file imports only the stdlib.
"""

import json
import os
import resource
import sys


def _set_limits(s: dict) -> None:
    """Hard = soft, so the program cannot raise them again."""
    mib = 1024 * 1024
    for name, value in (("RLIMIT_CPU", s["cpu_s"]), ("RLIMIT_AS", s["mem_mb"] * mib),
                        ("RLIMIT_NPROC", s["max_procs"]), ("RLIMIT_FSIZE", s["max_file_mb"] * mib),
                        ("RLIMIT_NOFILE", s["max_open_files"]), ("RLIMIT_CORE", 0)):
        hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at the soft limit, SIGKILL one second later
        resource.setrlimit(getattr(resource, name), (value, hard))


def _block_sockets() -> None:
    """Fallback when no network namespace exists: every new socket raises (a ctypes caller could still bypass it)."""
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    socket.socket = _socket.socket = socket.create_connection = refuse  # type: ignore[assignment,misc]


def _read_and_delete(name: str) -> str:
    with open(name, encoding="utf-8") as fh:
        text = fh.read()
    os.unlink(name)
    return text


def _run_program(s: dict) -> None:
    nonce = _read_and_delete(".nonce")
    program = _read_and_delete("solution.py")
    tests = _read_and_delete("tests.py")
    _set_limits(s)
    if s["uid"] >= 0:
        os.setgroups([])
        os.setgid(s["uid"])
        os.setuid(s["uid"])
    if s["block_sockets"]:
        _block_sockets()
    fd = s["result_fd"]
    sys.argv = ["solution.py"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    del s
    try:
        exec(compile(program, "solution.py", "exec"), namespace)  # the sandboxed program: this process only
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    exec(compile(tests, "tests.py", "exec"), namespace)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(fd, f"pass {nonce}\n".encode())
    os._exit(0)  # do not wait for threads the program left running


def main() -> None:
    settings = json.loads(sys.argv[1])
    os.set_inheritable(settings["result_fd"], False)
    pid = os.fork()
    if pid == 0:
        _run_program(settings)
        return
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os.write(settings["result_fd"], f"exit {code}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
