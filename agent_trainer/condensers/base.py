"""The ContextCondenser interface: typed trajectory in, the next context's token ids out, within a token budget.

Multi-turn GRPO with context condensation (seed 004) generates a trajectory
[(c_1, o_1), (c_2, o_2), ...]: each step's output o_k is the engine's ids
verbatim (trained on), each context c_k is built by a condenser from the task,
the earlier contexts and outputs, and the environment's observations. A
condenser returns c_{k+1}; every one of its tokens is context (loss mask 0).

The budget ``max_condensed_tokens`` is measured in tokens of the policy's
tokenizer and enforced here, in ``ContextCondenser.condense``, for every
strategy (user-written ones included): a draft over budget keeps its task
prefix (at most half the budget) and its most recent tokens, and says so
(``truncated``, ``task_truncated``).

Strategies register by name (``register_condenser("name")``) and are looked up
by that name or by a "package.module:ClassName" import path.

A condenser may ask the policy to write part of the context (``summary``): it
returns a :class:`SummaryRequest` from ``summary_request``; the rollout generates
every pending request in one batched engine call and hands the ids back through
``accept_summary``, after which ``condense`` uses them. Standalone (tests, tools),
a ``generate`` callable does the same synchronously.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Callable

from agent_trainer.common import prompts
from agent_trainer.condensers.layouts import ConversationLayout
from agent_trainer.config.multiturn import ContextCondenserConfig
from agent_trainer.common.plugins import PluginRegistry

EMPTY_SUMMARY = "(no summary)"
"""What a context shows for a summary the policy left blank."""
GenerateFn = Callable[[list[int], int], list[int]]
"""``generate(prompt_ids, max_tokens) -> token ids``: the rollout engine, for condensers that call the policy."""
"""How text layouts show a past step's output: its <answer> text only, or the whole reply verbatim."""


@dataclass
class StepRecord:
    """One played step k: the context it was generated from, what the engine generated, what came back."""

    context_ids: list[int]
    """c_k: the token ids the engine continued."""
    output_ids: list[int]
    """o_k: the engine's generated ids, verbatim."""
    observation: str
    """The environment's observation after o_k."""
    reward: float = 0.0
    """The environment's reward for the step (text layouts show it)."""


@dataclass
class SummaryCall:
    """One summary the policy wrote of older steps. Its tokens are context only: never trained on."""

    prompt_ids: list[int]
    output_ids: list[int]
    """The engine's ids; no training row is made of them (``loss_mask`` is all 0)."""
    text: str
    covers_steps: int
    """The summary covers steps 1..covers_steps."""
    seconds: float
    """Time spent in ``generate``."""

    @property
    def loss_mask(self) -> list[int]:
        """All 0: summary tokens are never in the loss."""
        return [0] * len(self.output_ids)


@dataclass
class SummaryRequest:
    """Text a condenser wants the policy to write before it can build the next context (e.g. a summary)."""

    prompt_ids: list[int]
    """What the engine continues (a chat prompt ending in the assistant header)."""
    max_tokens: int
    """Most tokens the engine may generate for it."""
    covers_steps: int
    """The summary will cover steps 1..covers_steps."""


@dataclass
class TrajectorySoFar:
    """The task and every step played so far (the condenser's input)."""

    instruction: str
    """The task text (env instruction or question)."""
    first_observation: str
    """The observation the first step answered."""
    steps: list[StepRecord] = field(default_factory=list)
    summary: SummaryCall | None = None
    """The latest policy-written summary of older steps (kept by ``remember``; reused while it is current)."""

    def add_step(self, context_ids: list[int], output_ids: list[int], observation: str, reward: float = 0.0) -> None:
        self.steps.append(StepRecord(list(context_ids), list(output_ids), observation, float(reward)))

    def remember(self, condensed: "CondensedContext") -> None:
        """Keep a summary the condenser just generated, so the next call extends it instead of starting over."""
        if condensed.summary is not None:
            self.summary = condensed.summary

    def observation_before(self, k: int) -> str:
        """The observation step k (1-based) answered."""
        return self.first_observation if k == 1 else self.steps[k - 2].observation

    @property
    def current_observation(self) -> str:
        return self.steps[-1].observation if self.steps else self.first_observation

    @property
    def longest_row(self) -> int:
        """max_k len(c_k) + len(o_k): the trajectory's max_context_length in tokens."""
        return max((len(s.context_ids) + len(s.output_ids) for s in self.steps), default=0)


@dataclass
class CondensedContext:
    """The next context c_{k+1} and what condensing it cost."""

    token_ids: list[int]
    num_tokens_before: int
    """Length of the uncondensed conversation (the ``full`` layout, nothing dropped) in tokens."""
    num_tokens_after: int
    """len(token_ids) <= max_condensed_tokens."""
    seconds: float
    """Wall time of the whole call (summary generation included)."""
    kept_steps: int = 0
    """Past steps shown in the context (verbatim or recapped)."""
    truncated: bool = False
    """The budget forced content out: steps dropped or tokens cut."""
    task_truncated: bool = False
    """Even the task prefix did not fit in half the budget and was cut in the middle."""
    summary: SummaryCall | None = None
    """A summary generated by this call (None when none was needed or the remembered one was reused)."""

    @property
    def tokens_saved(self) -> int:
        return self.num_tokens_before - self.num_tokens_after

    @property
    def loss_mask(self) -> list[int]:
        """All 0: a context is never trained on (summary text included)."""
        return [0] * len(self.token_ids)


