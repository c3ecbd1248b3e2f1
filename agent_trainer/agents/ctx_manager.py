"""Context manager (``ctx_manager.mode: full``): environment text <-> token ids, one growing sequence per episode.

Token-in/token-out: the ids the rollout engine generated are appended to the
episode's sequence as they are and trained on; text is never re-tokenized
between turns. Only the text *around* the policy's replies (the first prompt,
and each later observation wrapped in the chat template) is tokenized here.

For one episode the sequence is::

    [system + user(instruction, obs_0) + assistant header]   mask 0  (prompt)
    [generated reply 1, ending in <|im_end|>]                 mask 1  reward r_1 on its last token
    [\\n + user(reward, obs_1) + assistant header]             mask 0  (observation)
    [generated reply 2]                                       mask 1  reward r_2 on its last token
    ...

``ctx_manager.mode: condensed`` (one row per turn, each prompt re-rendered
from a text summary) lives in ``agent_trainer.agents.condensed_ctx`` and shares
:class:`TrainingRow` and :func:`collate_rows` with this module.

:class:`ContextManager` is the default agent (``agent_trainer.agents``): the
interface is ``agents.base.Agent``, and the framework checks every batch an
agent builds against the token-in/token-out contract (``agents.contract``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent_trainer.common import prompts
from agent_trainer.agents.base import Agent
from agent_trainer.common.batch import TensorBatch
from agent_trainer.episode.es_manager import EnvInput, EnvOutput, safe_text

CTX_MODES = ("full", "condensed")
"""``ctx_manager.mode`` values: one row per episode, or one row per turn with condensed prompts."""
OBSERVATION_CACHE_SIZE = 4096
"""How many observation texts a context manager keeps tokenized (:meth:`ContextManager._observation_ids`)."""


@dataclass
class TrainingRow:
    """One row of the training batch before padding; the five lists have equal length."""

    token_ids: list[int]
    response_mask: list[int]
    rewards: list[float]
    rollout_log_probs: list[float]
    turn_ids: list[int]
    anchor_ids: list[int]
    """Per token: the anchor id (:func:`anchor_id`) of the observation its turn answered; 0 on turn 0."""
    group_id: int
    traj_id: int
    tag: str


COLLATED_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "token_level_rewards",
                 "rollout_log_probs", "turn_ids", "anchor_obs_ids", "uid", "traj_uid", "tag_ids")
"""The keys :func:`collate_rows` makes (the start-up check of an estimator's batch keys reads them)."""


def collate_rows(rows: list[TrainingRow], pad_id: int, uid_offset: int = 0) -> TensorBatch:
    """Right-pad ``rows`` into the batch contract of ``agent_trainer.common.batch``.

    ``uid`` = uid_offset + group id, ``traj_uid`` = uid_offset + episode id,
    ``tag_ids`` [B] int64 = the index of the row's env tag among the sorted tags
    of this batch (the grouping of ``reward_normalization.grouping=inductive``), and
    ``anchor_obs_ids`` [B, T] int64 = each token's ``anchor_ids`` (GiGPO's anchor states).
    """
    length = max(len(r.token_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length), dtype=torch.long)
    rewards = torch.zeros((n, length), dtype=torch.float32)
    logprobs = torch.zeros((n, length), dtype=torch.float32)
    turn_ids = torch.zeros((n, length), dtype=torch.long)
    anchor_ids = torch.zeros((n, length), dtype=torch.long)
    for i, r in enumerate(rows):
        t = len(r.token_ids)
        input_ids[i, :t] = torch.tensor(r.token_ids, dtype=torch.long)
        attention_mask[i, :t] = 1
        response_mask[i, :t] = torch.tensor(r.response_mask, dtype=torch.long)
        rewards[i, :t] = torch.tensor(r.rewards, dtype=torch.float32)
        logprobs[i, :t] = torch.tensor(r.rollout_log_probs, dtype=torch.float32)
        turn_ids[i, :t] = torch.tensor(r.turn_ids, dtype=torch.long)
        anchor_ids[i, :t] = torch.tensor(r.anchor_ids, dtype=torch.long)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tag_index = {tag: k for k, tag in enumerate(sorted({r.tag for r in rows}))}
    return TensorBatch(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "token_level_rewards": rewards,
            "rollout_log_probs": logprobs,
            "turn_ids": turn_ids,
            "anchor_obs_ids": anchor_ids,
            "uid": torch.tensor([uid_offset + r.group_id for r in rows], dtype=torch.long),
            "traj_uid": torch.tensor([uid_offset + r.traj_id for r in rows], dtype=torch.long),
            "tag_ids": torch.tensor([tag_index[r.tag] for r in rows], dtype=torch.long),
        }
    )


