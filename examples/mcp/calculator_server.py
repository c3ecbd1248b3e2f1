"""A calculator as an MCP server, written with the ``mcp`` SDK's server (``MCPServer``): the tools a tool-calling agent
takes from it (config/countdown_mcp_tools.yaml, docs/agents.md "MCP tools").

    python examples/mcp/calculator_server.py                       # stdio: the run starts it (its command)
    CALCULATOR_KEY=<a secret> python examples/mcp/calculator_server.py --http --port 8765
                                                                   # streamable HTTP on http://127.0.0.1:8765/mcp

Over HTTP it listens on 127.0.0.1 unless ``--host`` says otherwise and answers only requests that send the key
(``Authorization: Bearer <key>``) from the environment variable ``--key-env`` names (the key is never printed).
"""

from __future__ import annotations

import argparse
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("calculator", instructions="Arithmetic on two numbers.", log_level="WARNING")


@server.tool()
def add(a: float, b: float) -> float:
    """a + b."""
    return a + b


@server.tool()
def subtract(a: float, b: float) -> float:
    """a - b."""
    return a - b


@server.tool()
def multiply(a: float, b: float) -> float:
    """a * b."""
    return a * b


@server.tool()
def divide(a: float, b: float) -> float:
    """a / b (b must not be 0)."""
    if b == 0:
        raise ToolError("division by zero")  # an answer the policy reads, not a crash
    return a / b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A calculator MCP server (stdio, or streamable HTTP with --http).")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP at /mcp instead of stdio")
    p.add_argument("--host", default="127.0.0.1", help="HTTP: the address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="HTTP: the port (default 8765)")
    p.add_argument("--key-env", default="CALCULATOR_KEY", metavar="NAME",
                   help="HTTP: the environment variable holding the key clients must send (default CALCULATOR_KEY)")
    args = p.parse_args(argv)
    if not args.http:
        server.run("stdio")
        return 0
    key = os.environ.get(args.key_env, "")
    if not key:
        print(f"calculator_server: --key-env names {args.key_env}, which is not set; set it to the key the clients "
              "send (their api_key_env names the variable holding it)", file=sys.stderr)
        return 1
    import uvicorn

    from agent_trainer.serve_env import KeyCheck

    app = KeyCheck(server.streamable_http_app(host=args.host), key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
