"""examples/gateway/frozenlake_openai.py's agent written with the synchronous ``openai.OpenAI`` client, as many
agent frameworks are: a plain ``def run(task, client)``. The trainer runs each episode of a synchronous agent in
a thread of its own and hands it a :class:`~agent_trainer.gateway.task.SyncTask` whose ``step`` blocks, so the
episodes' calls reach the engines together as the async agent's do (docs/gateway.md, "Synchronous agents").

Trained by ``python -m agent_trainer.main --config-name frozenlake_gateway
agent_proxy.gateway.agent=examples.gateway.frozenlake_openai_sync.run``.
"""

from __future__ import annotations

from openai import OpenAI

from examples.gateway.frozenlake_openai import after_step, first_messages, parse_answer


def run(task, client: OpenAI) -> None:
    """Play one episode; the environment's rewards are the episode's (returns None)."""
    messages = first_messages(task)
    while not task.done:
        reply = client.chat.completions.create(model=task.model, messages=messages)
        text = reply.choices[0].message.content or ""
        step = task.step(parse_answer(text))
        messages += after_step(text, step)
