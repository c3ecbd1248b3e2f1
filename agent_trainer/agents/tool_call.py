"""The tool-calling agent (``agent_proxy.agent_cls=tool_call``): the env's actions as tools, replies as tool calls.

The first prompt is rendered by the chat template's own tool format (``apply_chat_template(...,
tools=...)``; Qwen2.5's template puts the JSON schemas in the system message), and the policy acts by
writing ``<tool_call>{"name": "move", "arguments": {"direction": "Up"}}</tool_call>``. Each later
observation comes back as a ``tool`` message (Qwen2.5 renders it as ``<tool_response>``). The tools
are derived from the env's action list (its ``action_description``, shown in the instruction as
``Valid actions: A | B | C``): four directions become ``move(direction)``, other discrete actions
``act(action)`` with an enum, free-text actions ``act(action: string)``.

With ``agent_proxy.mcp_servers`` the tools of those MCP servers are offered too (``agents.mcp_tools``): a
reply's calls of them run on their servers, in order, and their answers come back as ``tool`` messages before
the next turn; a reply with such calls and no env action is a tool turn (the env does not step). Each call is
recorded in the turn (``EnvTurn.tool_calls``); a server that fails ends the episode as a service failure.

A reply without a well-formed call (invalid JSON, an unknown tool, arguments that do not fit the
schema) has no action: the env charges ``es_manager.format_penalty`` and the turn counts in
``rollout/format_error_rate``, as a reply without ``<answer>`` does for the default agent. The reply
is untrusted text: it is parsed with ``json.loads`` only, never evaluated. Everything else (the
token-in/token-out sequence, rewards, the batch) is the default agent's (``ctx_manager``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from agent_trainer.common import prompts
from agent_trainer.agents.base import agent_options
from agent_trainer.agents.mcp_tools import McpToolbox, ToolCallRecord, shared_toolbox
from agent_trainer.agents.ctx_manager import ContextManager, EpisodeContext, EpisodeStatus, anchor_id
from agent_trainer.episode.es_manager import EnvInput, EnvOutput
from envs.base import ServiceError

if TYPE_CHECKING:
    from agent_trainer.config import AgentTrainerConfig

VALID_ACTIONS = "Valid actions: "
"""The instruction line (``es_manager``) that lists an env's actions (``BaseEnv.action_description``)."""
DIRECTIONS = ("Up", "Down", "Left", "Right")
MAX_CALL_CHARS = 2000
"""A tool call longer than this is refused unparsed (no valid call of these tools is that long)."""
TOOL_FORMAT = ("Act by calling exactly one tool: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.")
TOOL_CALL_TAG = "tool_call"
"""A call is written inside ``<tool_call>...</tool_call>`` (Qwen2.5's chat template names this tag)."""
MCP_TOOL_FORMAT = ("Call tools as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; their answers come "
                   "back before your next turn. Act in the environment with its tool (ENV_TOOL).")


def function_tool(name: str, description: str, parameter: str, choices: list[str] | None) -> dict:
    """One tool in the OpenAI / Hugging Face ``tools=`` format, with a single string parameter."""
    spec: dict = {"type": "string", "description": f"the {parameter}"}
    if choices:
        spec["enum"] = list(choices)
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: spec}, "required": [parameter]}}}


def tool_call_text(name: str, arguments: dict) -> str:
    """A call of tool ``name`` as the policy writes it and :func:`parse_tool_calls` reads it (demonstrations)."""
    return f"<{TOOL_CALL_TAG}>{json.dumps({'name': name, 'arguments': arguments})}</{TOOL_CALL_TAG}>"


def env_tools(instruction: str) -> list[dict]:
    """The tools of an env, from the ``Valid actions: A | B`` line of its instruction."""
    line = next((ln[len(VALID_ACTIONS):].strip() for ln in instruction.splitlines() if ln.startswith(VALID_ACTIONS)),
                "")
    names = [a.strip() for a in line.split("|")] if "|" in line else []
    if names and all(names) and all(len(n) <= 40 for n in names):
        if set(names) <= set(DIRECTIONS):
            return [function_tool("move", "Move one step in a direction.", "direction", names)]
        return [function_tool("act", "Take one of the environment's actions.", "action", names)]
    return [function_tool("act", f"Take an action ({line or 'free text'}).", "action", None)]


