"""The agent interface: what turns environment outputs into model inputs and model replies into env actions.

The rollout (``agent_trainer.rollout.SyncMultiTurnRollout``) drives one agent per split, on the
driver, through exactly these calls::

    ctx = agent.start(reset_output)                      once per episode
    for each turn while not ctx.done:
        ids = agent.prompt_ids(ctx)                      what the engine continues
        env_input = agent.append_reply(ctx, generated_ids, logprobs)
        agent.append_env_output(ctx, step_output, turn_budget)
    batch = agent.build_update_batch(episodes)           the training rows

The batch must follow the contract of docs/architecture.md; the framework checks its
token-in/token-out part after every rollout (``agent_trainer.agents.contract``): ``response_mask``
is 1 exactly on the ids the engine generated, in order and unchanged. Episode objects are the
agent's own; the rollout reads the fields and properties of ``ctx_manager.EpisodeStatus`` /
``EpisodeContext`` from them (``env_id``, ``group_id``, ``tag``, ``done``, ``truncated``,
``context_overflow``, ``num_turns``, ``num_replies``, ``format_errors``, ``total_reward``,
``num_generated_tokens``, ``longest_row``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from agent_trainer.common.batch import TensorBatch
    from agent_trainer.config import AgentTrainerConfig
    from agent_trainer.episode.es_manager import EnvInput, EnvOutput

SummaryGenerate = Callable[[list[list[int]], list[int], float], list[tuple[list[int], list[float]]]]
"""``generate(prompts, budgets, temperature) -> [(ids, logprobs)]``: the rollout's engines, for text an agent asks
the policy to write into a context (:meth:`Agent.write_summaries`)."""

LAYOUTS = ("full", "condensed")
"""An agent's training rows: one per episode (full) or one per turn (condensed); ``ctx_manager.mode`` must match."""


class Agent(abc.ABC):
    """Builds each episode's model input and parses the model's replies into environment actions.

    Subclass it (or ``ctx_manager.ContextManager``, the default agent, to change one step) and
    select it with ``agent_proxy.agent_cls`` or ``AgentTrainer(..., agent_cls=...)`` (docs/agents.md).
    """

    layout: ClassVar[str] = "full"
    """Rows per episode in :meth:`build_update_batch`: full (one) or condensed (one per turn)."""

    @classmethod
    def from_config(cls, cfg: AgentTrainerConfig, tokenizer) -> Agent:
        """The agent of a run: ``cls(tokenizer, **agent_options(cfg))``; override to read more of the config."""
        return cls(tokenizer, **agent_options(cfg))

    @abc.abstractmethod
    def start(self, out: EnvOutput) -> Any:
        """A new episode record from the environment's reset output (its first prompt)."""

    @abc.abstractmethod
    def prompt_ids(self, ctx: Any) -> list[int]:
        """The token ids the engine continues for the episode's next turn."""

    @abc.abstractmethod
    def append_reply(self, ctx: Any, token_ids: list[int], logprobs: list[float]) -> EnvInput:
        """Record the engine's reply (its ids verbatim) and parse it into the env's actions (never raises)."""

    @abc.abstractmethod
    def append_env_output(self, ctx: Any, out: EnvOutput, response_length: int) -> None:
        """Credit the turn's reward, end the episode when done, and add the next observation."""

    @abc.abstractmethod
    def build_update_batch(self, episodes: list, uid_offset: int = 0) -> TensorBatch:
        """The training rows of the played episodes (``ctx_manager.collate_rows`` builds the contract's keys)."""

    def write_summaries(self, episodes: Iterable[Any], generate: SummaryGenerate) -> int:
        """Write the text the agent asks the policy for before the next turn's prompts (context only, never trained
        on), through ``generate``, the rollout's engines. The rollout calls it before every turn; returns how many
        texts were written. The default writes none (the condensed context manager's ``summary`` condenser does)."""
        return 0


def agent_options(cfg: AgentTrainerConfig) -> dict[str, Any]:
    """The constructor keywords every built-in agent takes from the config."""
    return dict(enable_think=cfg.agent_proxy.enable_think, action_sep=cfg.es_manager.action_sep,
                max_model_len=cfg.actor_rollout_ref.rollout.max_model_len)
