"""The agents of a gateway rollout (``agent_proxy.gateway.agent``, docs/gateway.md): a user's function written
against the ``openai`` client plays each episode, so the agent only starts episodes from the env resets and builds
the training rows from its session's calls (:func:`training_rows`); the turn loop is the user's
(``agent_trainer.rollout.gateway``)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from agent_trainer.agents.base import Agent
from agent_trainer.agents.ctx_manager import EpisodeStatus, TrainingRow, anchor_id, collate_rows, pad_token_id
from agent_trainer.episode.es_manager import EnvOutput
from agent_trainer.gateway.sessions import CallRecord, RowMetrics, episode_rows

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class GatewayEpisode(EpisodeStatus):
    """One episode played by a gateway agent: its session's calls, its env steps and the rows built from them."""

    instruction: str
    observation: str
    anchor: int
    """The reset observation's anchor id (GiGPO's anchor state of the first call)."""
    records: list[CallRecord] = field(default_factory=list)
    steps: list[tuple[int, float, int]] = field(default_factory=list)
    """Per env step: (requests the agent had made before it, its reward, the anchor id of the observation after it)."""
    returned_reward: float | None = None
    """The float the agent returned, which replaces the env's rewards; None: the env's rewards."""
    rows: list = field(default_factory=list)
    """``gateway.sessions.TrainingRow`` s of the episode (built when its agent returned)."""
    row_metrics: RowMetrics = field(default_factory=lambda: RowMetrics(0, 0, 0))

    def finish(self) -> None:
        """The agent returned and its session closed: its calls become rows; its turns are its env steps."""
        self.rows, self.row_metrics = episode_rows(self.records)
        self.num_turns = len(self.steps)

    def step_calls(self) -> list[int]:
        """Per env step, the number (1-based) of the call whose reply led to it: the last call made before it
        (0: none), as ``EpisodeState.turn_replies`` pairs them in the trajectories."""
        return [before for before, _, _ in self.steps]

    @property
    def num_replies(self) -> int:
        """The chat completions the agent made (``num_turns`` counts its env steps)."""
        return len({r.request_index for r in self.records})

    @property
    def total_reward(self) -> float:
        if self.returned_reward is not None:
            return self.returned_reward
        return float(sum(reward for _, reward, _ in self.steps))

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(r.completion_ids) for r in self.records)

    @property
    def longest_row(self) -> int:
        return max((len(row.input_ids) for row in self.rows), default=0)


class GatewayAgent(Agent):
    """The agent of a gateway rollout: episodes come from the env resets, rows from the sessions' calls. The
    turn-by-turn methods are not used (the user's function owns the loop)."""

    layout = "full"

    def __init__(self, tokenizer, **_):
        self.tokenizer = tokenizer

    def start(self, out: EnvOutput) -> GatewayEpisode:
        return GatewayEpisode(env_id=out.env_id, group_id=out.group_id, tag=out.tag, instruction=out.instruction,
                              observation=out.observation, anchor=anchor_id(out.observation))

    def prompt_ids(self, ctx):
        raise NotImplementedError("a gateway agent's prompts come from its own calls (GatewayLoop)")

    def append_reply(self, ctx, token_ids, logprobs):
        raise NotImplementedError("a gateway agent's replies go to its own code (GatewayLoop)")

    def append_env_output(self, ctx, out, response_length):
        raise NotImplementedError("a gateway agent steps its env through task.step (GatewayLoop)")

    def build_update_batch(self, episodes: list[GatewayEpisode], uid_offset: int = 0):
        """Every episode's rows: one (merged) or one per call (step-wise, when its calls did not continue each
        other); the rows of an episode share its ``traj_uid``, so the estimators read them as that one episode
        (``core_algos.compute_advantage``), in either layout."""
        rows = [row for e in episodes for row in training_rows(e)]
        return collate_rows(rows, pad_token_id(self.tokenizer), uid_offset)


class CondensedGatewayAgent(GatewayAgent):
    """``ctx_manager.mode=condensed``: the same rows, for the per-trajectory estimators (grpo_multiturn)."""

    layout = "condensed"


def training_rows(episode: GatewayEpisode) -> list[TrainingRow]:
    """The episode's rows in the batch's layout: sampled ids under the mask with the engine's logprobs, each step's
    reward on the last token of the reply before it (the agent's returned reward on the last reply), ``turn_ids``
    the call's number (1-based) on its reply and on the context after it (0 on a row's first prompt), and on the
    same tokens the anchor of the observation the call answered (0 on the first prompt), as the built-in agents."""
    order = sorted(episode.records, key=lambda r: (r.request_index, r.choice_index))
    anchor_of = _call_anchors(episode, max((r.request_index for r in order), default=-1) + 1)
    credit: Counter[int] = Counter()
    if episode.returned_reward is not None:
        credit[order[-1].request_index] += episode.returned_reward
    else:
        for before, reward, _ in episode.steps:
            credit[max(before - 1, 0)] += reward
    out = []
    for row in episode.rows:
        rewards, turn_ids, anchors = [0.0] * len(row.input_ids), [0] * len(row.input_ids), [0] * len(row.input_ids)
        turn = anchor = 0  # as the built-in agents lay a row out: the context before a reply belongs to the turn
        for (request, choice), (context_start, start, end) in zip(row.calls, row.spans):  # before it (0: the prompt)
            for k in range(context_start, start):
                turn_ids[k], anchors[k] = turn, anchor
            turn, anchor = request + 1, anchor_of[request]
            for k in range(start, end):
                turn_ids[k], anchors[k] = turn, anchor
            if choice == 0 and request in credit and end > start:
                rewards[end - 1] += credit.pop(request)
        out.append(TrainingRow(token_ids=list(row.input_ids), response_mask=list(row.response_mask), rewards=rewards,
                               rollout_log_probs=list(row.rollout_log_probs), turn_ids=turn_ids, anchor_ids=anchors,
                               group_id=episode.group_id, traj_id=episode.env_id, tag=episode.tag))
    if credit and out:  # a reward of a call without sampled ids: on the episode's last sampled token
        last = out[-1]
        at = max((k for k, m in enumerate(last.response_mask) if m), default=len(last.token_ids) - 1)
        last.rewards[at] += sum(credit.values())
    return out


def _call_anchors(episode: GatewayEpisode, calls: int) -> list[int]:
    """Per call: the anchor id of the observation the agent had when it made the call."""
    anchors, current, steps = [], episode.anchor, iter(sorted(episode.steps, key=lambda s: s[0]))
    pending = next(steps, None)
    for call in range(calls):
        while pending is not None and pending[0] <= call:
            current, pending = pending[2], next(steps, None)
        anchors.append(current)
    return anchors
