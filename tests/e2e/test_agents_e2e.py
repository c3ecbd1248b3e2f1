"""Pluggable agents end to end (real Ray, FSDP2 over gloo, vLLM CPU; 2 GRPO steps each on the tiny model).

- a user's agent class outside the package, named only by ``agent_proxy.agent_cls`` (an import path);
- the tool-calling agent (``agent_proxy.agent_cls=tool_call``) on the registered FrozenLake3x3 env.
Every rollout's batch passes the framework's contract check (``agents.contract``) or the run fails.
"""

from __future__ import annotations

import json
import math

import pytest

from agent_trainer.agents.tool_call import ToolCallAgent
from e2e_runs import train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

SMALL = ["trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.progress_bar=false",
         "es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
         "es_manager.train.env_configs.tags=[FrozenLake3x3]", "es_manager.val.env_groups=1",
         "es_manager.val.env_configs.n_groups=[1]",
         "agent_proxy.num_env_actors=1", "agent_proxy.max_turn=2", "actor_rollout_ref.actor.fsdp.world_size=1",
         "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.response_length=24",
         "actor_rollout_ref.actor.use_kl_loss=false"]


def train(model_path: str, run_dir, *overrides: str):
    """frozenlake_grpo with ``overrides``, 2 steps in this process; returns (trainer, history)."""
    return train_here("frozenlake_grpo", model_path, run_dir, *SMALL, *overrides)


def first_turns(run_dir) -> list[dict]:
    """The sampled episodes of the last step (``trainer.log_trajectories_freq`` writes the last step)."""
    lines = (run_dir / "trajectories" / "step_2.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_custom_agent_named_by_import_path_trains(tiny_model_path, tmp_path):
    from tests.agent_trainer.agents_example import CountingAgent  # the module the config names

    before = CountingAgent.replies_parsed
    trainer, history = train(tiny_model_path, tmp_path, "agent_proxy.agent_cls=tests.agent_trainer.agents_example."
                                                        "CountingAgent")
    assert type(trainer.train_rollout.ctx) is CountingAgent and trainer.agent_cls is CountingAgent
    assert [math.isfinite(h["actor/pg_loss"]) for h in history] == [True, True]
    assert CountingAgent.replies_parsed - before >= 2 * 4  # 2 steps x 4 episodes x at least one turn
    prompts = [e["turns"][0]["prompt"] for e in first_turns(tmp_path)]
    assert prompts and all("Answer in <answer></answer>." in p and "Reply exactly as" not in p for p in prompts)


def test_the_tool_calling_agent_trains_on_frozenlake(tiny_model_path, tmp_path):
    trainer, history = train(tiny_model_path, tmp_path, "agent_proxy.agent_cls=tool_call")
    assert type(trainer.train_rollout.ctx) is ToolCallAgent
    assert [math.isfinite(h["actor/pg_loss"]) for h in history] == [True, True]
    episodes = first_turns(tmp_path)
    first = episodes[0]["turns"][0]["prompt"]
    assert "# Tools" in first and '"name": "move"' in first and "<tool_call>" in first, first
    later = [t["prompt"] for e in episodes for t in e["turns"][1:] if t["prompt"]]
    assert later and all("<|im_start|>user\n<tool_response>\nReward: " in p for p in later), later[:2]
    # a turn is valid exactly when its reply holds a well-formed call (the tiny model was warmed up on <answer>)
    for h in history:
        assert 0.0 <= h["rollout/format_error_rate"] <= 1.0
    for e in episodes:
        for t in e["turns"]:
            assert ("<tool_call>" in t["reply"]) or t["actions"] == [], t
