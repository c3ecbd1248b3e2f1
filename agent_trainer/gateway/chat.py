"""From an OpenAI chat request to the engine's prompt ids, and from the sampled ids back to a message.

The prompt is the model's own chat template applied by the Hugging Face tokenizer to the request's messages
and tools (``apply_chat_template(..., tools=..., add_generation_prompt=True)``), straight to ids. The reply's
text is the sampled ids decoded; the ids, not the text, are what the session records. Tool calls are read
from the reply in the Hermes format Qwen2.5's template asks for (``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``), parsed with ``json.loads`` only: model output is never evaluated.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionTokenLogprob
from pydantic import ValidationError

from agent_trainer.gateway.errors import invalid

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ROLES = ("system", "developer", "user", "assistant", "tool")


class NestedInvalid(Exception):
    """A malformed item of a lazily validated iterable: where the iterable is in the value :func:`plain` was
    given, and pydantic's error (whose locations start there)."""

    def __init__(self, at: tuple, error: ValidationError):
        super().__init__(str(error))
        self.at, self.error = at, error


def plain(value, at: tuple = ()):
    """``value`` with every lazily validated iterable (pydantic validates the openai types' ``Iterable`` fields
    on iteration) made a list, so a malformed nested item raises here, as :class:`NestedInvalid`."""
    if isinstance(value, dict):
        return {k: plain(v, (*at, k)) for k, v in value.items()}
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if isinstance(value, Iterable):
        items, out = iter(value), []
        while True:
            try:
                item = next(items)
            except StopIteration:
                return out
            except ValidationError as err:
                raise NestedInvalid(at, err) from err
            out.append(plain(item, (*at, len(out))))
    return value


def template_messages(messages: list[dict]) -> list[dict]:
    """The request's messages as chat templates take them.

    Text parts are joined into one string (other parts, e.g. images, are refused: the model reads text only);
    ``developer`` is the system role; a tool call's ``arguments`` (a JSON string on the wire) becomes the dict
    templates render, as vLLM does, so the model sees the arguments in the form it wrote them.
    """
    if not messages:
        raise invalid("messages must hold at least one message", "messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role {role!r} is not supported (one of {', '.join(ROLES)})",
                          f"messages[{i}].role")
        converted = {"role": "system" if role == "developer" else role, "content": _text(message, i)}
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                converted[key] = message[key]
        if role == "assistant" and message.get("tool_calls"):
            converted["tool_calls"] = [_template_tool_call(call, i) for call in message["tool_calls"]]
            converted["content"] = converted["content"] or None
        out.append(converted)
    return out


def _text(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise invalid(f"messages[{i}].content holds a {part.get('type')!r} part; this model reads text parts "
                          "only", f"messages[{i}].content")
        texts.append(part["text"])
    return "".join(texts)


def _template_tool_call(call: dict, i: int) -> dict:
    if call.get("type") != "function":
        raise invalid(f"messages[{i}].tool_calls: only function tool calls are supported", f"messages[{i}].tool_calls")
    arguments = call["function"]["arguments"]
    try:
        arguments = json.loads(arguments)
    except ValueError:
        pass  # not JSON: the template renders the string as the client sent it
    return {"id": call["id"], "type": "function", "function": {"name": call["function"]["name"],
                                                                 "arguments": arguments}}


def prompt_text(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The chat template applied to the messages and tools, with the assistant's generation prompt, as text."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # a template's own raise_exception (e.g. roles out of order) or a missing field
        raise invalid(f"the model's chat template refused these messages: {err}", "messages") from err


def prompt_ids(tokenizer, text: str, prefix: tuple[str, list[int]] | None = None) -> list[int]:
    """The ids of a rendered prompt: its text encoded as ``apply_chat_template(tokenize=True)`` does, or, with
    ``prefix`` = (text, ids) whose text starts the prompt, those ids followed by the rest of the text encoded.

    The prefix is an earlier call of the session: its prompt ids and the ids the engine sampled, whose text
    the template rendered again for this request. Keeping them keeps what the engine sampled (a non-canonical
    tokenisation of the reply included) under the next prompt, so the session's calls merge into one row."""
    if prefix is None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    head, ids = prefix
    return [*ids, *tokenizer.encode(text[len(head):], add_special_tokens=False)]


def rendered(tokenizer, ids: list[int]) -> str:
    """The text of ids as a later prompt's template would render it (special tokens kept, no clean-up)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def stop_token_ids(tokenizer, stop: str | list[str] | None) -> list[int]:
    """The ids of the ``stop`` strings; the engines stop on ids, so each string must be exactly one token."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    ids = []
    for text in stops:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise invalid(f"stop {text!r} is {len(encoded)} tokens of this model; the engine stops on single "
                          "tokens only: give stop strings that are one token each", "stop")
        ids.append(encoded[0])
    return ids


@dataclass
class Reply:
    """The assistant message of one choice."""

    content: str | None
    tool_calls: list[ChatCompletionMessageFunctionToolCall]
    finish_reason: str
    """OpenAI's: "stop", "length" or "tool_calls"."""
    decoded: int
    """How many of the sampled ids the text decodes (all but a final stop id)."""


def reply(tokenizer, completion_ids: list[int], finish_reason: str, stops: list[int], parse_tools: bool) -> Reply:
    """The message a choice returns: the sampled ids decoded (special tokens and a final stop id left out), and
    with ``parse_tools`` its ``<tool_call>`` blocks as tool calls."""
    ids = completion_ids[:-1] if finish_reason == "stop" and completion_ids and completion_ids[-1] in stops \
        else completion_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    calls, content = (parse_tool_calls(text) if parse_tools else ([], text))
    if calls:
        return Reply(content=content or None, tool_calls=calls, finish_reason="tool_calls", decoded=len(ids))
    return Reply(content=text, tool_calls=[], finish_reason=finish_reason, decoded=len(ids))


def parse_tool_calls(text: str) -> tuple[list[ChatCompletionMessageFunctionToolCall], str]:
    """The well-formed ``<tool_call>{"name": str, "arguments": object}</tool_call>`` blocks of ``text`` as tool
    calls, and the text outside them (stripped). A malformed block is no call: the text stays content."""
    calls, outside, at = [], [], 0
    while (start := text.find(TOOL_CALL_OPEN, at)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            break
        call = _tool_call(text[start + len(TOOL_CALL_OPEN):end])
        if call is None:
            return [], text
        calls.append(call)
        outside.append(text[at:start])
        at = end + len(TOOL_CALL_CLOSE)
    outside.append(text[at:])
    return calls, "".join(outside).strip()


def _tool_call(inner: str) -> ChatCompletionMessageFunctionToolCall | None:
    try:
        call = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        return None
    return ChatCompletionMessageFunctionToolCall(
        id=f"call_{secrets.token_hex(8)}", type="function",
        function={"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                  else json.dumps(arguments, ensure_ascii=False)})


def token_logprobs(tokenizer, ids: list[int], logprobs: list[float]) -> list[ChatCompletionTokenLogprob]:
    """OpenAI's per-token logprobs of the sampled ids (no alternatives: ``top_logprobs`` is empty)."""
    out = []
    for token_id, logprob in zip(ids, logprobs):
        token = tokenizer.decode([token_id])
        out.append(ChatCompletionTokenLogprob(token=token, bytes=list(token.encode("utf-8")), logprob=logprob,
                                              top_logprobs=[]))
    return out
