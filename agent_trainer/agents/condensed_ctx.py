"""Condensed context (``ctx_manager.mode: condensed``): each turn's prompt is built by a condenser; one row per turn.

For turn k+1 of an episode the prompt c_{k+1} is built by the configured
``ContextCondenser`` (``multiturn_trajectory.context_condenser.type``,
``agent_trainer.condensers``) from the task, every earlier (c_j, o_j) and the
environment's observations, within ``max_condensed_tokens`` tokens. The default,
``simple``, renders a fresh chat prompt::

    system:    SYSTEM_PROMPT
    user:      env instruction
               Recent turns (the last n):           (absent on turn 1, or with keep_last_n_steps = 0)
               Turn j: observation, answer, reward   for each of the last n turns
               Current observation (turn k): ...
               reply format
    assistant header

and the reply o_k is the engine's ids verbatim. The training row of the turn is
c_k + o_k with ``response_mask`` 1 exactly on o_k: what is trained is
token-in/token-out, the context is built text (mask 0). A row is at most the
budget plus ``response_length`` tokens however many turns the episode has,
which is the point of condensation (multi-conversation GRPO as in MemAgent,
Yu et al. 2025, arXiv:2507.02259).

A condenser that needs the policy to write part of the context (``summary``)
asks for it through :meth:`CondensedContextManager.write_summaries`, which the
rollout calls once per turn with its engines; those tokens are context only and
never become a row.

Every row of an episode has ``traj_uid`` = the episode id and ``uid`` = its
group id; ``turn_ids`` is k on o_k and 0 on c_k; ``anchor_obs_ids`` [B] is the
hashed observation the row's turn answered (GiGPO's one-row-per-step layout). Each turn's reward (env reward
plus format penalty, times ``reward_computation.env_reward_weight`` when trajectory rewards are on) sits on the
last generated token of its row; with ``reward_computation.enable`` the trajectory reward R (times its weight)
is added on the last row's last token at the end of the rollout. So the sum of an episode's token rewards over
its rows is the episode's total reward: exactly the trajectory score S_j that
``compute_grpo_multiturn_advantage`` sums over the rows of trajectory j.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from agent_trainer.agents.base import SummaryGenerate, agent_options
from agent_trainer.common.batch import TensorBatch
from agent_trainer.condensers import (
    SummaryCall,
    SummaryRequest,
    TrajectorySoFar,
    make_condenser,
)
from agent_trainer.condensers.layouts import NO_ANSWER, TurnSummary, condensed_user_message  # noqa: F401 (re-exported)
from agent_trainer.config import condenser_config
from agent_trainer.config.multiturn import ContextCondenserConfig
from agent_trainer.agents.ctx_manager import (ContextManager, EpisodeStatus, FullConversation, TrainingRow, anchor_id,
                                              collate_rows)
from agent_trainer.episode.es_manager import EnvInput, EnvOutput
from agent_trainer.trajectory_rewards import (
    BatchRewards,
    BatchTrajectoryRewardComputer,
    FinishedTrajectory,
    GroundTruth,
    RewardComputationConfig,
    TrajectoryReward,
)



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
    uncondensed_tokens: int = 0
    """Length the turn's prompt would have had with nothing condensed (the ``full`` conversation), in tokens."""
    condense_seconds: float = 0.0
    """Time spent building the turn's prompt (a summary's generation included)."""

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
class PendingPrompt:
    """The next prompt of an episode, once the policy has written what its condenser asked for."""

    request: SummaryRequest
    response_length: int


@dataclass(kw_only=True)
class CondensedEpisode(EpisodeStatus):
    """One episode in condensed mode: its played turns and the trajectory its next prompt is condensed from."""

    instruction: str
    observation: str
    """The current observation (the next prompt shows it)."""
    traj: TrajectorySoFar
    next_prompt: list[int] = field(default_factory=list)
    """The condensed prompt ids of the next turn."""
    next_uncondensed: int = 0
    next_condense_seconds: float = 0.0
    rows: list[TurnRow] = field(default_factory=list)
    pending: PendingPrompt | None = None
    """Set while the condenser waits for the policy's summary (``write_summaries``)."""
    summaries: list[SummaryCall] = field(default_factory=list)
    """Every summary the policy wrote for this episode (context only, never trained on)."""
    question_id: str = ""
    """The question environment's row id (``info["question_id"]``), for ``reward_computation.ground_truth_file``."""
    ground_truth: Any = None
    """The row's ground truth as the environment reported it (``info["ground_truth"]``)."""
    trajectory_reward: TrajectoryReward | None = None
    """With reward_computation.enable: the computer's verdict (set by ``build_update_batch``)."""

    @property
    def total_reward(self) -> float:
        """The episode's total reward (every turn's reward and format penalty)."""
        return float(sum(r.reward for r in self.rows))

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the engine generated over the episode (summaries excluded)."""
        return sum(len(r.response_ids) for r in self.rows)

    @property
    def longest_row(self) -> int:
        """Length of the episode's longest training row (prompt + reply of one turn)."""
        return max((len(r.prompt_ids) + len(r.response_ids) for r in self.rows), default=len(self.next_prompt))