@dataclass(kw_only=True)
class EpisodeStatus:
    """What every episode record holds, whatever the context layout."""

    env_id: int
    group_id: int
    tag: str
    num_turns: int = 0
    done: bool = False
    truncated: bool = False
    context_overflow: bool = False
    """The episode ended because its next prompt plus the turn budget would exceed ``max_model_len``
    (``truncated`` is then set too); it keeps the rewards it earned."""
    format_errors: int = 0
    env_actor_lost: bool = False
    """The episode ended because its env actor died or missed its step deadline (infrastructure, not the
    policy): it is left out of the batch and of its group's statistics (``rollout/env_actor_lost``)."""

    @property
    def num_replies(self) -> int:
        """Replies the engine generated for the episode: one per turn for the built-in agents (a gateway agent's
        calls may be more or fewer than its env steps, ``num_turns``). An episode without one has nothing to
        train on."""
        return self.num_turns


@dataclass(kw_only=True)
class EpisodeContext(EpisodeStatus):
    """One episode's token sequence and its per-token annotations."""

    token_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    """0 on the prompt; k on the tokens of turn k (reply and the observation after it)."""
    anchor: int = 0
    """Anchor id of the current observation, the one the next turn answers (:func:`anchor_id`)."""
    turn_anchors: list[int] = field(default_factory=lambda: [0])
    """turn_anchors[k]: the anchor id of the observation turn k answered (0 for the prompt, k = 0)."""

    @property
    def total_reward(self) -> float:
        """The episode's total reward (every turn's reward and format penalty)."""
        return float(sum(self.rewards))

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the engine generated over the episode."""
        return int(sum(self.response_mask))

    @property
    def longest_row(self) -> int:
        """Length of the episode's longest training row (here its one row: the whole sequence)."""
        return len(self.token_ids)

    def extend(self, ids: list[int], generated: bool, logprobs: list[float] | None = None) -> None:
        """Append ``ids``; generated ids get mask 1 and their rollout logprobs."""
        self.token_ids.extend(ids)
        self.response_mask.extend([int(generated)] * len(ids))
        self.rollout_log_probs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.rewards.extend([0.0] * len(ids))
        self.turn_ids.extend([self.num_turns] * len(ids))


