"""A FrozenLake agent that acts through a tool: ``tools=[move]`` on the plain ``openai`` client, the direction
read from ``message.tool_calls``, the step's outcome sent back as the tool's result.

Trained by ``python -m agent_trainer.main --config-name frozenlake_gateway_tools`` (docs/gateway.md). The gateway
renders ``tools`` with the model's chat template (its tool format) and parses the reply's tool calls; a reply
without a call is a step without an action (the env's format penalty).
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

SYSTEM = "You are a helpful agent that solves tasks by acting in an environment. Act by calling the move tool."


def move_tool(task) -> dict:
    """The ``move`` function tool, its directions the env's valid actions (the instruction's "Valid actions:")."""
    line = next((ln for ln in task.instruction.splitlines() if ln.startswith("Valid actions:")), "")
    directions = [a.strip() for a in line.removeprefix("Valid actions:").split("|") if a.strip()]
    return {"type": "function", "function": {
        "name": "move", "description": "Take one step on the lake.",
        "parameters": {"type": "object", "properties": {"direction": {"type": "string", "enum": directions}},
                       "required": ["direction"]}}}


def direction_of(message) -> str | None:
    """The first ``move`` call's direction; None when the reply made no well-formed call."""
    for call in message.tool_calls or []:
        if call.function.name == "move":
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                return None
            direction = arguments.get("direction") if isinstance(arguments, dict) else None
            return direction if isinstance(direction, str) else None
    return None


async def run(task, client: AsyncOpenAI) -> None:
    tools = [move_tool(task)]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{task.instruction.strip()}\nObservation:\n{task.observation.strip()}"}]
    while not task.done:
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=tools)
        message = reply.choices[0].message
        step = await task.step(direction_of(message))
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        outcome = f"Reward: {step.reward:g}\nObservation:\n{step.observation.strip()}"
        if message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": outcome})
        else:
            messages.append({"role": "user", "content": outcome + "\nCall the move tool."})
