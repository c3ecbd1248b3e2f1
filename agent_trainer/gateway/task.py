"""What a user's agent function gets for one training episode: the :class:`Task` it acts in.

A gateway agent is an ordinary function (``agent_proxy.gateway.agent``, docs/gateway.md), async::

    async def run(task: Task, client: openai.AsyncOpenAI) -> float | None:
        messages = [{"role": "user", "content": task.instruction + "\\n" + task.observation}]
        while not task.done:
            reply = await client.chat.completions.create(model=task.model, messages=messages)
            ...
            step = await task.step(action)      # the project env acts; its reward is the episode's
        return None                             # None: the env's rewards; a float replaces their sum

or synchronous (``def run(task, client)``, handed an ``openai.OpenAI`` and a :class:`SyncTask` whose ``step``
blocks; each episode runs in a thread of its own, so the episodes' calls still reach the engines together).
The client's ``base_url`` is the episode's own session of the gateway, so every call it makes is recorded
and trained on; the task steps the episode's environment (a Ray env actor) and keeps the rewards.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent_trainer.episode.es_manager import episode_instruction
from envs.registry import load_env_tags

if TYPE_CHECKING:
    from agent_trainer.config import AgentTrainerConfig


@dataclass(frozen=True)
class StepResult:
    """One environment step as the agent sees it."""

    observation: str
    reward: float
    """The step's reward, the env's ``es_manager.format_penalty`` included when the action was not valid."""
    done: bool
    info: dict


class EpisodeOver(RuntimeError):
    """``Task.step`` after the episode ended (the env said done, or ``agent_proxy.max_turn`` steps were taken)."""


@dataclass
class Task:
    """One episode of a project environment, for a gateway agent (see the module docstring)."""

    instruction: str
    """The environment's instruction (what the task is, the valid actions)."""
    observation: str
    """The current observation: the reset's, then the last step's."""
    tag: str
    """The env tag (``config/envs.yaml``)."""
    env_id: int
    group_id: int
    model: str
    """The served model's name, for ``client.chat.completions.create(model=...)``."""
    max_turns: int
    """Steps the episode may take (``agent_proxy.max_turn``); the task is done after them."""
    _step: Callable[[list[str], str], Awaitable[StepResult]] = field(repr=False, default=None)
    done: bool = False
    reward: float = 0.0
    """The rewards of the steps so far, summed."""
    turns: int = 0
    """Steps taken so far."""
    info: dict = field(default_factory=dict)
    """The last step's info (``success``, ``action_is_valid``, ...)."""

    @classmethod
    def local(cls, env, *, seed: int, tag: str, model: str, max_turns: int, instruction: str | None = None,
              format_penalty: float = -0.1) -> Task:
        """A task over an env object in this process (``envs.make_env(tag)``), reset with ``seed``: to try an agent
        against a gateway without the trainer, its env actors or Ray. ``instruction`` None: the one a training
        episode of ``tag`` starts with (config/envs.yaml's ``env_instruction``, the legend, the valid actions; one
        action per turn). A step without an action costs ``format_penalty`` and leaves the env as it was; the
        first action of a list is the one taken."""
        observation = env.reset(seed=seed)
        if instruction is None:
            instruction = episode_instruction(env, load_env_tags()[tag])

        async def step(actions: list[str], response: str) -> StepResult:
            if not actions:
                return StepResult(task.observation, format_penalty, False, {"action_is_valid": False})
            obs, reward, done, info = env.step(actions[0])
            return StepResult(obs, float(reward), bool(done), dict(info))

        task = cls(instruction=instruction, observation=observation, tag=tag, env_id=seed, group_id=seed, model=model,
                   max_turns=max_turns, _step=step)
        return task

    async def step(self, actions: str | list[str] | None, response: str = "") -> StepResult:
        """Act in the environment: one action (or a list, up to ``es_manager.max_actions_per_turn``; None or
        an empty list when the reply had none: the env charges ``es_manager.format_penalty``). ``response``
        is the reply text, shown in the trajectory viewer (default: the last reply the gateway returned)."""
        if self.done:
            raise EpisodeOver(f"the episode of env tag {self.tag!r} (env_id {self.env_id}) is over after "
                              f"{self.turns} steps; check task.done before stepping")
        if actions is None:
            actions = []
        elif isinstance(actions, str):
            actions = [actions]
        if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
            raise TypeError(f"task.step takes an action string or a list of them, got {type(actions).__name__}")
        result = await self._step(actions, response)
        self.turns += 1
        self.observation, self.info = result.observation, result.info
        self.reward += result.reward
        self.done = result.done or self.turns >= self.max_turns
        return result


@dataclass
class SyncTask(Task):
    """The task of a synchronous agent function (``def run(task, client)``): :meth:`step` blocks until the env
    has acted. In a rollout the step runs on the rollout's event loop (``_loop``), the agent in a thread of its
    own; without a loop (``SyncTask.local``) it runs in the calling thread."""

    _loop: asyncio.AbstractEventLoop | None = field(repr=False, default=None)

    def step(self, actions: str | list[str] | None, response: str = "") -> StepResult:  # type: ignore[override]
        """:meth:`Task.step`, blocking: returns the :class:`StepResult`."""
        stepped = Task.step(self, actions, response)
        if self._loop is None:
            return asyncio.run(stepped)
        return asyncio.run_coroutine_threadsafe(stepped, self._loop).result()


KEY = "agent_proxy.gateway.agent"


def is_sync_agent(fn: Callable) -> bool:
    """Whether an agent function is synchronous (``def``, run in a thread per episode) rather than ``async def``."""
    return not inspect.iscoroutinefunction(fn)


def resolve_agent_fn(cfg: AgentTrainerConfig) -> Callable:
    """The run's agent function (``agent_proxy.gateway.agent``): ``async def run(task, client)`` or a synchronous
    ``def run(task, client)`` (:func:`is_sync_agent`).

    ``package.module.function`` or ``package.module:function``; raises ValueError naming the key."""
    name = cfg.agent_proxy.gateway.agent
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"{KEY} = {name!r} is not an import path; write package.module.function or "
                         "package.module:function (docs/gateway.md)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ValueError(f"{KEY} = {name!r}: module {module_name!r} does not import ({type(err).__name__}: {err}); "
                         "it must be importable by the driver (the working directory or PYTHONPATH)") from err
    fn = getattr(module, attr, None)
    if fn is None:
        close = [n for n, f in vars(module).items()
                 if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")]
        raise ValueError(f"{KEY} = {name!r}: module {module_name!r} has no {attr!r} (its functions: {close})")
    generator = inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn)
    if generator or not (inspect.iscoroutinefunction(fn) or inspect.isfunction(fn) or inspect.ismethod(fn)):
        what = "a generator function" if generator else type(fn).__name__
        raise ValueError(f"{KEY} = {name!r} is not a function ({what}); write `async def {attr}(task, client)` or "
                         f"`def {attr}(task, client)` (docs/gateway.md)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as err:
        raise ValueError(f"{KEY} = {name!r} must take two arguments (task, client): {err}") from err
    return fn
