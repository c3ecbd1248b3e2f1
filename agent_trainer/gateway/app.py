"""The OpenAI-compatible HTTP app: ``POST .../v1/chat/completions`` and ``GET .../v1/models``, per session.

A user's agent keeps its ``openai`` client and gets one base URL per episode,
``http://127.0.0.1:<port>/sessions/<session_id>/v1``, and the run's API key. Each request's messages (and
tools) go through the model's chat template to prompt ids; the engine samples from those ids (token in,
token out); the session records the prompt ids, the sampled ids, their logprobs, the policy version and the
finish reason of every choice (:mod:`agent_trainer.gateway.sessions`). Faults answer in OpenAI's error shape:
401 for a missing or wrong key, 404 for an unknown session or model, 400 for a malformed or unsupported
request (``context_length_exceeded`` when the prompt alone does not fit ``max_model_len``; a ``max_tokens``
over what fits is capped to it, :attr:`Gateway.response_length`).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from agent_trainer.gateway import chat, request as chat_request, responses
from agent_trainer.gateway.errors import GatewayError, invalid
from agent_trainer.gateway.sessions import CallRecord, SessionStore

logger = logging.getLogger(__name__)


class Generation(Protocol):
    """What an engine returns per prompt (``agent_trainer.workers.rollout.GenerationOutput``)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    # An output may also carry ``version``: the policy version that generated it (a training rollout's engine
    # calls, ``rollout.gateway.Sampled``); the record keeps it instead of the version read before the call.


class Generate(Protocol):
    """An engine's ``generate`` (``HFEngine.generate``, ``VLLMEngine.generate``): ids in, ids out."""

    def __call__(self, prompts: list[list[int]], *, max_tokens: int, temperature: float, top_p: float,
                 stop_token_ids: list[int] | None, seed: int | None) -> Sequence[Generation]: ...


@dataclass
class Gateway:
    """What the app serves: the model's tokenizer, an engine's generate, the sessions and the run's key."""

    tokenizer: object
    """The served model's Hugging Face tokenizer (its ``chat_template`` renders the prompts)."""
    generate: Generate
    store: SessionStore
    api_key: str
    """The run's key: every request must send ``Authorization: Bearer <api_key>``."""
    model: str
    """The served model's name (``GET /v1/models``; a request naming another model gets 404)."""
    max_model_len: int
    """Prompt plus completion tokens the engine holds."""
    response_length: int | None = None
    """Most tokens one reply may have (the run's per-turn budget, ``actor_rollout_ref.rollout.response_length``):
    a request's ``max_tokens`` is capped to it and to what ``max_model_len`` leaves after the prompt; None: to
    the latter only."""
    policy_version: Callable[[], int] = lambda: 0
    """The engine's current policy version, recorded with each call."""
    max_concurrent_requests: int = 1024
    """Requests served at once (each waits for the engine in a worker thread; anyio's default is 40, which would
    cap how many sessions' requests can share one engine call)."""
    engine_lock: threading.Lock | None = field(default_factory=threading.Lock)
    """One engine call at a time (an engine is not thread-safe); None when ``generate`` is thread-safe itself
    (a rollout's ``EngineBatcher`` batches the requests of concurrent sessions)."""

    def __post_init__(self):
        if not self.api_key:
            raise ValueError("the gateway needs a non-empty api_key: every request is checked against it")


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app of a :class:`Gateway`."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        anyio.to_thread.current_default_thread_limiter().total_tokens = gateway.max_concurrent_requests
        yield

    app = FastAPI(title="agent-trainer gateway", openapi_url=None, docs_url=None, redoc_url=None,
                  dependencies=[Depends(_key_check(gateway.api_key))], lifespan=lifespan)
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)

    @app.get("/v1/models")
    def models() -> dict:
        return _models(gateway)

    @app.get("/sessions/{session_id}/v1/models")
    def session_models(session_id: str) -> dict:
        _check_session(gateway, session_id)
        return _models(gateway)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, http: Request):
        _check_session(gateway, session_id)
        try:
            body = await http.json()
        except (ValueError, UnicodeDecodeError) as err:
            raise invalid(f"the request body is not valid JSON: {err}") from err
        req = await run_in_threadpool(chat_request.parse, body, gateway.tokenizer, gateway.max_model_len,
                                      lambda text: _prefix_of(gateway, session_id, text), gateway.response_length)
        if req.model != gateway.model:
            raise GatewayError(404, f"The model {req.model!r} does not exist; this gateway serves {gateway.model!r}",
                               param="model", code="model_not_found")
        samples = await run_in_threadpool(_sample, gateway, session_id, req)
        if req.stream:
            return StreamingResponse(responses.stream(gateway.tokenizer, req, samples), media_type="text/event-stream")
        return responses.completion(gateway.tokenizer, req, samples)

    return app


