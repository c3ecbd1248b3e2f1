"""One chat-completion request checked against what the gateway can honour, as the engine's call.

The body is validated with the ``openai`` package's own request type (``CompletionCreateParamsBase``). A
parameter the gateway cannot honour is refused (400, naming it), never silently dropped: an unknown key, a
sampling control the engines lack (penalties, ``logit_bias``, ``top_logprobs`` > 0), a forced tool choice,
structured output. Parameters that only label a request for OpenAI's own services (``user``, ``metadata``,
``store``, ``service_tier``, ``safety_identifier``, ``prompt_cache_*``) change no output and are accepted.
``max_completion_tokens`` / ``max_tokens`` over what fits is capped to it; only a prompt that does not fit
``max_model_len`` by itself is refused (``context_length_exceeded``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from openai.types.chat import completion_create_params
from pydantic import TypeAdapter, ValidationError

from agent_trainer.gateway import chat
from agent_trainer.gateway.errors import GatewayError, invalid

PARAMS = TypeAdapter(completion_create_params.CompletionCreateParamsBase)
EXTRA_KEYS = ("stream", "return_token_ids")
"""Keys beyond ``CompletionCreateParamsBase``: ``stream`` (the streaming variant's) and vLLM's
``return_token_ids`` (the response carries ``prompt_token_ids`` and each choice's ``token_ids``)."""
LABELS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
          "prompt_cache_options", "prompt_cache_retention")
"""Accepted and not used: they label a request for OpenAI's services and change no output."""
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "top_logprobs": (0,),
           "parallel_tool_calls": (True,), "modalities": (["text"],), "response_format": ({"type": "text"},),
           "audio": (), "function_call": (), "functions": (), "prediction": (), "reasoning_effort": (),
           "web_search_options": (), "verbosity": (), "moderation": ()}
"""Parameters the engines cannot honour: accepted only unset (None) or at these neutral values."""
MAX_N = 64
DISCRIMINATORS = ("role", "type")
"""Fields whose literal value tells a union's members apart (a message's ``role``, a content part's ``type``)."""
ACCEPTED = {"role": chat.ROLES}
"""The values the gateway accepts for a discriminator, where it takes fewer than the openai types name (the
deprecated ``function`` role is refused); elsewhere the types' own literals are listed."""


