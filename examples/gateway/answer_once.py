"""A single-turn agent for a prompt dataset: one chat call with the row's prompt, the text inside
``<answer></answer>`` as the answer, scored by the dataset's reward function when ``task.step`` hands it in.

Trained by ``python -m agent_trainer.main --config-name arith_gateway`` (docs/gateway.md): the config's ``data``
files are played as episodes of the ``prompt_dataset`` environment, so ``task.observation`` is the row's prompt
and the step's reward is ``reward.custom_reward_function``'s score.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from agent_trainer.common.prompts import SYSTEM_PROMPT as SYSTEM
from agent_trainer.common.prompts import parse_response

FORMAT = "Reply exactly as <answer>your answer</answer>."


def parse_answer(text: str) -> str | None:
    """The text of the reply's ``<answer>`` block; None when there is none."""
    return parse_response(text, enable_think=False).answer or None


async def run(task, client: AsyncOpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{task.instruction.strip()}\nObservation:\n{task.observation.strip()}\n"
                                            f"{FORMAT}"}]
    reply = await client.chat.completions.create(model=task.model, messages=messages)
    await task.step(parse_answer(reply.choices[0].message.content or ""))
