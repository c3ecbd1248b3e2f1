"""Tools from MCP servers for the tool-calling agent (``agent_proxy.mcp_servers``; docs/agents.md, "MCP tools").

A :class:`McpToolbox` holds one client (the ``mcp`` SDK's ``Client``) per configured server, over stdio (the run
starts the server's ``command`` and talks over its stdin/stdout) or streamable HTTP (``url``; the key from the
environment variable ``api_key_env`` names, sent as ``Authorization: Bearer``, never logged). It lists the servers'
tools in the chat template's ``tools=`` format (:func:`tool_schema`) and calls them by name
(:meth:`McpToolbox.call`), each call bounded by the server's ``call_timeout_s``, and returns a
:class:`ToolCallRecord` (name, arguments, result or error, latency) for the trajectory.

A tool that answers with an error (``is_error``, or the server refusing the arguments) is an answer: the policy
reads it and the episode goes on. A server that cannot be reached, dies or does not answer in time raises
:class:`~envs.base.ServiceError`: the agent ends that episode as a service failure (counted in
``<prefix>/service_failures``, left out of training and of its group's statistics, like an env service's), and the
next call connects afresh (a stdio server is started again).

The SDK is asynchronous; the agent runs in the driver's rollout thread. The clients live on one event loop in a
daemon thread of their own (:class:`_LoopThread`), and the synchronous calls wait on it. Toolboxes are shared per
server list within a process (:func:`shared_toolbox`): the train and validation agents use the same servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import sys
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from agent_trainer.episode.es_manager import clean_text
from envs.base import ServiceError

if TYPE_CHECKING:
    from agent_trainer.config import McpServerConfig

logger = logging.getLogger(__name__)

RESERVED_NAMES = ("move", "act")
"""The tools the agent derives from the env's actions (``agents.tool_call.env_tools``): no MCP tool may take them."""


@dataclass
class ToolCallRecord:
    """One call of an MCP tool, as the trajectory records it (``EnvTurn.tool_calls``) and the viewer shows it."""

    server: str
    name: str
    arguments: dict
    result: str = ""
    """The tool's answer as the policy reads it (its text content, cut to ``max_result_chars``)."""
    error: str = ""
    """The tool's error (``is_error``), or why the call failed; empty when it answered."""
    latency_s: float = 0.0
    service_failure: bool = False
    """The server failed (unreachable, died, no answer within ``call_timeout_s``): the episode ends here."""

    def message(self) -> dict:
        """The ``tool`` chat message that shows the policy the call's outcome."""
        text = f"{self.name}: {self.result}" if not self.error else f"{self.name} error: {self.error}"
        return {"role": "tool", "content": text}

    def as_dict(self) -> dict:
        return asdict(self)


def tool_schema(name: str, description: str | None, input_schema: dict | None) -> dict:
    """An MCP tool in the OpenAI / Hugging Face ``tools=`` format (``apply_chat_template(tools=...)``)."""
    parameters = dict(input_schema or {})
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters}}


def result_text(result: Any, max_chars: int) -> str:
    """A ``CallToolResult``'s content as text: the text blocks joined, other blocks by their type, the structured
    content as JSON when there is no text; cut to ``max_chars`` (untrusted: made safe to tokenize)."""
    parts = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    if not any(parts) and getattr(result, "structured_content", None) is not None:
        parts = [json.dumps(result.structured_content, default=str)]
    return clean_text("\n".join(parts), max_chars)


class _LoopThread:
    """An asyncio event loop running in a daemon thread; :meth:`run` waits for a coroutine from any thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-tools", daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float):
        """The coroutine's result; raises what it raised, or TimeoutError after ``timeout_s`` (a last guard: the
        coroutines bound their own waits)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None