@dataclass
class Draft:
    """What a strategy built, before the budget check."""

    token_ids: list[int]
    head_len: int
    """Tokens at the start that hold the task; kept (up to half the budget) when the draft is clipped."""
    kept_steps: int
    dropped_for_budget: bool = False
    summary: SummaryCall | None = None
    uncondensed: int | None = None
    """Length of the full conversation when the strategy built it anyway (else ``condense`` computes it)."""


def fit_to_budget(ids: list[int], budget: int, head_len: int) -> tuple[list[int], bool, bool]:
    """Clip ``ids`` to ``budget`` tokens: the first min(head_len, budget // 2) and the most recent rest.

    Returns (ids, clipped, head cut).
    """
    if len(ids) <= budget:
        return list(ids), False, False
    head = min(head_len, budget // 2)
    return list(ids[:head]) + list(ids[len(ids) - (budget - head):]), True, head < head_len


class ContextCondenser(abc.ABC):
    """Builds c_{k+1} from the trajectory so far. Subclasses implement ``build``; ``condense`` enforces the budget."""

    def __init__(self, tokenizer, config: ContextCondenserConfig, *, generate: GenerateFn | None = None,
                 enable_think: bool = True, action_sep: str = "||"):
        self.tokenizer = tokenizer
        self.config = config
        self.generate = generate
        self.enable_think = enable_think
        self.action_sep = action_sep

    @abc.abstractmethod
    def build(self, traj: TrajectorySoFar) -> Draft:
        """The strategy's context for the next step (may exceed the budget; ``condense`` clips it)."""

    def summary_request(self, traj: TrajectorySoFar) -> SummaryRequest | None:
        """Text the policy must write before ``condense(traj)`` can run (None: nothing; the default)."""
        return None

    def accept_summary(self, traj: TrajectorySoFar, request: SummaryRequest, output_ids: list[int],
                       seconds: float) -> SummaryCall:
        """Keep what the policy wrote for ``request`` on the trajectory (``traj.summary``), for ``condense``."""
        output = list(output_ids)[: request.max_tokens]
        text = self.decode(output).strip() or EMPTY_SUMMARY
        call = SummaryCall(prompt_ids=list(request.prompt_ids), output_ids=output, text=text,
                           covers_steps=request.covers_steps, seconds=seconds)
        traj.summary = call
        return call

    def condense(self, traj: TrajectorySoFar) -> CondensedContext:
        """c_{k+1} within ``max_condensed_tokens``, timed, with the uncondensed length for comparison."""
        start = time.perf_counter()
        draft = self.build(traj)
        ids, clipped, head_cut = fit_to_budget(draft.token_ids, self.config.max_condensed_tokens, draft.head_len)
        before = draft.uncondensed if draft.uncondensed is not None else self.uncondensed_length(traj)
        return CondensedContext(token_ids=ids, num_tokens_before=before, num_tokens_after=len(ids),
                                seconds=time.perf_counter() - start, kept_steps=draft.kept_steps,
                                truncated=clipped or draft.dropped_for_budget, task_truncated=head_cut,
                                summary=draft.summary)

    def uncondensed_length(self, traj: TrajectorySoFar) -> int:
        """Tokens of the whole conversation (the ``full`` layout, nothing dropped)."""
        task, segments = self.conversation.segments(traj)
        return len(task) + sum(len(s) for s in segments)

    _conversation: ConversationLayout | None = None

    @property
    def conversation(self) -> ConversationLayout:
        """The ``full`` layout, rendered by the full context manager; :func:`make_condenser` sets it."""
        if self._conversation is None:
            raise RuntimeError(f"{type(self).__name__} has no conversation layout: build it with make_condenser(..., "
                               "conversation=agent_trainer.agents.ctx_manager.FullConversation(tokenizer, ...)), as "
                               "the condensed context manager does")
        return self._conversation

    @conversation.setter
    def conversation(self, layout: ConversationLayout) -> None:
        self._conversation = layout

    # -- helpers for text layouts --------------------------------------------------------
    def chat_prompt_ids(self, user_message: str) -> list[int]:
        """System message + one user message + the assistant header (as ctx_manager renders a prompt)."""
        messages = [{"role": "system", "content": prompts.SYSTEM_PROMPT}, {"role": "user", "content": user_message}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


CONDENSERS: PluginRegistry[ContextCondenser] = PluginRegistry(ContextCondenser,
                                                              "multiturn_trajectory.context_condenser.type")
register_condenser = CONDENSERS.register
"""Class decorator: ``@register_condenser("name")`` makes a condenser available as ``context_condenser.type``."""
list_condensers = CONDENSERS.names
get_condenser_cls = CONDENSERS.get


def make_condenser(config: ContextCondenserConfig, tokenizer, *, conversation: ConversationLayout | None = None,
                   generate: GenerateFn | None = None, enable_think: bool = True,
                   action_sep: str = "||") -> ContextCondenser:
    """The condenser ``config.type`` names (``keep_last_n_steps`` and ``max_condensed_tokens`` must be resolved),
    laying out the whole conversation with ``conversation`` (the full context manager's rendering)."""
    if config.keep_last_n_steps is None or config.max_condensed_tokens is None:
        raise ValueError("multiturn_trajectory.context_condenser: keep_last_n_steps and max_condensed_tokens must "
                         "be resolved before a condenser is built (agent_trainer.config.condenser_config does it)")
    condenser = CONDENSERS.get(config.type)(tokenizer, config, generate=generate, enable_think=enable_think,
                                            action_sep=action_sep)
    if conversation is not None:
        condenser.conversation = conversation
    return condenser