@dataclass
class ToolCall:
    """A reply's tool calls: the env actions, the calls of MCP tools, or why none could be used."""

    actions: list[str] = field(default_factory=list)
    calls: list[tuple[str, dict]] = field(default_factory=list)
    """(tool name, arguments) of each call of an MCP tool, in the reply's order."""
    error: str = ""


def parse_tool_calls(text: str, tools: list[dict], external: set[str] | frozenset[str] = frozenset()) -> ToolCall:
    """Every ``<tool_call>{json}</tool_call>`` of ``text``: an env tool's call is an action, a call of a tool in
    ``external`` (an MCP tool; its arguments a JSON object, checked by its server) is a call to make; any bad call
    makes the turn a format error."""
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    blocks = _blocks(text, TOOL_CALL_TAG) if isinstance(text, str) else []
    if not blocks:
        return ToolCall(error="no <tool_call> block")
    out = ToolCall()
    for inner in blocks:
        name, args, error = _read_call(inner, specs)
        if not error and name in external:
            if isinstance(args, dict):
                out.calls.append((name, args))
                continue
            error = f"the arguments of {name} are not a JSON object"
        if not error:
            action, error = _env_action(name, args, specs[name])
            out.actions.append(action)
        if error:
            return ToolCall(error=error)
    return out


