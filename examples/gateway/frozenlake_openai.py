"""A FrozenLake agent written with the plain ``openai`` client: a loop of chat calls, the action parsed from the
reply. Nothing in it is agent-trainer's but the ``task`` it is handed and the prompt text it imports; point any
``AsyncOpenAI`` client at a server and it plays the same way.

Trained by ``python -m agent_trainer.main --config-name frozenlake_gateway`` (docs/gateway.md): the trainer
gives each episode a client whose base URL is the episode's own gateway session, and trains the policy on the
exact ids of every call. Its messages are the built-in agent's, from ``agent_trainer.common.prompts`` (the system
prompt, the instruction and observation, "Reward: ..." after each step, the think-then-answer format that
config/frozenlake_gateway.yaml's ``agent_proxy.enable_think`` asks for and make train's warm start answers in),
so the two agents' curves compare on one task.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from agent_trainer.common.prompts import SYSTEM_PROMPT, first_user_message, next_user_message, parse_response

ENABLE_THINK = True
"""``<think>...</think><answer>...</answer>``, as ``agent_proxy.enable_think: true`` in the config."""
SYSTEM = SYSTEM_PROMPT


def parse_answer(text: str) -> list[str]:
    """The reply's actions (the ``<answer>`` block split on ``||``); [] when the reply does not parse."""
    return parse_response(text, enable_think=ENABLE_THINK).actions


def first_messages(task) -> list[dict]:
    """The system prompt and the first user turn: the instruction, the observation and the reply format."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": first_user_message(task.instruction, task.observation, ENABLE_THINK)}]


def after_step(text: str, step) -> list[dict]:
    """The reply as the assistant turn, then the step's reward and observation as the next user turn."""
    return [{"role": "assistant", "content": text},
            {"role": "user", "content": next_user_message(step.observation, step.reward, ENABLE_THINK)}]


async def run(task, client: AsyncOpenAI) -> None:
    """Play one episode; the environment's rewards are the episode's (returns None)."""
    messages = first_messages(task)
    while not task.done:
        reply = await client.chat.completions.create(model=task.model, messages=messages)
        text = reply.choices[0].message.content or ""
        step = await task.step(parse_answer(text))  # [] (no action): the env charges its format penalty
        messages += after_step(text, step)
