"""The example MCP calculator (examples/mcp/calculator_server.py) served over streamable HTTP on 127.0.0.1 by a
process of its own, for the tests of MCP tools (tests/agent_trainer/test_mcp_tools.py, tests/e2e/test_mcp_e2e.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_calculator(log: Path, key: str, key_env: str = "CALCULATOR_KEY", start_timeout_s: float = 120.0
                    ) -> Iterator[str]:
    """Start the calculator checking ``key`` (read from ``key_env``); yield its URL once it answers, kill it after.
    What it prints goes to ``log``."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "examples/mcp/calculator_server.py", "--http", "--port", str(port),
                                 "--key-env", key_env], cwd=REPO,
                                env={**os.environ, key_env: key, "PYTHONPATH": str(REPO)},
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, f"the calculator did not answer within {start_timeout_s:g} s"
                time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)