def _read_call(inner: str, specs: dict[str, dict]) -> tuple[str, object, str]:
    """(the tool one call names, its arguments, "") or ("", None, why it cannot be used)."""
    if len(inner) > MAX_CALL_CHARS:
        return "", None, "tool call too long"
    try:
        call = json.loads(inner)
        args = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string (OpenAI's wire format)
            args = json.loads(args)
    except (ValueError, RecursionError):
        return "", None, "invalid JSON"
    name = call.get("name") if isinstance(call, dict) else None
    if not isinstance(name, str) or name not in specs:
        return "", None, f"unknown tool {str(name)[:40]!r}"
    return name, args, ""


def _env_action(name: str, args: object, spec: dict) -> tuple[str, str]:
    """(the action a call of an env tool names, "") or ("", why its arguments do not fit)."""
    if len(spec["properties"]) != 1:  # not an env tool (an MCP tool the caller did not pass as external)
        return "", f"unknown tool {name[:40]!r}"
    (param, schema), = spec["properties"].items()
    value = args.get(param) if isinstance(args, dict) else None
    if not isinstance(value, str) or ("enum" in schema and value not in schema["enum"]):
        return "", f"arguments do not fit {name}({param})"
    return value, ""


def _blocks(text: str, tag: str) -> list[str]:
    """The inner texts of every complete ``<tag>...</tag>``, left to right (linear, like prompts._first_block)."""
    opening, closing, out, at = f"<{tag}>", f"</{tag}>", [], 0
    while (start := text.find(opening, at)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        out.append(text[start + len(opening):end])
        at = end + len(closing)
    return out


@dataclass(kw_only=True)
class ToolEpisode(EpisodeContext):
    """An episode of the tool-calling agent: the default sequence plus the env's tools."""

    tools: list[dict] = field(default_factory=list)
    answers: list[ToolCallRecord] = field(default_factory=list)
    """The MCP tool calls of the last reply, whose answers the next messages show."""
    tool_turn: bool = False
    """The last reply called MCP tools and took no env action (the env did not step)."""


class ToolCallAgent(ContextManager):
    """The default (full) layout, prompted in the chat template's tool format and acting through tool calls;
    ``toolbox``: MCP servers' tools offered besides the env's (``agent_proxy.mcp_servers``)."""

    def __init__(self, tokenizer, *, toolbox: McpToolbox | None = None, **options):
        super().__init__(tokenizer, **options)
        self.toolbox = toolbox
        self._check_tool_template()

    @classmethod
    def from_config(cls, cfg: AgentTrainerConfig, tokenizer) -> ToolCallAgent:
        """The agent with the tools of ``agent_proxy.mcp_servers`` (connected once per process and shared)."""
        servers = cfg.agent_proxy.mcp_servers
        return cls(tokenizer, toolbox=shared_toolbox(servers) if servers else None, **agent_options(cfg))

    def start(self, out: EnvOutput) -> ToolEpisode:
        """A new episode: system + tools (by the chat template) + the instruction and first observation."""
        own = env_tools(out.instruction)
        tools = own + (self.toolbox.tools if self.toolbox else [])
        ctx = ToolEpisode(env_id=out.env_id, group_id=out.group_id, tag=out.tag, anchor=anchor_id(out.observation),
                          tools=tools)
        ctx.extend(self._chat_prompt_ids(self.first_user_message(out, own), tools=tools), generated=False)
        return ctx

    def first_user_message(self, out: EnvOutput, own: list[dict]) -> str:
        """The first prompt's user message: the instruction, the first observation and the reply format (``own``:
        the env's tools)."""
        return "\n".join(p for p in (out.instruction.strip(), f"Observation:\n{out.observation.strip()}",
                                     self._reply_format(own[0]["function"]["name"])) if p)

    def _parse_reply(self, ctx: EpisodeStatus, token_ids: list[int]) -> tuple[EnvInput, prompts.ParsedResponse]:
        """The reply's tool calls: env actions, and MCP tools called now; none (a format error) when any call is
        malformed. A tool server that fails ends the episode (``EnvInput.service_error``), no action runs."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        call = parse_tool_calls(text, getattr(ctx, "tools", []), self.toolbox.names if self.toolbox else frozenset())
        if call.error:
            ctx.format_errors += 1
        records, failure = self._call_tools(call.calls)
        if isinstance(ctx, ToolEpisode):
            ctx.answers, ctx.tool_turn = records, bool(records) and not call.actions
        actions = [] if failure else call.actions
        parsed = prompts.ParsedResponse(answer=" || ".join(call.actions), actions=actions, format_ok=not call.error)
        return EnvInput(env_id=ctx.env_id, llm_response=text, actions=actions,
                        tool_calls=[r.as_dict() for r in records], service_error=failure), parsed

    def _call_tools(self, calls: list[tuple[str, dict]]) -> tuple[list[ToolCallRecord], str | None]:
        """Make the calls in order; stop at the first whose server failed (its record says why, and the second
        value names the server and the failure)."""
        records = []
        for name, arguments in calls:
            try:
                records.append(self.toolbox.call(name, arguments))
            except ServiceError as err:
                server = self.toolbox.server_of(name)
                records.append(ToolCallRecord(server=server, name=name, arguments=arguments, error=str(err),
                                              service_failure=True))
                return records, f"MCP server {server!r}: {err}"
        return records, None

    def _turn_messages(self, ctx: EpisodeContext, out: EnvOutput) -> list[dict]:
        """The answers of the reply's MCP tool calls, then (unless the turn was spent on tools only) the step's
        reward and observation."""
        answers = [r.message() for r in getattr(ctx, "answers", [])]
        if isinstance(ctx, ToolEpisode):
            ctx.answers = []
            if ctx.tool_turn:
                return answers
        return answers + [self._next_message(out)]

    def _next_message(self, out: EnvOutput) -> dict:
        """The step's reward and the next observation, as the tool's response."""
        return {"role": "tool", "content": f"Reward: {out.reward:g}\nObservation:\n{out.observation.strip()}"}

    def _reply_format(self, env_tool: str = "act") -> str:
        think = "Think briefly inside <think>...</think>, then act. " if self.enable_think else ""
        return think + (MCP_TOOL_FORMAT.replace("ENV_TOOL", env_tool) if self.toolbox else TOOL_FORMAT)

    def _check_tool_template(self) -> None:
        """Refuse a chat template that drops ``tools=`` (the policy would never see its tools)."""
        probe = [function_tool("probe_tool_xyz", "probe", "direction", list(DIRECTIONS))]
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        text = self.tokenizer.apply_chat_template(messages, tools=probe, add_generation_prompt=True, tokenize=False)
        if "probe_tool_xyz" not in text:
            raise ValueError("agent_proxy.agent_cls = 'tool_call' needs a chat template with a tool format (tools= "
                             "in apply_chat_template, as Qwen2.5's), but this tokenizer's template ignores tools; "
                             "use such a model, or rebuild the tiny model: python -m launch.build_tiny_model --force")
