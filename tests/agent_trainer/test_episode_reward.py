"""One reward figure: an episode's reward is the sum of the turn rewards it is trained on, its format penalty
counted once, and the console, the metrics, the Prometheus gauge, the eval report, the trajectories and the
viewer all show that one figure.

The episodes are played by a real ``EnvStateManager`` (FrozenLake3x3 and Bandit) through the real context
managers (``conftest.play``) with scripted replies, several of them out of format; the rollout's own
``assemble`` builds the batch and the metrics.
"""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer.common import profiling
from agent_trainer.checks.load import load_config
from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.config.splits import Split
from agent_trainer.agents.ctx_manager import ContextManager
from agent_trainer.eval import summarize
from agent_trainer.checks.prepare import CONFIG_DIR
from agent_trainer.observe.metrics_export import tag_gauges
from agent_trainer.rollout import RolloutFaults
from agent_trainer.rollout.results import assemble
from agent_trainer.observe.tracking import format_metrics
from agent_trainer.observe.trajectories import EpisodeRecord, write_step

# By hand (format_penalty -0.1; MIXED_REPLIES, seeds 11 and 12):
#   env 0 FrozenLake3x3: Left (0), garbage (-0.1), Up (0), garbage (-0.1)       = -0.2
#   env 1 FrozenLake3x3: garbage x 4 turns, 4 x -0.1                           = -0.4
#   env 2 Bandit: Dragon pays 0                                                =  0.0
#   env 3 Bandit: an answer without <think> (-0.1), then Phoenix pays 0.1        =  0.0
# Counting the format penalty twice gave -0.4, -0.8, 0.0 and -0.1.
BY_HAND = {0: -0.2, 1: -0.4, 2: 0.0, 3: 0.0}
PENALTIES = {0: -0.2, 1: -0.4, 2: 0.0, 3: -0.1}


def _cfg(tiny_model_path):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose("frozenlake", overrides=[f"model_path={tiny_model_path}"]))


def _rollout(cfg, tokenizer, play_mixed, mixed_manager, layout, split=Split.TRAIN):
    agent = layout(tokenizer, max_model_len=4096)
    played = play_mixed(agent)
    states = mixed_manager.get_rollout_states()
    result = assemble(cfg, agent, split, dict(played.episodes), states, seeds=[11, 12], temperature=1.0,
                      faults=RolloutFaults(), reset_prefetched=False, generations=played.generated,
                      timings=profiling.TurnTimings(), describe=str, num_episodes=4)
    return result


def _trained(batch) -> dict[int, float]:
    """Token-level rewards summed over each episode's training rows."""
    out: dict[int, float] = {}
    for uid, total in zip(batch["traj_uid"].tolist(), batch["token_level_rewards"].sum(-1).tolist()):
        out[uid] = out.get(uid, 0.0) + total
    return out


@pytest.mark.parametrize("layout", [ContextManager, CondensedContextManager])
def test_every_report_shows_the_trained_reward_with_the_penalty_once(tiny_model_path, tokenizer, play_mixed,
                                                                      mixed_manager, layout, tmp_path):
    cfg = _cfg(tiny_model_path)
    result = _rollout(cfg, tokenizer, play_mixed, mixed_manager, layout)
    states = {s.env_id: s for s in result.states}
    assert {k: s.penalty for k, s in states.items()} == pytest.approx(PENALTIES)  # format errors happened
    assert result.metrics["rollout/format_error_rate"] > 0

    trained = _trained(result.batch)
    assert trained == pytest.approx(BY_HAND, abs=1e-6)  # the training rows, by hand
    for env_id, state in states.items():  # the episode's state, and its turns
        assert state.total_reward == pytest.approx(BY_HAND[env_id], abs=1e-6)
        assert sum(t.reward for t in state.history) == pytest.approx(BY_HAND[env_id], abs=1e-6)

    m = result.metrics
    lake, bandit = (BY_HAND[0] + BY_HAND[1]) / 2, (BY_HAND[2] + BY_HAND[3]) / 2
    assert m["rollout/episode_reward_mean"] == pytest.approx(sum(BY_HAND.values()) / 4, abs=1e-6)
    assert m["env/FrozenLake3x3/episode_reward_mean"] == pytest.approx(lake, abs=1e-6)
    assert m["env/Bandit/episode_reward_mean"] == pytest.approx(bandit, abs=1e-6)
    # the console's rew is the metric (one tag alone would show the same figure)
    assert re.search(r"rew -0\.150", format_metrics(m, 1))
    # the Prometheus gauge
    gauges = tag_gauges(m)
    assert gauges[("episode_reward_mean", "train", "FrozenLake3x3")] == pytest.approx(lake, abs=1e-6)
    assert gauges[("episode_reward_mean", "train", "Bandit")] == pytest.approx(bandit, abs=1e-6)
    # the eval report
    report = summarize(result.states)
    assert report["episode_reward_mean"] == pytest.approx(m["rollout/episode_reward_mean"], abs=1e-6)
    assert report["per_tag"]["FrozenLake3x3"]["episode_reward_mean"] == pytest.approx(lake, abs=1e-6)
    # the trajectories: the heading's figure is the sum of the turns shown
    path = write_step(tmp_path, 1, "train", result.states, result.batch, tokenizer, per_tag=2)
    records = {r.env_id: r for r in map(EpisodeRecord.from_json, path.read_text().splitlines())}
    for env_id, record in records.items():
        assert record.total_reward == pytest.approx(BY_HAND[env_id], abs=1e-6)
        assert sum(t.reward for t in record.turns) == pytest.approx(record.total_reward, abs=1e-6)


def test_the_validation_split_reports_the_same_figure(tiny_model_path, tokenizer, play_mixed, mixed_manager):
    result = _rollout(_cfg(tiny_model_path), tokenizer, play_mixed, mixed_manager, ContextManager, Split.VAL)
    m = result.metrics
    assert m["val/env/FrozenLake3x3/episode_reward_mean"] == pytest.approx(-0.3, abs=1e-6)
    assert m["val/episode_reward_mean"] == pytest.approx(-0.15, abs=1e-6)
    assert tag_gauges(m)[("episode_reward_mean", "val", "FrozenLake3x3")] == pytest.approx(-0.3, abs=1e-6)


def test_the_viewer_shows_the_turns_and_their_sum(tiny_model_path, tokenizer, play_mixed, mixed_manager, tmp_path):
    from test_viewer import headless

    result = _rollout(_cfg(tiny_model_path), tokenizer, play_mixed, mixed_manager, ContextManager)
    path = write_step(tmp_path, 1, "train", result.states, result.batch, tokenizer, per_tag=2)
    dom = headless("--dump-dom", (path.parent / "viewer.html").as_uri() + "#tag=FrozenLake3x3&index=1")
    assert "FrozenLake3x3 #0 · -0.20" in dom and "FrozenLake3x3 #1 · -0.40" in dom  # the episode list
    shown = re.search(r'<section id="episode">(.*)</section>', dom, re.S).group(1)
    assert "env 1" in shown and "total reward -0.400" in shown  # env 1's heading ...
    assert re.findall(r"reward (-?\d\.\d{3})</span>", shown) == ["-0.100"] * 4  # ... over its four turns