class McpToolServer:
    """One MCP server: a client connected on first use (and again after a failure), its tools, its calls."""

    def __init__(self, config: McpServerConfig, loop: _LoopThread):
        self.config = config
        self._loop = loop
        self._client = None
        self._stop: asyncio.Event | None = None
        self._holder: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def where(self) -> str:
        """The server as a message names it: its command or its URL (never a key)."""
        c = self.config
        return f"stdio command {' '.join(c.command)!r}" if c.command else f"url {c.url}"

    # -- sync API (the agent's thread) -------------------------------------------------------------
    def list_tools(self) -> list[dict]:
        """The server's tools (``config.tools`` of them, when set) in the ``tools=`` format; raises ServiceError."""
        tools = self._run(self._list_tools(), self.config.connect_timeout_s * 2 + 5)
        schemas = [tool_schema(t.name, t.description, t.input_schema) for t in tools]
        if self.config.tools is not None:
            by_name = {s["function"]["name"]: s for s in schemas}
            missing = [n for n in self.config.tools if n not in by_name]
            if missing:
                raise ServiceError(f"lists no tool {missing} (it lists {sorted(by_name)})")
            schemas = [by_name[n] for n in self.config.tools]
        return schemas

    def call(self, name: str, arguments: dict) -> ToolCallRecord:
        """Call tool ``name``; a tool error is a record with ``error``. Raises ServiceError when the server failed
        (its connection is dropped, so the next call connects afresh)."""
        start = time.monotonic()
        record = ToolCallRecord(server=self.config.name, name=name, arguments=arguments)
        c = self.config
        try:
            result = self._run(self._call(name, arguments), c.connect_timeout_s + c.call_timeout_s + 5)
        except ServiceError:
            self.reset()
            raise
        record.latency_s = round(time.monotonic() - start, 4)
        if isinstance(result, str):  # the server refused the call (an MCP error answer)
            record.error = result
        elif getattr(result, "is_error", False):
            record.error = result_text(result, c.max_result_chars) or "the tool reported an error"
        else:
            record.result = result_text(result, c.max_result_chars)
        return record

    def reset(self) -> None:
        """Drop the connection (a stdio server is stopped); the next use connects afresh."""
        try:
            self._loop.run(self._close(), 15.0)
        except Exception as err:  # closing is best effort: the server may be gone already
            logger.debug("closing MCP server %s: %s", self.config.name, err)

    def close(self) -> None:
        self.reset()

    def _run(self, coro, timeout_s: float):
        try:
            return self._loop.run(coro, timeout_s)
        except ServiceError:
            raise
        except Exception as err:  # a lost connection, a dead process, a timeout: the server failed
            raise ServiceError(_reason(err)) from None

    # -- on the loop ---------------------------------------------------------------------------------
    async def _connected(self):
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None and self._holder is not None and not self._holder.done():
                return self._client
            await self._close_now()
            ready = asyncio.get_running_loop().create_future()
            self._stop = asyncio.Event()
            self._holder = asyncio.ensure_future(self._hold(ready, self._stop))
            try:
                client = await asyncio.wait_for(asyncio.shield(ready), self.config.connect_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):
                await self._close_now()
                raise ServiceError(f"did not answer within connect_timeout_s = {self.config.connect_timeout_s:g} s")
            if isinstance(client, ServiceError):  # the start failed (the holder handed over why)
                await self._close_now()
                raise client
            self._client = client
            return client

    async def _hold(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """Open the client and hold it until ``stop`` (the SDK's transports must be entered and left in one task)."""
        from mcp import Client

        client = None
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(Client(await self._transport(stack), cache=None))
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting call (a failed start) or dropped
            if not ready.done():
                ready.set_result(ServiceError(_reason(err)))
        finally:
            if self._client is client:  # not a newer connection's
                self._client = None

    async def _transport(self, stack: AsyncExitStack):
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        c = self.config
        if c.command:
            env = {name: os.environ[name] for name in c.env_vars if name in os.environ}
            program = sys.executable if c.command[0] in ("python", "python3") else c.command[0]  # the run's Python
            return stdio_client(StdioServerParameters(command=program, args=list(c.command[1:]), env=env or None),
                                errlog=sys.stderr)
        import httpx2
        from mcp.shared._httpx_utils import create_mcp_http_client

        headers = {"Authorization": f"Bearer {api_key(c)}"} if c.api_key_env else None
        http = await stack.enter_async_context(create_mcp_http_client(
            headers=headers, timeout=httpx2.Timeout(c.connect_timeout_s, read=c.call_timeout_s + 5)))
        return streamable_http_client(str(c.url), http_client=http)

    async def _list_tools(self) -> list:
        client = await self._connected()
        tools, cursor = [], None
        for _ in range(100):  # pages
            page = await asyncio.wait_for(client.list_tools(cursor=cursor), self.config.connect_timeout_s)
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                return tools
        raise ServiceError("lists more than 100 pages of tools")

    async def _call(self, name: str, arguments: dict):
        from mcp.shared.exceptions import MCPError
        from mcp_types.jsonrpc import CONNECTION_CLOSED, REQUEST_TIMEOUT

        client = await self._connected()
        try:
            return await asyncio.wait_for(client.call_tool(name, arguments), self.config.call_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise ServiceError(f"tool {name!r} did not answer within call_timeout_s = "
                               f"{self.config.call_timeout_s:g} s") from None
        except MCPError as err:
            if err.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):  # the connection is gone: the server failed
                raise ServiceError(f"tool {name!r}: {err.error.message}") from None
            return clean_text(err.error.message, self.config.max_result_chars)  # an answer (unknown tool, arguments)

    async def _close(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await self._close_now()

    async def _close_now(self) -> None:
        holder, self._holder, self._client = self._holder, None, None
        if holder is None or holder.done():
            return
        self._stop.set()
        try:
            await asyncio.wait_for(holder, 10.0)
        except BaseException:  # noqa: BLE001 - a transport that does not close in time is cancelled
            holder.cancel()


class McpToolbox:
    """The tools of several MCP servers under one set of names; :meth:`call` routes a call to its server."""

    def __init__(self, configs: list[McpServerConfig]):
        self._loop = _LoopThread()
        self.servers = [McpToolServer(c, self._loop) for c in configs]
        self.tools: list[dict] = []
        """Every server's tools in the ``tools=`` format, in server order (after :meth:`connect`)."""
        self._route: dict[str, McpToolServer] = {}

    @property
    def names(self) -> set[str]:
        return set(self._route)

    def connect(self) -> McpToolbox:
        """List every server's tools; raises ValueError naming the server on a failure or a clash of names."""
        for i, server in enumerate(self.servers):
            key = f"agent_proxy.mcp_servers[{i}] ({server.config.name!r}, {server.where})"
            try:
                tools = server.list_tools()
            except ServiceError as err:
                raise ValueError(f"{key}: {err}; start the server or fix its command / url (docs/agents.md, "
                                 "\"MCP tools\")") from None
            for tool in tools:
                name = tool["function"]["name"]
                if name in RESERVED_NAMES:
                    raise ValueError(f"{key} offers a tool named {name!r}, the name of the env's action tool; list "
                                     "the others in its tools key")
                if name in self._route:
                    raise ValueError(f"{key} offers a tool named {name!r}, as server {self._route[name].config.name!r} "
                                     "does; list one of them only in its server's tools key")
                self._route[name] = server
                self.tools.append(tool)
        return self

    def server_of(self, name: str) -> str:
        """The name of the server that offers tool ``name``."""
        return self._route[name].config.name

    def call(self, name: str, arguments: dict) -> ToolCallRecord:
        """Call a listed tool (raises ServiceError when its server failed)."""
        return self._route[name].call(name, arguments)

    def close(self) -> None:
        for server in self.servers:
            server.close()


_SHARED: dict[str, McpToolbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_toolbox(configs: list[McpServerConfig]) -> McpToolbox:
    """The connected toolbox of these servers in this process (one per server list: the train and validation
    agents share it); raises ValueError naming the server that fails."""
    key = json.dumps([asdict(c) if not isinstance(c, dict) else c for c in configs], sort_keys=True, default=str)
    with _SHARED_LOCK:
        if key not in _SHARED:
            box = McpToolbox(list(configs))
            try:
                _SHARED[key] = box.connect()
            except ValueError:
                box.close()
                raise
        return _SHARED[key]


def api_key(config: McpServerConfig) -> str:
    """The key from the environment variable ``api_key_env`` names; a variable that is not set raises ServiceError
    naming it (never the key)."""
    key = os.environ.get(str(config.api_key_env), "")
    if not key:
        raise ServiceError(f"api_key_env names {config.api_key_env}, which is not set in the driver's environment")
    return key


def _reason(err: BaseException) -> str:
    """An exception (an SDK exception group included) as one short line: its innermost causes."""
    leaves = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(err)
    text = "; ".join(f"{type(e).__name__}: {e}".rstrip(": ") for e in leaves[:3])
    return " ".join(text.split())[:500] or type(err).__name__