def _sample(gateway: Gateway, session_id: str, req: chat_request.ChatRequest) -> list[responses.Sample]:
    """Generate the request's ``n`` choices from its prompt ids and record them in the session."""
    try:
        index = gateway.store.next_request(session_id)  # the request's place in the session: its arrival
    except KeyError:
        raise _no_session(session_id) from None
    with gateway.engine_lock or contextlib.nullcontext():
        version = gateway.policy_version()
        outputs = gateway.generate([list(req.prompt_ids)] * req.n, max_tokens=req.max_tokens,
                                   temperature=req.temperature, top_p=req.top_p, stop_token_ids=req.stop_token_ids,
                                   seed=req.seed)
    if len(outputs) != req.n or any(len(out.token_ids) != len(out.logprobs) for out in outputs):
        raise RuntimeError(f"the engine returned {len(outputs)} outputs for {req.n} prompts, or ids and logprobs of "
                           "different lengths; nothing is recorded")
    records = [CallRecord(request_index=index, choice_index=i, prompt_ids=tuple(req.prompt_ids),
                          completion_ids=tuple(out.token_ids), logprobs=tuple(out.logprobs),
                          finish_reason=out.finish_reason,
                          policy_version=version if getattr(out, "version", None) is None else out.version,
                          rendered=chat.rendered(gateway.tokenizer, [*req.prompt_ids, *out.token_ids]))
               for i, out in enumerate(outputs)]
    try:
        gateway.store.record(session_id, records)
    except KeyError:
        raise _no_session(session_id) from None
    stops = set(req.stop_token_ids) | eos_ids(gateway.tokenizer)
    return [responses.Sample(list(r.completion_ids), list(r.logprobs),
                             chat.reply(gateway.tokenizer, list(r.completion_ids), r.finish_reason, stops,
                                        req.parse_tools)) for r in records]


def _prefix_of(gateway: Gateway, session_id: str, text: str) -> tuple[str, list[int]] | None:
    """The session's earlier call this prompt continues (``SessionStore.prefix_of``); 404 for a closed session."""
    try:
        return gateway.store.prefix_of(session_id, text)
    except KeyError:
        raise _no_session(session_id) from None


def eos_ids(tokenizer) -> set[int]:
    """The tokenizer's eos id(s), as a set (a reply ends in one of them or in a stop id)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if isinstance(eos, int) else set(eos or [])


def _models(gateway: Gateway) -> dict:
    return {"object": "list", "data": [{"id": gateway.model, "object": "model", "created": int(time.time()),
                                        "owned_by": "agent-trainer"}]}


def _check_session(gateway: Gateway, session_id: str) -> None:
    if session_id not in gateway.store:
        raise _no_session(session_id)


def _no_session(session_id: str) -> GatewayError:
    return GatewayError(404, f"no open session {session_id!r} (it ended, or was never opened)", param="session_id",
                        code="session_not_found")


def _key_check(api_key: str):
    bearer = HTTPBearer(auto_error=False)

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        # async: a plain function would take a worker thread per request for a string comparison
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise GatewayError(401, "Incorrect API key provided." if given else "Missing API key: send "
                               "'Authorization: Bearer <key>'.", code="invalid_api_key")
    return check


async def _gateway_error(_: Request, err: GatewayError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
    return JSONResponse(GatewayError(err.status_code, str(err.detail)).body(), status_code=err.status_code)


async def _server_error(_: Request, err: Exception) -> JSONResponse:
    logger.exception("gateway request failed")
    body = GatewayError(500, f"the gateway failed: {type(err).__name__}", type="server_error").body()
    return JSONResponse(body, status_code=500)
