"""examples/gateway/frozenlake_openai.py's agent with a common retry style: when a reply does not parse, send the
same messages again (up to ``RETRIES`` more times) and act on the first reply that parses (or on the last one).

A re-sent request's prompt is the earlier one again, not that call continued, so the episode's calls do not merge
into one row: the episode trains step-wise, each call a row of its own prompt and the ids the client received,
credited with the episode's return (docs/gateway.md, "Retries"). Trained by ``python -m agent_trainer.main
--config-name frozenlake_gateway agent_proxy.gateway.agent=examples.gateway.frozenlake_retry.run``.
"""

from __future__ import annotations

from collections.abc import Callable

from openai import AsyncOpenAI

from examples.gateway.frozenlake_openai import after_step, first_messages, parse_answer

RETRIES = 1
"""Re-sends per turn after a reply that does not parse; each is a chat completion (and a training row) more."""


async def run(task, client: AsyncOpenAI, parse: Callable[[str], list[str]] = parse_answer) -> None:
    """Play one episode; the environment's rewards are the episode's (returns None). ``parse`` reads a reply's
    actions ([] when it does not parse)."""
    messages = first_messages(task)
    while not task.done:
        for _ in range(1 + RETRIES):
            reply = await client.chat.completions.create(model=task.model, messages=messages)
            text = reply.choices[0].message.content or ""
            actions = parse(text)
            if actions:
                break
        step = await task.step(actions)
        messages += after_step(text, step)
