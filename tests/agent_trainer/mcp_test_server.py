"""An MCP server for the tests (stdio), written with the ``mcp`` SDK's ``MCPServer``: ``lookup(key)`` answers from a
small table, ``hang()`` never answers. With ``MCP_TEST_CALLS_FILE`` set, every ``lookup`` call adds a line to that
file, and the call that makes it ``MCP_TEST_CRASH_AT`` lines long kills the server (SIGKILL, mid-call), as a crash
would: the tests' server that dies mid-run.
"""

from __future__ import annotations

import os
import signal
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("lookup", log_level="WARNING")
TABLE = {"ice": "frozen water", "hole": "a place to fall into", "goal": "where the present is"}


@server.tool()
def lookup(key: str) -> str:
    """What a word means on the frozen lake."""
    calls_file = os.environ.get("MCP_TEST_CALLS_FILE")
    if calls_file:
        with open(calls_file, "a") as f:
            f.write(f"{key}\n")
        with open(calls_file) as f:
            calls = len(f.read().splitlines())
        if calls == int(os.environ.get("MCP_TEST_CRASH_AT", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
    return TABLE.get(key, f"no entry for {key!r}")


@server.tool()
def hang() -> str:
    """Never answers."""
    time.sleep(3600)
    return "late"


if __name__ == "__main__":
    server.run("stdio")
