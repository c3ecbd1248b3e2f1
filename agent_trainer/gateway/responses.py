"""The engine's outputs as OpenAI responses: a ``ChatCompletion``, or the ``ChatCompletionChunk`` s of a stream.

Built from the ``openai`` package's own types. ``logprobs`` lists every sampled id (the stop id that ended
the reply included, with its text as the tokenizer decodes it), so a client sees the ids' logprobs exactly as
the session records them; ``top_logprobs`` is empty (the engines report the sampled id's logprob only).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_usage import CompletionUsage

from agent_trainer.gateway import chat
from agent_trainer.gateway.request import ChatRequest


@dataclass
class Sample:
    """One choice as the engine returned it (ids, logprobs, the engine's finish reason) and its message."""

    token_ids: list[int]
    logprobs: list[float]
    reply: chat.Reply


def completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def usage(request: ChatRequest, samples: list[Sample]) -> CompletionUsage:
    completion = sum(len(s.token_ids) for s in samples)
    prompt = len(request.prompt_ids)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion(tokenizer, request: ChatRequest, samples: list[Sample]) -> dict:
    """The non-streaming response body."""
    choices = []
    for i, sample in enumerate(samples):
        message = {"role": "assistant", "content": sample.reply.content,
                   "tool_calls": [c.model_dump() for c in sample.reply.tool_calls] or None}
        choice = {"index": i, "message": message, "finish_reason": sample.reply.finish_reason,
                  "logprobs": _logprobs(tokenizer, request, sample.token_ids, sample.logprobs)}
        if request.return_token_ids:
            choice["token_ids"] = sample.token_ids
        choices.append(choice)
    body = ChatCompletion(id=completion_id(), object="chat.completion", created=int(time.time()),
                          model=request.model, choices=choices, usage=usage(request, samples))
    out = body.model_dump(mode="json", exclude_unset=True)
    if request.return_token_ids:
        out["prompt_token_ids"] = request.prompt_ids
    return out


def _logprobs(tokenizer, request: ChatRequest, ids: list[int], logprobs: list[float]) -> dict | None:
    if not request.logprobs:
        return None
    return {"content": [t.model_dump() for t in chat.token_logprobs(tokenizer, ids, logprobs)], "refusal": None}


def stream(tokenizer, request: ChatRequest, samples: list[Sample]) -> Iterator[str]:
    """Server-sent events: per choice a role chunk, then the content token by token (a reply with tool calls:
    in one chunk), then its finish chunk; with ``stream_options.include_usage`` a usage chunk; ``[DONE]``.

    The engine returns whole replies, so the stream starts once every choice is sampled."""
    cid, created = completion_id(), int(time.time())

    def event(choices: list[dict], **extra) -> str:
        chunk = ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created, model=request.model,
                                    choices=choices, **extra)
        return f"data: {json.dumps(chunk.model_dump(mode='json', exclude_unset=True), ensure_ascii=False)}\n\n"

    for i, sample in enumerate(samples):
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for delta, start, stop in _deltas(tokenizer, sample):
            yield event([{"index": i, "delta": delta, "finish_reason": None, "logprobs": _logprobs(
                tokenizer, request, sample.token_ids[start:stop], sample.logprobs[start:stop])}])
        last = {"index": i, "delta": {}, "finish_reason": sample.reply.finish_reason}
        if request.return_token_ids:
            last["token_ids"] = sample.token_ids
        yield event([last])
    if request.include_usage:
        yield event([], usage=usage(request, samples))
    yield "data: [DONE]\n\n"


def _deltas(tokenizer, sample: Sample) -> Iterator[tuple[dict, int, int]]:
    """(delta, start, stop): the delta and the sampled ids ``token_ids[start:stop]`` it carries.

    Content goes one sampled id at a time (a character split over ids waits for its last id); a reply with
    tool calls goes whole in one delta; a final stop id the text leaves out comes last with no text."""
    decoded = sample.reply.decoded
    if sample.reply.tool_calls:
        calls = [{"index": k, "id": c.id, "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for k, c in enumerate(sample.reply.tool_calls)]
        yield {"content": sample.reply.content, "tool_calls": calls}, 0, len(sample.token_ids)
        return
    sent, start = "", 0
    for k in range(decoded):
        text = tokenizer.decode(sample.token_ids[: k + 1], skip_special_tokens=True)
        if k < decoded - 1 and (text.endswith("\ufffd") or not text.startswith(sent)):
            continue
        yield {"content": text[len(sent):] if text.startswith(sent) else text}, start, k + 1
        sent, start = text, k + 1
    if decoded < len(sample.token_ids):
        yield {"content": ""}, decoded, len(sample.token_ids)
