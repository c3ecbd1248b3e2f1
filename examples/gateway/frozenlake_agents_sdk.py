"""A FrozenLake agent built with the OpenAI Agents SDK (``pip install 'agent-trainer[agents]'``, the package
``openai-agents``): an ``Agent`` with one function tool, ``move``, run by the SDK's ``Runner`` on the Chat
Completions API of the ``client`` it is handed. The SDK owns the loop (call the model, run the tool it asked
for, send back the result); the tool steps the environment.

Trained by ``python -m agent_trainer.main --config-name frozenlake_gateway_agents_sdk`` (docs/gateway.md).
"""

from __future__ import annotations

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

INSTRUCTIONS = ("You are a helpful agent that solves tasks by acting in an environment. Act by calling the move "
                "tool with one of the valid actions until the episode is over.")


async def run(task, client: AsyncOpenAI) -> None:
    @function_tool
    async def move(direction: str) -> str:
        """Take one step on the lake.

        Args:
            direction: one of the valid actions the task lists (e.g. Left, Down, Right, Up).
        """
        step = await task.step(direction)
        over = "\nThe episode is over." if task.done else ""
        return f"Reward: {step.reward:g}\nObservation:\n{step.observation.strip()}{over}"

    agent = Agent(name="frozenlake", instructions=INSTRUCTIONS, tools=[move],
                  model=OpenAIChatCompletionsModel(model=task.model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="auto"))
    try:
        await Runner.run(agent, f"{task.instruction.strip()}\nObservation:\n{task.observation.strip()}",
                         max_turns=task.max_turns + 1, run_config=RunConfig(tracing_disabled=True))
    except MaxTurnsExceeded:
        pass
    if task.turns == 0:  # the model answered without calling the tool: a step without an action
        await task.step(None)
