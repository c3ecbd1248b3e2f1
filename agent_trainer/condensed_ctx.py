"""Condensed context (``ctx_manager.mode: condensed``): each turn's prompt is rebuilt; one row per turn.

For turn k of an episode the prompt c_k is rendered fresh by the chat template::

    system:    SYSTEM_PROMPT
    user:      env instruction
               Recent turns (the last n):           (absent on turn 1, or with keep_last_n_turns = 0)
               Turn j: observation, answer, reward   for each of the last n turns
               Current observation (turn k): ...
               reply format
    assistant header

and the reply o_k is the engine's ids verbatim. The training row of the turn is
c_k + o_k with ``response_mask`` 1 exactly on o_k: what is trained is
token-in/token-out, the context is re-rendered text (mask 0). A row is at most
the prompt plus ``response_length`` tokens however many turns the episode has,
which is the point of condensation (multi-conversation GRPO as in MemAgent,
Yu et al. 2025, arXiv:2507.02259).

Every row of an episode has ``traj_uid`` = the episode id and ``uid`` = its
group id; ``turn_ids`` is k on o_k and 0 on c_k; ``anchor_obs_ids`` [B] is the
hashed observation the row's turn answered (GiGPO's one-row-per-step layout). Each turn's reward (env reward
plus format penalty) sits on the last generated token of its row, so the sum
of an episode's token rewards over its rows is the episode's total reward:
exactly the trajectory score S_j that ``compute_grpo_multiturn_advantage``
sums over the rows of trajectory j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_trainer import prompts
from agent_trainer.batch import TensorBatch
from agent_trainer.ctx_manager import ContextManager, EpisodeStatus, TrainingRow, anchor_id, collate_rows
from agent_trainer.es_manager import EnvInput, EnvOutput

NO_ANSWER = "(no <answer> block)"
"""How the summary shows a reply without an answer."""


@dataclass
class TurnRow:
    """One played turn: the prompt it was generated from, the generated ids and the turn's reward."""

    turn: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    anchor: int = 0
    """Anchor id (``ctx_manager.anchor_id``) of the observation the turn answered (GiGPO's anchor state)."""
    reward: float = 0.0

    def training_row(self, group_id: int, traj_id: int, tag: str) -> TrainingRow:
        """c_k + o_k with mask 1 exactly on o_k and the turn's reward on o_k's last token."""
        n_prompt, n_reply = len(self.prompt_ids), len(self.response_ids)
        rewards = [0.0] * (n_prompt + n_reply)
        if n_reply:  # an empty reply has no token to carry the reward (estimators ignore mask-0 rewards)
            rewards[-1] = self.reward
        return TrainingRow(
            token_ids=self.prompt_ids + self.response_ids,
            response_mask=[0] * n_prompt + [1] * n_reply,
            rewards=rewards,
            rollout_log_probs=[0.0] * n_prompt + list(self.logprobs),
            turn_ids=[0] * n_prompt + [self.turn] * n_reply,
            anchor_ids=[0] * n_prompt + [self.anchor] * n_reply,
            group_id=group_id, traj_id=traj_id, tag=tag,
        )


@dataclass
class TurnSummary:
    """What the condensed prompt remembers of a past turn (text only)."""

    turn: int
    observation: str
    """The observation the turn answered."""
    answer: str
    """The reply's <answer> text (its reasoning is dropped)."""
    reward: float


@dataclass(kw_only=True)
class CondensedEpisode(EpisodeStatus):
    """One episode in condensed mode: its played turns and the text the next prompt is built from."""

    instruction: str
    observation: str
    """The current observation (the next prompt shows it)."""
    next_prompt: list[int] = field(default_factory=list)
    """The rendered prompt ids of the next turn."""
    rows: list[TurnRow] = field(default_factory=list)
    history: list[TurnSummary] = field(default_factory=list)
    pending_answer: str = ""

    @property
    def total_reward(self) -> float:
        """The episode's total reward (every turn's reward and format penalty)."""
        return float(sum(r.reward for r in self.rows))

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the engine generated over the episode."""
        return sum(len(r.response_ids) for r in self.rows)

    @property
    def longest_row(self) -> int:
        """Length of the episode's longest training row (prompt + reply of one turn)."""
        return max((len(r.prompt_ids) + len(r.response_ids) for r in self.rows), default=len(self.next_prompt))


