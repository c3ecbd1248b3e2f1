"""Episodes that end in an environment error: past ``es_manager.max_env_error_fraction`` of a split the rollout
stops the run with one line (``EnvFailure``, the path failed resets take), below it they stay in the step.

The unit test plays a real ``EnvStateManager`` (``envs.examples.faulty:FaultyEnv`` raising in ``step``, beside
Bandit). The e2e test runs the real rollout: a local Ray cluster, the HF engine on the tiny model, real env
actors; it also checks the one reward figure of a real rollout, where the tiny model's replies are out of format.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from agent_trainer.checks.load import load_config
from agent_trainer.config.splits import Split
from agent_trainer.episode.es_manager import EnvInput, EnvStateManager, EpisodeSpec
from agent_trainer.eval import summarize
from agent_trainer.checks.prepare import CONFIG_DIR
from agent_trainer.observe.metrics_export import tag_gauges
from agent_trainer.rollout import EnvFailure, SyncMultiTurnRollout, check_env_errors
from agent_trainer.observe.tracking import format_metrics
from agent_trainer.observe.trajectories import EpisodeRecord, write_step
from agent_trainer.rollout.results import drop_small_groups, leave_out_lost_actors, leave_out_service_failures
from envs import BaseEnv, EnvTagConfig, ServiceError, load_env_tags, register_env

RAISES = EnvTagConfig(env_type="envs.examples.faulty:FaultyEnv", max_actions_per_traj=3,
                      env_instruction="Answer with any word, e.g. <answer>Left</answer>.", max_tokens=24,
                      env_config={"fault": "raise_step"})


def _describe(env_id: int) -> str:
    return f"env_id {env_id}"


def test_more_errored_episodes_than_the_fraction_stop_the_rollout_naming_the_first():
    tags = {**load_env_tags(), "Raises": RAISES}
    specs = [EpisodeSpec(env_id=0, group_id=0, tag="Bandit"), EpisodeSpec(env_id=1, group_id=0, tag="Bandit"),
             EpisodeSpec(env_id=2, group_id=1, tag="Raises"), EpisodeSpec(env_id=3, group_id=1, tag="Raises")]
    manager = EnvStateManager(tags, specs)
    manager.reset({0: 1, 1: 2})
    manager.step([EnvInput(env_id=i, llm_response="", actions=["Dragon"]) for i in range(4)])
    states = manager.get_rollout_states()
    assert [s.error is not None for s in states] == [False, False, True, True]
    check_env_errors(states, 0.5, Split.TRAIN, _describe)  # 2 of 4 is not more than half
    with pytest.raises(EnvFailure) as err:
        check_env_errors(states, 0.4, Split.TRAIN, _describe)
    assert str(err.value) == (
        "2 of 4 episodes of the train split ended in an environment error (more than "
        "es_manager.max_env_error_fraction = 0.4); the first: env_id 2: RuntimeError: injected step failure. "
        "Fix the environment's step (docs/writing_an_environment.md, \"Check it\"), or raise the fraction")
    assert isinstance(err.value, RuntimeError)


class ServiceDown(BaseEnv):
    """An env whose service is gone at its first step (as envs.openenv_env's is when its server dies)."""

    def reset(self, seed=None, **kwargs):
        return "ready"

    def step(self, action):
        raise ServiceError("step at http://127.0.0.1:9: the connection was lost")

    def render(self):
        return "ready"

    def action_description(self):
        return "anything"


def test_service_failures_are_left_out_of_training_and_not_counted_as_env_errors():
    register_env("service_down_test", ServiceDown)
    down = EnvTagConfig(env_type="service_down_test", max_actions_per_traj=3, env_instruction="", max_tokens=24)
    tags = {**load_env_tags(), "Down": down, "Raises": RAISES}
    specs = [EpisodeSpec(env_id=0, group_id=0, tag="Bandit"), EpisodeSpec(env_id=1, group_id=0, tag="Bandit"),
             EpisodeSpec(env_id=2, group_id=1, tag="Down"), EpisodeSpec(env_id=3, group_id=1, tag="Down"),
             EpisodeSpec(env_id=4, group_id=2, tag="Raises")]
    manager = EnvStateManager(tags, specs)
    manager.reset({0: 1, 1: 2, 2: 3})
    manager.step([EnvInput(env_id=i, llm_response="", actions=["Dragon"]) for i in range(5)])
    states = manager.get_rollout_states()
    assert [s.service_failure for s in states] == [False, False, True, True, False]
    assert [s.metrics["service_failure"] for s in states] == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert all(s.error is not None for s in states[2:])
    check_env_errors(states, 0.2, Split.TRAIN, _describe)  # 1 env error of 5; the 2 service failures do not count
    with pytest.raises(EnvFailure, match="1 of 5 episodes .* the first: env_id 4: RuntimeError"):
        check_env_errors(states, 0.1, Split.TRAIN, _describe)
    played = [SimpleNamespace(env_id=i) for i in range(5)]
    kept, lost = leave_out_service_failures(played, states, Split.TRAIN, _describe)
    assert [e.env_id for e in kept] == [0, 1, 4] and lost == 2
    with pytest.raises(EnvFailure) as err:
        leave_out_service_failures(played[2:4], states, Split.TRAIN, _describe)
    assert str(err.value) == (
        "all 2 episodes of the train split that played a turn ended in a service failure; the first: env_id 2: "
        "ServiceError: step at http://127.0.0.1:9: the connection was lost. Check that the env's server is up "
        "(docs/environments.md, \"Services\")")


def test_episodes_a_lost_env_actor_ended_leave_the_batch_and_small_groups_are_dropped():
    """Infrastructure, not the policy, ended them: left out of the batch and their group's statistics, counted;
    a group that lost episodes and kept fewer than es_manager.min_group_left is dropped and counted."""
    played = [SimpleNamespace(env_id=i, group_id=i // 4, env_actor_lost=i in (1, 4, 5, 6)) for i in range(12)]
    kept, lost = leave_out_lost_actors(played, Split.TRAIN)
    assert lost == 4 and [e.env_id for e in kept] == [0, 2, 3, 7, 8, 9, 10, 11]
    kept, dropped = drop_small_groups(kept, group_size=4, min_left=2, split=Split.TRAIN)
    assert dropped == 1 and [e.env_id for e in kept] == [0, 2, 3, 8, 9, 10, 11]  # group 1 kept only env 7
    assert drop_small_groups(kept, group_size=4, min_left=4, split=Split.TRAIN)[1] == 1  # group 0 has 3 of 4
    single = [SimpleNamespace(env_id=i, group_id=i) for i in range(3)]
    assert drop_small_groups(single, group_size=1, min_left=2, split=Split.TRAIN) == (single, 0)  # lost nothing
    with pytest.raises(EnvFailure, match="all 2 episodes of the train split .* env actor died"):
        leave_out_lost_actors(played[4:6], Split.TRAIN)
    with pytest.raises(EnvFailure, match="every group of the train split lost episodes"):
        drop_small_groups(played[:1], group_size=4, min_left=2, split=Split.TRAIN)


def _config(model_path: str, tags: str, n_groups: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose("frozenlake", overrides=[
            f"model_path={model_path}", "es_manager.train.env_groups=3", "es_manager.train.group_size=2",
            f"es_manager.train.env_configs.tags={tags}", f"es_manager.train.env_configs.n_groups={n_groups}",
            "ppo_mini_batch_size=6", "micro_batch_size_per_gpu=1", "agent_proxy.max_turn=3",
            "actor_rollout_ref.rollout.response_length=24", *overrides]))


@pytest.mark.e2e
def test_a_real_rollout_reports_one_reward_and_stops_on_env_errors(ray_cluster, tiny_model_path, tokenizer,
                                                                   tmp_path):
    from agent_trainer.training.lifecycle import kill_actors
    from tests.faults.fault_runs import EveryReplyActs
    from agent_trainer.workers.env_worker import EnvWorker
    from agent_trainer.workers.rollout import HFRolloutWorker

    engine = ray_cluster.remote(HFRolloutWorker).options(num_cpus=0.5).remote(tiny_model_path, max_model_len=1536)

    # One reward figure. The tag Cut is FrozenLake3x3 with 2 tokens a turn: every reply is cut before its answer,
    # a format error, so each of its episodes plays the 3 turns and earns 3 x -0.1 = -0.3 (-0.6 when the penalty
    # was counted twice); FrozenLake3x3 beside it plays as the model answers.
    tags = load_env_tags()
    tags["Cut"] = dataclasses.replace(tags["FrozenLake3x3"], max_tokens=2)
    cfg = _config(tiny_model_path, "[FrozenLake3x3,Cut]", "[2,1]")
    lake = SyncMultiTurnRollout(cfg, tokenizer, [engine], EnvWorker, tags, split="train", num_env_actors=1)
    try:
        result = lake.rollout(step=1)
    finally:
        kill_actors(lake.env_actors)
    m, states = result.metrics, result.states
    cut = [s for s in states if s.tag == "Cut"]
    assert len(cut) == 2 and all(s.penalty == pytest.approx(-0.3) and s.total_reward == pytest.approx(-0.3)
                                 for s in cut)
    assert m["env/Cut/episode_reward_mean"] == pytest.approx(-0.3, abs=1e-6)
    trained: dict[int, float] = {}
    for uid, total in zip(result.batch["traj_uid"].tolist(), result.batch["token_level_rewards"].sum(-1).tolist()):
        trained[uid] = trained.get(uid, 0.0) + total
    for s in states:  # the training rows, the state, the turns: one figure, the penalty inside the turns once
        assert s.total_reward == pytest.approx(trained[s.env_id], abs=1e-5)
        assert s.total_reward == pytest.approx(sum(t.reward for t in s.history), abs=1e-5)
        assert s.penalty == pytest.approx(sum(-0.1 for t in s.history if not t.info["action_is_valid"]), abs=1e-6)
    mean = sum(trained.values()) / len(trained)
    lake_mean = sum(trained[s.env_id] for s in states if s.tag == "FrozenLake3x3") / 4
    assert m["rollout/episode_reward_mean"] == pytest.approx(mean, abs=1e-5)
    assert m["env/FrozenLake3x3/episode_reward_mean"] == pytest.approx(lake_mean, abs=1e-5)
    assert f"rew {mean:+6.3f}" in format_metrics(m, 1)  # the console
    gauges = tag_gauges(m)  # the Prometheus gauge
    assert gauges[("episode_reward_mean", "train", "Cut")] == pytest.approx(-0.3, abs=1e-6)
    assert gauges[("episode_reward_mean", "train", "FrozenLake3x3")] == pytest.approx(lake_mean, abs=1e-5)
    report = summarize(states)  # the eval report
    assert report["episode_reward_mean"] == pytest.approx(mean, abs=1e-5)
    assert report["per_tag"]["Cut"]["episode_reward_mean"] == pytest.approx(-0.3, abs=1e-6)
    path = write_step(tmp_path, 1, "train", states, result.batch, tokenizer, per_tag=6)
    for record in map(EpisodeRecord.from_json, path.read_text().splitlines()):
        assert record.total_reward == pytest.approx(trained[record.env_id], abs=1e-5)
        assert record.total_reward == pytest.approx(sum(t.reward for t in record.turns), abs=1e-5)

    # Env errors: one group of two raising episodes among three groups, every reply acting (EveryReplyActs).
    tags = {**tags, "Raises": RAISES}
    cfg = _config(tiny_model_path, "[FrozenLake3x3,Raises]", "[2,1]")
    faulty = SyncMultiTurnRollout(cfg, tokenizer, [engine], EnvWorker, tags, split="train", num_env_actors=1,
                                  agent_cls=EveryReplyActs)
    try:
        below = faulty.rollout(step=1)  # 2 of 6: below the default 0.5, the step goes on
        assert below.metrics["env/Raises/error"] == 1.0 and below.metrics["env/FrozenLake3x3/error"] == 0.0
        faulty.cfg = dataclasses.replace(cfg, es_manager=copy.deepcopy(cfg.es_manager))
        faulty.cfg.es_manager.max_env_error_fraction = 0.25
        with pytest.raises(EnvFailure, match=r"^2 of 6 episodes of the train split ended in an environment error "
                                             r"\(more than es_manager.max_env_error_fraction = 0.25\); the first: "
                                             r"env tag 'Raises', env_id 4, group 2 \(group seed \d+\), train split: "
                                             r"RuntimeError: injected step failure\. Fix the environment's step"):
            faulty.rollout(step=2)
    finally:
        kill_actors(faulty.env_actors)
    assert torch.isfinite(below.batch["token_level_rewards"]).all()
