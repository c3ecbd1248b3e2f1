"""Agents a user could write, outside the package, selected by import path (tests/agent_trainer/test_agents.py).

``CountingAgent`` is a well-behaved custom agent: the default layout, with its own first prompt and a
counter of the replies it parsed. Two others break the batch contract on purpose; the framework
must reject them.
"""

from __future__ import annotations

from agent_trainer.agents.ctx_manager import ContextManager, EpisodeContext
from agent_trainer.episode.es_manager import EnvInput, EnvOutput


class CountingAgent(ContextManager):
    """The default agent with a terser first prompt; counts the replies it parsed."""

    replies_parsed = 0

    def start(self, out: EnvOutput) -> EpisodeContext:
        """A prompt of the observation and the instruction only (no reply-format sentence)."""
        ctx = EpisodeContext(env_id=out.env_id, group_id=out.group_id, tag=out.tag)
        ctx.extend(self._chat_prompt_ids(f"{out.instruction}\n{out.observation}\nAnswer in <answer></answer>."),
                   generated=False)
        return ctx

    def append_reply(self, ctx, token_ids, logprobs) -> EnvInput:
        type(self).replies_parsed += 1
        return super().append_reply(ctx, token_ids, logprobs)


class ObservationMaskAgent(ContextManager):
    """Breaks the contract: marks the observation after each turn as generated (mask 1)."""

    def append_env_output(self, ctx: EpisodeContext, out: EnvOutput, response_length: int) -> None:
        before = len(ctx.token_ids)
        super().append_env_output(ctx, out, response_length)
        for i in range(before, len(ctx.token_ids)):
            ctx.response_mask[i] = 1


class RetokenizingAgent(ContextManager):
    """Breaks the contract: decodes each reply and trains on its re-tokenized ids, not the engine's."""

    def append_reply(self, ctx: EpisodeContext, token_ids, logprobs) -> EnvInput:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_token_id]
        return super().append_reply(ctx, ids, [0.0] * len(ids))


class NotAnAgent:
    """Has the methods but not the base class."""