@dataclass
class ChatRequest:
    """What the engine is asked for and how the reply is returned."""

    model: str
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: list[int]
    seed: int | None
    parse_tools: bool
    """Whether the reply's ``<tool_call>`` blocks become ``tool_calls`` (tools given, ``tool_choice`` not "none")."""
    logprobs: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse(body: object, tokenizer, max_model_len: int,
          prefix_of: Callable[[str], tuple[str, list[int]] | None] = lambda text: None,
          response_length: int | None = None) -> ChatRequest:
    """The request body (parsed JSON) as a :class:`ChatRequest`, or a :class:`GatewayError` naming what is wrong.

    ``prefix_of(text)`` gives the (text, ids) of the session's earlier call whose prompt and sampled ids render
    as the start of this prompt, if any (``chat.prompt_ids``). ``response_length`` caps the completion's
    tokens (the run's per-turn budget; None: only the context left after the prompt caps it)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - set(completion_create_params.CompletionCreateParamsBase.__annotations__)
                     - set(EXTRA_KEYS))
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    params = _validated(body)
    for key in EXTRA_KEYS:
        if not isinstance(body.get(key, False), bool):
            raise invalid(f"{key} must be a boolean", key)
    for key, neutral in NEUTRAL.items():
        if params.get(key) is not None and params[key] not in neutral:
            raise invalid(f"{key}={params[key]!r} is not supported by this gateway (its engines cannot honour it)",
                          key)
    tools, parse_tools = _tools(params)
    text = chat.prompt_text(tokenizer, chat.template_messages(params["messages"]), tools)
    prompt_ids = chat.prompt_ids(tokenizer, text, prefix_of(text))
    return ChatRequest(
        model=params["model"], prompt_ids=prompt_ids, n=_n(params.get("n")),
        max_tokens=_budget(params, len(prompt_ids), max_model_len, response_length),
        temperature=_range(params, "temperature", 0, 2), top_p=_range(params, "top_p", 0, 1, low_open=True),
        stop_token_ids=chat.stop_token_ids(tokenizer, params.get("stop")), seed=params.get("seed"),
        parse_tools=parse_tools, logprobs=bool(params.get("logprobs")), stream=body.get("stream", False),
        include_usage=bool((params.get("stream_options") or {}).get("include_usage")),
        return_token_ids=body.get("return_token_ids", False))


def _validated(body: dict) -> dict:
    """The body checked by the openai request type; nested lists are checked as they are read (``chat.plain``)."""
    try:
        validated = PARAMS.validate_python(body)
        return {key: _plain(key, value) for key, value in validated.items()}
    except ValidationError as err:
        return _refuse(err, ())


def _plain(key: str, value):
    try:
        return chat.plain(value)
    except chat.NestedInvalid as err:
        return _refuse(err.error, (key, *err.at))


def _refuse(err: ValidationError, outer: tuple):
    """A 400 naming the bad field as ``messages[0].role`` (pydantic's union member names left out)."""
    first, message = _cause(err.errors())
    param = ""
    for part in (*outer, *first["loc"]):
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _member(part):
            param += f".{part}" if param else part
    raise invalid(f"{param}: {message}", param) from err


def _member(part: int | str) -> bool:
    """Whether a pydantic location part names a union member ("ChatCompletionUserMessageParam" and the like)."""
    return isinstance(part, str) and part[:1].isupper()


def _cause(errors: list[dict], start: int = 0) -> tuple[dict, str]:
    """The error to report and its message. Pydantic reports a union's failure as every member's errors, the
    first member's first (a message with a bad field would read "role: Input should be 'developer'"); the
    members whose discriminator (``role``, ``type``) the input does not match are left out, so what is
    reported is the member the input names. When it names none, the discriminator itself is reported, with
    the values accepted."""
    first = errors[0]
    at = next((i for i, part in enumerate(first["loc"]) if i >= start and _member(part)), None)
    if at is None:
        return first, first["msg"]
    prefix = first["loc"][:at]
    here = [e for e in errors if e["loc"][:at] == prefix and len(e["loc"]) > at and _member(e["loc"][at])]
    keys = [e for e in here if e["type"] in ("literal_error", "missing") and len(e["loc"]) == at + 2
            and e["loc"][at + 1] in DISCRIMINATORS]
    ruled_out = {e["loc"][at] for e in keys}
    kept = [e for e in here if e["loc"][at] not in ruled_out]
    if kept:
        return _cause(kept, at + 1)
    key = keys[0]["loc"][at + 1]
    given = next((e["input"] for e in keys if e["type"] == "literal_error"), None)
    accepted = ", ".join(ACCEPTED.get(key) or dict.fromkeys(e["ctx"]["expected"] for e in keys
                                                            if e["type"] == "literal_error"))
    said = f"{given!r} is not a valid {key}" if given is not None else f"a {key} is required"
    return keys[0], f"{said}; the valid {key}s are {accepted}"


def _tools(params: dict) -> tuple[list[dict] | None, bool]:
    """The tools for the chat template (function tools only) and whether to read tool calls from the reply."""
    tools = params.get("tools") or None
    choice = params.get("tool_choice")
    if tools and any(t.get("type") != "function" for t in tools):
        raise invalid("only function tools are supported", "tools")
    if choice is not None and choice not in ("auto", "none"):
        raise invalid(f"tool_choice={choice!r} is not supported: the engines cannot force a tool call "
                      "(use 'auto' or 'none')", "tool_choice")
    if choice is not None and not tools:
        raise invalid("tool_choice is set but no tools are given", "tool_choice")
    return tools, bool(tools) and choice != "none"


def _n(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise invalid(f"n={n} must be between 1 and {MAX_N}", "n")
    return n


def _range(params: dict, key: str, low: float, high: float, low_open: bool = False) -> float:
    value = params.get(key)
    if value is None:
        return 1.0
    if not (low < value <= high if low_open else low <= value <= high):
        raise invalid(f"{key}={value} must be in {'(' if low_open else '['}{low}, {high}]", key)
    return float(value)


def _budget(params: dict, prompt_len: int, max_model_len: int, response_length: int | None) -> int:
    """``max_completion_tokens`` (or the older ``max_tokens``) capped to what fits: the smaller of
    ``response_length`` and what ``max_model_len`` leaves after the prompt (that, when neither is asked).
    Refused as ``context_length_exceeded`` only when the prompt alone leaves no room for a token."""
    key = "max_completion_tokens" if params.get("max_completion_tokens") is not None else "max_tokens"
    asked = params.get(key)
    if asked is not None and asked < 1:
        raise invalid(f"{key}={asked} must be at least 1", key)
    if prompt_len >= max_model_len:
        raise GatewayError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                           f"messages resulted in {prompt_len} tokens, which leaves no room for a completion. "
                           "Please reduce the length of the messages.", param="messages",
                           code="context_length_exceeded")
    room = max_model_len - prompt_len
    fits = room if response_length is None else min(response_length, room)
    return fits if asked is None else min(asked, fits)
