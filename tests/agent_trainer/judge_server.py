"""A deterministic OpenAI-compatible judge for the tests: FastAPI on 127.0.0.1 (a free port), started by the test.

``POST /v1/chat/completions`` answers in the chat-completions shape (``openai.types.chat.ChatCompletion``). It
reads the trajectories of the last user message (one ``<trajectory>`` block, or ``<trajectory id="i">`` blocks)
and scores each by :func:`text_score`, a fixed function of its text; ``behave`` (text of the user message ->
"score" | "garbage" | "stall" | "error") makes it answer prose without scores, sleep past the client's timeout,
or fail with HTTP 500. Every request is recorded (:attr:`JudgeServer.requests`) with what was answered, and the
most requests answered at once (``max_in_flight``, stalled ones left out: they outlive the client's timeout).
A request without ``Authorization: Bearer <key>`` gets 401.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat import ChatCompletion

from agent_trainer.gateway.server import GatewayServer

BLOCK = re.compile(r'<trajectory(?: id="(\d+)")?>\n(.*?)\n</trajectory>', re.DOTALL)
GARBAGE = "I would rather not put a number on this one."


def text_score(text: str) -> float:
    """The judge's score of a trajectory's text: a fixed number in [0, 1] in steps of 0.01."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 101 / 100


@dataclass
class Recorded:
    """One request and what the server made of it."""

    call_id: str
    messages: list[dict]
    trajectories: list[tuple[str, str]]
    """(id, text) of each trajectory block in the user message ("" id in pointwise requests)."""
    behaviour: str
    reply: str = ""
    scores: dict[str, float] = field(default_factory=dict)


class JudgeServer:
    """The judge app served by uvicorn in a thread (``agent_trainer.gateway.server.GatewayServer``)."""

    def __init__(self, key: str = "", behave: Callable[[str], str] = lambda text: "score", stall_s: float = 6.0):
        self.key, self.behave, self.stall_s = key, behave, stall_s
        self.requests: list[Recorded] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.server = GatewayServer(self.app())
        self.base_url = f"http://127.0.0.1:{self.server.port}/v1"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            if self.key and request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            body = await request.json()
            user = body["messages"][-1]["content"]
            with self.lock:
                record = Recorded(call_id=f"judge-{len(self.requests)}", messages=body["messages"],
                                  trajectories=BLOCK.findall(user), behaviour=self.behave(user))
                self.requests.append(record)
                counted = record.behaviour != "stall"  # a stalled call outlives the client's timeout here
                self.in_flight += counted
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.2)  # long enough for concurrent calls to overlap
                return await self.answer(record, body)
            finally:
                with self.lock:
                    self.in_flight -= counted

        return app

    async def answer(self, record: Recorded, body: dict):
        if record.behaviour == "stall":
            await asyncio.sleep(self.stall_s)
        if record.behaviour == "error":
            return JSONResponse({"error": {"message": "the judge is down"}}, status_code=500)
        if record.behaviour == "garbage":
            record.reply = GARBAGE
        else:
            record.scores = {tid: text_score(text) for tid, text in record.trajectories}
            if len(record.trajectories) == 1 and not record.trajectories[0][0]:
                record.reply = json.dumps({"explanation": "fixed", "score": record.scores[""]})
            else:
                record.reply = "Here they are:\n```json\n" + json.dumps({"scores": [
                    {"trajectory_id": tid, "explanation": "fixed", "score": s} for tid, s in record.scores.items()]}) \
                    + "\n```"
        completion = ChatCompletion(
            id=record.call_id, object="chat.completion", created=int(time.time()), model=body["model"],
            choices=[{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": record.reply}}])
        return completion.model_dump(mode="json")

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> JudgeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
