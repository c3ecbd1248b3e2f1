"""Shared fixtures: the tiny tokenizer, real env-state managers, and a scripted turn loop.

``play`` drives a context manager and a real ``EnvStateManager`` exactly like
``SyncMultiTurnRollout.rollout`` does, with scripted replies standing in for the
engine's output (the ids are what the engine would return: reply text + eos).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from transformers import AutoTokenizer

from agent_trainer.episode.es_manager import EnvOutput, EnvStateManager, EpisodeSpec
from envs import load_env_tags


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture()
def mixed_manager():
    """Group 0: two FrozenLake3x3 episodes (env 0, 1); group 1: two Bandit episodes (env 2, 3)."""
    episodes = [EpisodeSpec(env_id=0, group_id=0, tag="FrozenLake3x3"),
                EpisodeSpec(env_id=1, group_id=0, tag="FrozenLake3x3"),
                EpisodeSpec(env_id=2, group_id=1, tag="Bandit"),
                EpisodeSpec(env_id=3, group_id=1, tag="Bandit")]
    return EnvStateManager(load_env_tags(), episodes, format_penalty=-0.1)


@dataclass
class Played:
    """What a scripted rollout produced, per env id."""

    episodes: dict
    prompts: dict[int, list[list[int]]] = field(default_factory=lambda: defaultdict(list))
    """The ids each turn was generated from (``ctx_manager.prompt_ids`` at that turn)."""
    generated: dict[int, list[list[int]]] = field(default_factory=lambda: defaultdict(list))
    """The 'engine' ids of each turn."""
    logprobs: dict[int, list[list[float]]] = field(default_factory=lambda: defaultdict(list))
    outputs: dict[int, list[EnvOutput]] = field(default_factory=lambda: defaultdict(list))


def reply_ids(tokenizer, text: str, eos: bool = True) -> list[int]:
    """Ids an engine would return for ``text``: the text, then eos unless cut off."""
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])


def play(tokenizer, ctx_mgr, manager, seeds: dict[int, int], replies: dict[int, list[str]], max_turn: int,
         response_length: int = 32) -> Played:
    """The rollout's turn loop with scripted replies (turn k uses replies[env][k], or the last one)."""
    played = Played(episodes={o.env_id: ctx_mgr.start(o) for o in manager.reset(seeds)})
    for _ in range(max_turn):
        active = [e for e in played.episodes.values() if not e.done]
        if not active:
            break
        inputs = []
        for ep in active:
            script = replies[ep.env_id]
            ids = reply_ids(tokenizer, script[min(len(played.generated[ep.env_id]), len(script) - 1)])
            logprobs = [-(i + 1) / 100 for i in range(len(ids))]
            played.prompts[ep.env_id].append(list(ctx_mgr.prompt_ids(ep)))
            played.generated[ep.env_id].append(ids)
            played.logprobs[ep.env_id].append(logprobs)
            inputs.append(ctx_mgr.append_reply(ep, ids, logprobs))
        for out in manager.step(inputs):
            played.outputs[out.env_id].append(out)
            ctx_mgr.append_env_output(played.episodes[out.env_id], out, response_length)
    return played


GOOD = "<think>try it</think><answer>{}</answer>"
MIXED_REPLIES = {
    0: [GOOD.format("Left"), "garbage", GOOD.format("Up"), "garbage"],
    1: ["garbage"],  # never executes an action: plays every turn
    2: [GOOD.format("Dragon")],  # one pull ends a bandit episode
    3: ["<answer>Phoenix</answer>", GOOD.format("Phoenix")],  # no <think>: a format error first
}
"""Replies that make episodes of different lengths and rewards (bandits end after their first pull)."""


@pytest.fixture()
def play_mixed(tokenizer, mixed_manager):
    """Play MIXED_REPLIES for up to 4 turns with the given context manager."""

    def _play(ctx_mgr, max_turn: int = 4) -> Played:
        return play(tokenizer, ctx_mgr, mixed_manager, {0: 11, 1: 12}, MIXED_REPLIES, max_turn)

    return _play
