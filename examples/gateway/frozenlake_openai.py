"""A FrozenLake agent written with the plain ``openai`` client: a loop of chat calls, the action parsed from the
reply. Nothing in it is agent-trainer's but the ``task`` it is handed; point any ``AsyncOpenAI`` client at a
server and it plays the same way.

Trained by ``python -m agent_trainer.main --config-name frozenlake_gateway`` (docs/gateway.md): the trainer
gives each episode a client whose base URL is the episode's own gateway session, and trains the policy on the
exact ids of every call. Its messages are the built-in agent's (the system prompt, the instruction and
observation, "Reward: ..." after each step), so the two agents' curves compare on one task.
"""

from __future__ import annotations

from openai import AsyncOpenAI

SYSTEM = "You are a helpful agent that solves tasks by acting in an environment."
FORMAT = "Reply exactly as <answer>your action</answer>."


def parse_answer(text: str) -> str | None:
    """The text between the first ``<answer>`` and the ``</answer>`` after it; None when there is none."""
    start = text.find("<answer>")
    end = text.find("</answer>", start + len("<answer>")) if start >= 0 else -1
    answer = text[start + len("<answer>"):end].strip() if end >= 0 else ""
    return answer or None


async def run(task, client: AsyncOpenAI) -> None:
    """Play one episode; the environment's rewards are the episode's (returns None)."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{task.instruction.strip()}\nObservation:\n{task.observation.strip()}\n"
                                            f"{FORMAT}"}]
    while not task.done:
        reply = await client.chat.completions.create(model=task.model, messages=messages)
        text = reply.choices[0].message.content or ""
        step = await task.step(parse_answer(text))
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"Reward: {step.reward:g}\nObservation:\n{step.observation.strip()}\n"
                                                 f"{FORMAT}"}]