class ContextManager(Agent):
    """Builds prompts from environment outputs and turns replies into env inputs (the default agent).

    Works with any tokenizer that has a chat template (ChatML for the tiny
    model and Qwen).
    """

    def __init__(self, tokenizer, *, enable_think: bool = True, action_sep: str = "||", max_model_len: int = 2048):
        self.tokenizer = tokenizer
        self.enable_think = enable_think
        self.action_sep = action_sep
        self.max_model_len = max_model_len
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; the rollout needs one to end each reply")
        self.eos_token_id: int = tokenizer.eos_token_id
        self._check_chat_template()
        self._observation_cache: dict[str, tuple[int, ...]] = {}
        """The message (as sorted JSON) -> :meth:`_observation_ids`, and a first prompt's text and tools ->
        :meth:`_chat_prompt_ids`: episodes of a group, and later steps, see the same observations again, and
        rendering the template was most of the driver's per-turn work (and a third of its rollout work at
        the resets). Cleared when it holds :data:`OBSERVATION_CACHE_SIZE` texts."""

    # -- prompts -------------------------------------------------------------------------
    def start(self, out: EnvOutput) -> EpisodeContext:
        """A new episode from its reset output: the first prompt (mask 0)."""
        ctx = EpisodeContext(env_id=out.env_id, group_id=out.group_id, tag=out.tag, anchor=anchor_id(out.observation))
        user = prompts.first_user_message(out.instruction, out.observation, self.enable_think)
        ctx.extend(self._chat_prompt_ids(user), generated=False)
        return ctx

    def prompt_ids(self, ctx: EpisodeContext) -> list[int]:
        """The ids the engine continues for the episode's next turn: the whole sequence so far."""
        return ctx.token_ids

    def append_reply(self, ctx: EpisodeContext, token_ids: list[int], logprobs: list[float]) -> EnvInput:
        """Append the generated ids (mask 1) and parse them into the env's actions.

        A reply cut by the length limit gets an eos appended with mask 0 (the
        policy did not generate it) so the next turn's template lines up.
        """
        ctx.num_turns += 1
        ctx.turn_anchors.append(ctx.anchor)
        ctx.extend(list(token_ids), generated=True, logprobs=list(logprobs))
        if not token_ids or token_ids[-1] != self.eos_token_id:
            ctx.extend([self.eos_token_id], generated=False)
        return self._parse_reply(ctx, token_ids)[0]

    def _parse_reply(self, ctx: EpisodeStatus, token_ids: list[int]) -> tuple[EnvInput, prompts.ParsedResponse]:
        """Decode a reply and parse its actions (untrusted text: never raises); count a format error."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        parsed = prompts.parse_response(text, self.action_sep, self.enable_think)
        if not parsed.format_ok:
            ctx.format_errors += 1
        return EnvInput(env_id=ctx.env_id, llm_response=text, actions=parsed.actions), parsed

    def append_env_output(self, ctx: EpisodeContext, out: EnvOutput, response_length: int) -> None:
        """Put the turn's reward on its last generated token; append the next observation.

        The episode ends when the env says done, or when the next turn would
        not fit in ``max_model_len`` (``truncated`` and ``context_overflow``).
        """
        last_generated = next((i for i in range(len(ctx.response_mask) - 1, -1, -1) if ctx.response_mask[i]), None)
        if last_generated is not None:  # nothing generated yet (an empty first reply): no token to credit
            ctx.rewards[last_generated] += float(out.reward)
        if out.done:
            ctx.done = True
            return
        ctx.anchor = anchor_id(out.observation)
        ids = self._observation_ids(self._turn_messages(ctx, out))
        if len(ctx.token_ids) + len(ids) + response_length > self.max_model_len:
            ctx.done = ctx.truncated = ctx.context_overflow = True
            return
        ctx.extend(ids, generated=False)

    def _next_message(self, out: EnvOutput) -> dict:
        """The chat message that shows the policy a step's reward and the next observation."""
        return {"role": "user", "content": prompts.next_user_message(out.observation, out.reward, self.enable_think)}

    def _turn_messages(self, ctx: EpisodeContext, out: EnvOutput) -> list[dict]:
        """The messages appended after a turn's reply: :meth:`_next_message` (the tool-calling agent puts its
        tools' answers first)."""
        return [self._next_message(out)]

    # -- batch ---------------------------------------------------------------------------
    def build_update_batch(self, episodes: list[EpisodeContext], uid_offset: int = 0) -> TensorBatch:
        """One row per episode, right-padded: the batch contract of ``agent_trainer.common.batch``."""
        rows = [TrainingRow(token_ids=e.token_ids, response_mask=e.response_mask, rewards=e.rewards,
                            rollout_log_probs=e.rollout_log_probs, turn_ids=e.turn_ids,
                            anchor_ids=[e.turn_anchors[k] for k in e.turn_ids], group_id=e.group_id,
                            traj_id=e.env_id, tag=e.tag) for e in episodes]
        return collate_rows(rows, self.pad_id, uid_offset)

    @property
    def pad_id(self) -> int:
        """The tokenizer's pad id (its eos when it has none); padding always has attention 0."""
        return pad_token_id(self.tokenizer)

    def _chat_prompt_ids(self, user_message: str, tools: list[dict] | None = None) -> list[int]:
        """System message + one user message + the assistant header, tokenized by the chat template.

        ``tools`` (JSON schemas) go to the template's own tool format (``apply_chat_template(tools=...)``).
        """
        messages = [{"role": "system", "content": prompts.SYSTEM_PROMPT},
                    {"role": "user", "content": safe_text(user_message)}]
        return self._cached_ids(json.dumps({"first": messages, "tools": tools}, sort_keys=True), lambda: as_ids(
            self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)))

    # -- chat-template plumbing ----------------------------------------------------------
    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    _BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def _observation_ids(self, message: dict | str | list[dict]) -> list[int]:
        """Ids the chat template puts after an assistant's eos for new messages plus the next header.

        ``message`` is a chat message (``{"role": "tool", "content": ...}``), a user message's text, or a list of
        messages. Each distinct message (list) is rendered once (:meth:`_render_observation`) and then read from a
        cache.
        """
        if isinstance(message, str):
            message = {"role": "user", "content": message}
        messages = [message] if isinstance(message, dict) else list(message)
        key = json.dumps(messages[0] if len(messages) == 1 else messages, sort_keys=True)
        return self._cached_ids(key, lambda: self._render_observation(messages))

    def _cached_ids(self, key: str, render: Callable[[], list[int]]) -> list[int]:
        """``render()`` once per ``key`` (see ``_observation_cache``); the caller gets its own list."""
        if key not in self._observation_cache:
            if len(self._observation_cache) >= OBSERVATION_CACHE_SIZE:
                self._observation_cache.clear()
            self._observation_cache[key] = tuple(render())
        return list(self._observation_cache[key])

    def _render_observation(self, messages: dict | list[dict]) -> list[int]:
        """Found by rendering a conversation with and without the new message(s) (templates differ: ChatML puts
        a newline after the eos), so no template is assumed."""
        messages = [messages] if isinstance(messages, dict) else messages
        base = self._render(self._BASE, add_generation_prompt=False)
        full = self._render(self._BASE + [dict(m, content=safe_text(m["content"])) for m in messages],
                            add_generation_prompt=True)
        eos_text = self.tokenizer.decode([self.eos_token_id])
        cut = base.rfind(eos_text) + len(eos_text)
        return self._encode(full[cut:])

    def _check_chat_template(self) -> None:
        eos_text = self.tokenizer.decode([self.eos_token_id])
        base = self._render(self._BASE, add_generation_prompt=False)
        full = self._render(self._BASE + [{"role": "user", "content": "x"}], add_generation_prompt=True)
        if base.rfind(eos_text) < 0 or not full.startswith(base[: base.rfind(eos_text)]):
            raise ValueError(
                f"the tokenizer's chat template must end assistant messages with the eos token {eos_text!r} and "
                "render a conversation as a prefix of its continuation; multi-turn token-in/token-out relies on it"
            )