class CondensedContextManager(ContextManager):
    """Builds each turn's prompt through a ``ContextCondenser``; scores finished trajectories when configured.

    Same interface as :class:`ContextManager` (``start``, ``prompt_ids``,
    ``append_reply``, ``append_env_output``, ``build_update_batch``), so the
    rollout loop is the same for both modes, plus :meth:`write_summaries` for
    condensers that ask the policy to write (``summary``).
    """

    layout = "condensed"

    def __init__(self, tokenizer, *, keep_last_n_turns: int = 2, condenser: ContextCondenserConfig | None = None,
                 rewards: RewardComputationConfig | None = None, enable_think: bool = True, action_sep: str = "||",
                 max_model_len: int = 2048):
        """``condenser`` must have keep_last_n_steps and max_condensed_tokens resolved
        (``agent_trainer.config.condenser_config``); None = ``simple`` with ``keep_last_n_turns`` and the whole
        ``max_model_len`` as budget. ``rewards`` with ``enable`` scores each finished trajectory."""
        super().__init__(tokenizer, enable_think=enable_think, action_sep=action_sep, max_model_len=max_model_len)
        if keep_last_n_turns < 0:
            raise ValueError(f"keep_last_n_turns = {keep_last_n_turns} must be >= 0 (0 = no history)")
        if condenser is None:
            condenser = ContextCondenserConfig(type="simple", keep_last_n_steps=keep_last_n_turns,
                                               max_condensed_tokens=max_model_len)
        self.condenser = make_condenser(condenser, tokenizer, enable_think=enable_think, action_sep=action_sep,
                                        conversation=FullConversation(tokenizer, enable_think, action_sep))
        self.rewards = BatchTrajectoryRewardComputer.from_config(rewards) if rewards and rewards.enable else None
        self.reward_config = rewards
        self.last_rewards: BatchRewards | None = None
        """The trajectory rewards of the last ``build_update_batch`` (for metrics and profiling)."""

    @classmethod
    def from_config(cls, cfg, tokenizer) -> CondensedContextManager:
        """The run's condenser (``multiturn_trajectory.context_condenser``) and trajectory rewards
        (``reward_computation``) besides the common agent options."""
        return cls(tokenizer, condenser=condenser_config(cfg), rewards=cfg.reward_computation, **agent_options(cfg))

    @property
    def keep_last_n_turns(self) -> int:
        return self.condenser.config.keep_last_n_steps

    # -- the turn loop -------------------------------------------------------------------
    def start(self, out: EnvOutput) -> CondensedEpisode:  # type: ignore[override]
        """A new episode from its reset output; builds the first prompt."""
        ep = CondensedEpisode(env_id=out.env_id, group_id=out.group_id, tag=out.tag, instruction=out.instruction,
                              observation=out.observation,
                              traj=TrajectorySoFar(instruction=out.instruction, first_observation=out.observation))
        self._condense(ep)
        return ep

    def prompt_ids(self, ctx: CondensedEpisode) -> list[int]:  # type: ignore[override]
        """The ids the engine continues for the next turn: that turn's condensed prompt."""
        return ctx.next_prompt

    def append_reply(self, ctx: CondensedEpisode, token_ids: list[int],  # type: ignore[override]
                     logprobs: list[float]) -> EnvInput:
        """Record the turn's row (prompt + generated ids verbatim) and parse the reply's actions.

        A reply cut by the length limit is kept as generated: no eos is added,
        since nothing follows it in its row.
        """
        ctx.num_turns += 1
        ctx.rows.append(TurnRow(turn=ctx.num_turns, prompt_ids=ctx.next_prompt, response_ids=list(token_ids),
                                logprobs=list(logprobs), anchor=anchor_id(ctx.observation),
                                uncondensed_tokens=ctx.next_uncondensed, condense_seconds=ctx.next_condense_seconds))
        return self._parse_reply(ctx, token_ids)[0]

    def append_env_output(self, ctx: CondensedEpisode, out: EnvOutput,  # type: ignore[override]
                          response_length: int) -> None:
        """Put the turn's reward on its row; record the step and condense the next prompt.

        The episode ends when the env says done, or when the next prompt plus
        ``response_length`` would not fit in ``max_model_len`` (``truncated`` and
        ``context_overflow``). When the condenser needs the policy to write first,
        the prompt waits for :meth:`write_summaries`.
        """
        row = ctx.rows[-1]
        weight = self.reward_config.env_reward_weight if self.rewards is not None else 1.0
        row.reward += weight * float(out.reward)
        ctx.traj.add_step(row.prompt_ids, row.response_ids, out.observation, float(out.reward))
        ctx.observation = out.observation
        if "question_id" in out.info:
            ctx.question_id, ctx.ground_truth = str(out.info["question_id"]), out.info.get("ground_truth")
        if out.done:
            ctx.done = True
            return
        request = self.condenser.summary_request(ctx.traj)
        if request is not None:
            ctx.pending = PendingPrompt(request, response_length)
            return
        self._next_prompt(ctx, response_length)

    def write_summaries(self, episodes: Iterable[CondensedEpisode], generate: SummaryGenerate) -> int:
        """Generate every pending request of the active ``episodes`` in one call, then build their prompts.

        ``generate`` is the rollout's engine call. The summary ids are kept on the
        episode (``summaries``) and in the next context; they never become a row.
        Returns the number of summaries written.
        """
        waiting = [e for e in episodes if not e.done and e.pending is not None]
        if not waiting:
            return 0
        start = time.perf_counter()
        outputs = generate([e.pending.request.prompt_ids for e in waiting],
                           [e.pending.request.max_tokens for e in waiting], self.condenser.config.summary_temperature)
        seconds = time.perf_counter() - start
        for ep, (ids, _) in zip(waiting, outputs):
            pending, ep.pending = ep.pending, None
            ep.summaries.append(self.condenser.accept_summary(ep.traj, pending.request, ids, seconds / len(waiting)))
            self._next_prompt(ep, pending.response_length, extra_seconds=seconds / len(waiting))
        return len(waiting)

    def _next_prompt(self, ctx: CondensedEpisode, response_length: int, extra_seconds: float = 0.0) -> None:
        self._condense(ctx, extra_seconds)
        if len(ctx.next_prompt) + response_length > self.max_model_len:
            ctx.done = ctx.truncated = ctx.context_overflow = True

    def _condense(self, ctx: CondensedEpisode, extra_seconds: float = 0.0) -> None:
        condensed = self.condenser.condense(ctx.traj)
        ctx.traj.remember(condensed)
        ctx.next_prompt = condensed.token_ids
        ctx.next_uncondensed = condensed.num_tokens_before
        ctx.next_condense_seconds = condensed.seconds + extra_seconds

    # -- batch ---------------------------------------------------------------------------
    def build_update_batch(self, episodes: list[CondensedEpisode],  # type: ignore[override]
                           uid_offset: int = 0) -> TensorBatch:
        """One row per played turn, episodes in order and each episode's turns in order.

        With ``reward_computation.enable`` each episode's trajectory reward (times
        ``trajectory_reward_weight``) is first added on its last row's reward.
        ``anchor_obs_ids`` is [B] here (one row per step, GiGPO's verl-agent layout):
        the anchor id of the observation each row's turn answered.
        """
        if self.rewards is not None:
            self.score_trajectories([e for e in episodes if e.rows])
        turns = [row for e in episodes for row in e.rows]
        rows = [row.training_row(e.group_id, e.env_id, e.tag) for e in episodes for row in e.rows]
        if not rows:
            raise RuntimeError("no episode played a turn, so the condensed batch has no row")
        batch = collate_rows(rows, self.pad_id, uid_offset)
        batch["anchor_obs_ids"] = torch.tensor([t.anchor for t in turns], dtype=torch.long)
        return batch

    def score_trajectories(self, episodes: list[CondensedEpisode]) -> BatchRewards:
        """The trajectory reward of each episode (in parallel), added on its last row; kept in ``last_rewards``."""
        # An episode none of whose replies reached the env (no valid action, or an env error) answered nothing: 0.
        known = [e for e in episodes if e.question_id or e.ground_truth is not None]
        result = self.rewards.compute_batch([self.finished_trajectory(e) for e in known])
        by_episode = dict(zip(map(id, known), result.rewards))
        result.rewards = [by_episode.get(id(e)) or TrajectoryReward(
            reward=0.0, format_ok=False, correct=False, max_context_length=e.longest_row,
            reason="format: no reply was a valid action, so the environment never saw the question") for e in episodes]
        weight = self.reward_config.trajectory_reward_weight
        for ep, reward in zip(episodes, result.rewards):
            ep.trajectory_reward = reward
            ep.rows[-1].reward += weight * reward.reward
        self.last_rewards = result
        return result

    def finished_trajectory(self, ep: CondensedEpisode) -> FinishedTrajectory:
        """What the reward computer sees: decoded outputs, the longest row in tokens, the row's ground truth."""
        where = f"question {ep.question_id!r} (env_id {ep.env_id})"
        truth = ground_truth_of(ep.ground_truth, where) if ep.ground_truth is not None else None
        return FinishedTrajectory(
            question_id=ep.question_id, ground_truth=truth, max_context_length=ep.longest_row,
            outputs=[self.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in ep.rows])


def ground_truth_of(value: Any, where: str) -> GroundTruth:
    """A dataset row's ground truth as a ``GroundTruth``: an answer (text, number, list) or {answer|tests: ...}."""
    record = value if isinstance(value, dict) else {"answer": value}
    return GroundTruth.from_record(record, where)
