"""The tool-calling agent (``agent_proxy.agent_cls=tool_call``): the env's actions as tools, replies as tool calls.

The first prompt is rendered by the chat template's own tool format (``apply_chat_template(...,
tools=...)``; Qwen2.5's template puts the JSON schemas in the system message), and the policy acts by
writing ``<tool_call>{"name": "move", "arguments": {"direction": "Up"}}</tool_call>``. Each later
observation comes back as a ``tool`` message (Qwen2.5 renders it as ``<tool_response>``). The tools
are derived from the env's action list (its ``action_description``, shown in the instruction as
``Valid actions: A | B | C``): four directions become ``move(direction)``, other discrete actions
``act(action)`` with an enum, free-text actions ``act(action: string)``.

A reply without a well-formed call (invalid JSON, an unknown tool, arguments that do not fit the
schema) has no action: the env charges ``es_manager.format_penalty`` and the turn counts in
``rollout/format_error_rate``, as a reply without ``<answer>`` does for the default agent. The reply
is untrusted text: it is parsed with ``json.loads`` only, never evaluated. Everything else (the
token-in/token-out sequence, rewards, the batch) is the default agent's (``ctx_manager``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from agent_trainer.common import prompts
from agent_trainer.agents.ctx_manager import ContextManager, EpisodeContext, EpisodeStatus, anchor_id
from agent_trainer.episode.es_manager import EnvInput, EnvOutput

VALID_ACTIONS = "Valid actions: "
"""The instruction line (``es_manager``) that lists an env's actions (``BaseEnv.action_description``)."""
DIRECTIONS = ("Up", "Down", "Left", "Right")
MAX_CALL_CHARS = 2000
"""A tool call longer than this is refused unparsed (no valid call of these tools is that long)."""
TOOL_FORMAT = ("Act by calling exactly one tool: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.")


def function_tool(name: str, description: str, parameter: str, choices: list[str] | None) -> dict:
    """One tool in the OpenAI / Hugging Face ``tools=`` format, with a single string parameter."""
    spec: dict = {"type": "string", "description": f"the {parameter}"}
    if choices:
        spec["enum"] = list(choices)
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: spec}, "required": [parameter]}}}


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
    """A reply's tool calls as env actions, or why none could be used."""

    actions: list[str] = field(default_factory=list)
    error: str = ""


def parse_tool_calls(text: str, tools: list[dict]) -> ToolCall:
    """Every ``<tool_call>{json}</tool_call>`` of ``text`` as an action; any bad call makes the turn a format error."""
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    blocks = _blocks(text, "tool_call") if isinstance(text, str) else []
    if not blocks:
        return ToolCall(error="no <tool_call> block")
    actions = []
    for inner in blocks:
        action, error = _call_action(inner, specs)
        if error:
            return ToolCall(error=error)
        actions.append(action)
    return ToolCall(actions=actions)


def _call_action(inner: str, specs: dict[str, dict]) -> tuple[str, str]:
    """(the action one call names, "") or ("", why it cannot be used)."""
    if len(inner) > MAX_CALL_CHARS:
        return "", "tool call too long"
    try:
        call = json.loads(inner)
        args = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string (OpenAI's wire format)
            args = json.loads(args)
    except (ValueError, RecursionError):
        return "", "invalid JSON"
    name = call.get("name") if isinstance(call, dict) else None
    if not isinstance(name, str) or name not in specs:
        return "", f"unknown tool {str(name)[:40]!r}"
    (param, schema), = specs[name]["properties"].items()
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


class ToolCallAgent(ContextManager):
    """The default (full) layout, prompted in the chat template's tool format and acting through tool calls."""

    def __init__(self, tokenizer, **options):
        super().__init__(tokenizer, **options)
        self._check_tool_template()

    def start(self, out: EnvOutput) -> ToolEpisode:
        """A new episode: system + tools (by the chat template) + the instruction and first observation."""
        tools = env_tools(out.instruction)
        ctx = ToolEpisode(env_id=out.env_id, group_id=out.group_id, tag=out.tag, anchor=anchor_id(out.observation),
                          tools=tools)
        user = "\n".join(p for p in (out.instruction.strip(), f"Observation:\n{out.observation.strip()}",
                                     self._reply_format()) if p)
        ctx.extend(self._chat_prompt_ids(user, tools=tools), generated=False)
        return ctx

    def _parse_reply(self, ctx: EpisodeStatus, token_ids: list[int]) -> tuple[EnvInput, prompts.ParsedResponse]:
        """The reply's tool calls as actions; none (a format error) when any call is malformed."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        call = parse_tool_calls(text, getattr(ctx, "tools", []))
        if call.error:
            ctx.format_errors += 1
        parsed = prompts.ParsedResponse(answer=" || ".join(call.actions), actions=call.actions,
                                        format_ok=not call.error)
        return EnvInput(env_id=ctx.env_id, llm_response=text, actions=call.actions), parsed

    def _next_message(self, out: EnvOutput) -> dict:
        """The step's reward and the next observation, as the tool's response."""
        return {"role": "tool", "content": f"Reward: {out.reward:g}\nObservation:\n{out.observation.strip()}"}

    def _reply_format(self) -> str:
        think = "Think briefly inside <think>...</think>, then act. " if self.enable_think else ""
        return think + TOOL_FORMAT

    def _check_tool_template(self) -> None:
        """Refuse a chat template that drops ``tools=`` (the policy would never see its tools)."""
        probe = [function_tool("probe_tool_xyz", "probe", "direction", list(DIRECTIONS))]
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        text = self.tokenizer.apply_chat_template(messages, tools=probe, add_generation_prompt=True, tokenize=False)
        if "probe_tool_xyz" not in text:
            raise ValueError("agent_proxy.agent_cls = 'tool_call' needs a chat template with a tool format (tools= "
                             "in apply_chat_template, as Qwen2.5's), but this tokenizer's template ignores tools; "
                             "use such a model, or rebuild the tiny model: python -m launch.build_tiny_model --force")
