"""Agents for tests/e2e/test_gateway_e2e.py: the example FrozenLake agent run unchanged, its client wrapped so the
test keeps what the gateway returned for every call (ids and logprobs, as the engine sampled them)."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

from examples.gateway import frozenlake_openai, frozenlake_retry

HANGS: set[int] = set()
"""env_ids whose agent never returns after its first call (the per-episode deadline must end it)."""
CALLS: dict[int, list[dict]] = defaultdict(list)
"""env_id -> the calls of its episodes, in order: prompt ids, sampled ids, their logprobs (as the client got them)."""
HOLD: list[threading.Event] = []
"""When it holds an event, every call but the rollout's first waits for it (the test kills the engine after the
first call came back, then sets it: the calls that follow meet the killed engine or its restart)."""
STARTED: list[int] = []
"""The calls started since the test last cleared it."""


class _Completions:
    def __init__(self, completions, env_id: int):
        self._completions, self._env_id = completions, env_id

    async def create(self, **kwargs):
        STARTED.append(self._env_id)
        if HOLD and len(STARTED) > 1:
            await asyncio.to_thread(HOLD[0].wait, 120)
        reply = await self._completions.create(**kwargs, logprobs=True, extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        CALLS[self._env_id].append({"prompt_ids": reply.model_extra["prompt_token_ids"],
                                    "ids": choice.model_extra["token_ids"],
                                    "logprobs": [t.logprob for t in choice.logprobs.content]})
        return reply


class RecordingClient:
    """An ``openai.AsyncOpenAI`` whose chat completions are recorded; everything else is the client's."""

    def __init__(self, client, env_id: int):
        self._client = client
        self.chat = type("Chat", (), {"completions": _Completions(client.chat.completions, env_id)})()

    def __getattr__(self, name):
        return getattr(self._client, name)


async def recorded_frozenlake(task, client):
    """examples/gateway/frozenlake_openai.py's agent, its calls recorded; after its first call, the episode of
    env_id 0 raises and those in :data:`HANGS` never return (each must end only its own episode)."""
    client = RecordingClient(client, task.env_id)
    if task.env_id == 0 or task.env_id in HANGS:
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.observation}])
        if task.env_id == 0:
            raise ValueError("this agent fails on purpose")
        await asyncio.Event().wait()  # never set
    return await frozenlake_openai.run(task, client)


async def recorded_retry(task, client):
    """examples/gateway/frozenlake_retry.py's agent, its calls recorded; the episode's first reply is taken as one
    that does not parse (whatever it says), so every episode re-sends its first request once. Then whatever the
    model says, an even env_id moves Right and an odd one answers "Fly", not an action (the format penalty): the
    returns differ in every group of consecutive env_ids, so the update has a gradient on any model build."""
    replies = []

    def parse(text: str) -> list[str]:
        replies.append(text)
        if len(replies) == 1:
            return []
        return ["Right"] if task.env_id % 2 == 0 else ["Fly"]

    return await frozenlake_retry.run(task, RecordingClient(client, task.env_id), parse=parse)