def condensed_user_message(instruction: str, history: list[TurnSummary], observation: str, turn: int,
                           enable_think: bool = True) -> str:
    """The user message of a condensed prompt: instruction, recent turns as text, current observation, format."""
    parts = [instruction.strip()]
    if history:
        lines = [f"Recent turns (the last {len(history)}):"]
        for h in history:
            lines.append(f"Turn {h.turn}:\nObservation:\n{h.observation.strip()}\n"
                         f"Your answer: {h.answer}\nReward: {h.reward:g}")
        parts.append("\n".join(lines))
    parts.append(f"Current observation (turn {turn}):\n{observation.strip()}")
    parts.append(prompts.format_instruction(enable_think))
    return "\n".join(p for p in parts if p)


class CondensedContextManager(ContextManager):
    """Builds a fresh prompt per turn from a text summary of the last ``keep_last_n_turns`` turns.

    Same interface as :class:`ContextManager` (``start``, ``prompt_ids``,
    ``append_reply``, ``append_env_output``, ``build_update_batch``), so the
    rollout loop is the same for both modes.
    """

    def __init__(self, tokenizer, *, keep_last_n_turns: int = 2, enable_think: bool = True, action_sep: str = "||",
                 max_model_len: int = 2048):
        super().__init__(tokenizer, enable_think=enable_think, action_sep=action_sep, max_model_len=max_model_len)
        if keep_last_n_turns < 0:
            raise ValueError(f"keep_last_n_turns = {keep_last_n_turns} must be >= 0 (0 = no history)")
        self.keep_last_n_turns = keep_last_n_turns

    def start(self, out: EnvOutput) -> CondensedEpisode:  # type: ignore[override]
        """A new episode from its reset output; renders the first prompt."""
        ep = CondensedEpisode(env_id=out.env_id, group_id=out.group_id, tag=out.tag, instruction=out.instruction,
                              observation=out.observation)
        ep.next_prompt = self._render_prompt(ep)
        return ep

    def prompt_ids(self, ctx: CondensedEpisode) -> list[int]:  # type: ignore[override]
        """The ids the engine continues for the next turn: that turn's freshly rendered prompt."""
        return ctx.next_prompt

    def append_reply(self, ctx: CondensedEpisode, token_ids: list[int],  # type: ignore[override]
                     logprobs: list[float]) -> EnvInput:
        """Record the turn's row (prompt + generated ids verbatim) and parse the reply's actions.

        A reply cut by the length limit is kept as generated: no eos is added,
        since nothing follows it in its row.
        """
        ctx.num_turns += 1
        ctx.rows.append(TurnRow(turn=ctx.num_turns, prompt_ids=ctx.next_prompt, response_ids=list(token_ids),
                                logprobs=list(logprobs), anchor=anchor_id(ctx.observation)))
        env_input, parsed = self._parse_reply(ctx, token_ids)
        ctx.pending_answer = parsed.answer or NO_ANSWER
        return env_input

    def append_env_output(self, ctx: CondensedEpisode, out: EnvOutput,  # type: ignore[override]
                          response_length: int) -> None:
        """Put the turn's reward on its row; summarise the turn and render the next prompt.

        The episode ends when the env says done, or when the next prompt plus
        ``response_length`` would not fit in ``max_model_len`` (``truncated`` and ``context_overflow``).
        """
        ctx.rows[-1].reward += float(out.reward)
        ctx.history.append(TurnSummary(turn=ctx.num_turns, observation=ctx.observation, answer=ctx.pending_answer,
                                       reward=float(out.reward)))
        ctx.observation = out.observation
        if out.done:
            ctx.done = True
            return
        ctx.next_prompt = self._render_prompt(ctx)
        if len(ctx.next_prompt) + response_length > self.max_model_len:
            ctx.done = ctx.truncated = ctx.context_overflow = True

    def build_update_batch(self, episodes: list[CondensedEpisode],  # type: ignore[override]
                           uid_offset: int = 0) -> TensorBatch:
        """One row per played turn, episodes in order and each episode's turns in order.

        ``anchor_obs_ids`` is [B] here (one row per step, GiGPO's verl-agent layout):
        the anchor id of the observation each row's turn answered.
        """
        turns = [row for e in episodes for row in e.rows]
        rows = [row.training_row(e.group_id, e.env_id, e.tag) for e in episodes for row in e.rows]
        if not rows:
            raise RuntimeError("no episode played a turn, so the condensed batch has no row")
        batch = collate_rows(rows, self.pad_id, uid_offset)
        batch["anchor_obs_ids"] = torch.tensor([t.anchor for t in turns], dtype=torch.long)
        return batch

    def _render_prompt(self, ctx: CondensedEpisode) -> list[int]:
        n = self.keep_last_n_turns
        recent = ctx.history[-n:] if n > 0 else []
        user = condensed_user_message(ctx.instruction, recent, ctx.observation, ctx.num_turns + 1, self.enable_think)
        return self._chat_prompt_ids(user)