def pad_token_id(tokenizer) -> int:
    """The id a batch pads with: the tokenizer's pad id, its eos when it has none (padding has attention 0)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def anchor_id(observation: str) -> int:
    """GiGPO anchor-state id of an observation text: its blake2b digest, 63 bits (a non-negative int64).

    Equal texts give equal ids in every process and run (Python's ``hash`` of a str is
    salted per process); distinct texts collide with probability about 2**-63 per pair.
    """
    digest = hashlib.blake2b(observation.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class FullConversation:
    """A condenser's trajectory as ``ctx_manager.mode=full`` lays it out (its ``conversation``,
    :class:`agent_trainer.condensers.layouts.ConversationLayout`): the task prompt and one segment per step, rendered
    by a :class:`ContextManager` without a length limit (built on first use)."""

    def __init__(self, tokenizer, enable_think: bool = True, action_sep: str = "||"):
        self.tokenizer, self.enable_think, self.action_sep = tokenizer, enable_think, action_sep

    @functools.cached_property
    def ctx(self) -> ContextManager:
        return ContextManager(self.tokenizer, enable_think=self.enable_think, action_sep=self.action_sep,
                              max_model_len=sys.maxsize)

    def segments(self, traj) -> tuple[list[int], list[list[int]]]:
        """(first prompt ids, [o_k (+ eos) + observation-after-k ids for every step k])."""
        ep = self.ctx.start(_env_output(traj.instruction, traj.first_observation, 0.0))
        task = list(ep.token_ids)
        segments, mark = [], len(task)
        for step in traj.steps:
            self.ctx.append_reply(ep, step.output_ids, [0.0] * len(step.output_ids))
            self.ctx.append_env_output(ep, _env_output(traj.instruction, step.observation, step.reward),
                                       response_length=0)
            segments.append(list(ep.token_ids[mark:]))
            mark = len(ep.token_ids)
        return task, segments


def _env_output(instruction: str, observation: str, reward: float) -> EnvOutput:
    return EnvOutput(env_id=0, group_id=0, tag="", observation=observation, instruction=instruction,
                     reward=reward, done=False, info={})


def as_ids(ids) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns a list or a BatchEncoding depending on the version."""
    if hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
