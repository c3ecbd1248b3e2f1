"""EnvStateManager semantics without Ray: groups, seeds, turns, penalties, errors, states."""

import pytest

from agent_trainer.config.envs import EnvGroupsConfig, EsManagerConfig
from agent_trainer.episode.es_manager import (
    VAL_SEED_OFFSET,
    EnvInput,
    EnvStateManager,
    EpisodeSpec,
    group_seeds,
    plan_episodes,
    EnvTurn,
    EpisodeState,
    summarize_rollout_states,
)
from envs import BaseEnv, load_env_tags, make_info, register_env

ES_YAML = {
    "format_penalty": -0.1,
    "action_sep": "||",
    "max_actions_per_turn": 2,
    "train": {"env_groups": 3, "group_size": 2,
              "env_configs": {"tags": ["FrozenLake", "SlipperyFrozenLake"], "n_groups": [2, 1]}},
    "val": {"env_groups": 2, "group_size": 1, "env_configs": {"tags": ["FrozenLake"], "n_groups": [2]}},
}


class ExplodingEnv(BaseEnv):
    """Raises on the action "boom" (a user bug the rollout must survive)."""

    def reset(self, seed=None, **kwargs):
        return "ready"

    def step(self, action):
        if action == "boom":
            raise RuntimeError("kaboom")
        return "ready", 0.5, False, make_info(False, True, True)

    def render(self):
        return "ready"

    def action_description(self):
        return "anything | boom"


@pytest.fixture
def tags():
    register_env("exploding_test", ExplodingEnv)
    tags = dict(load_env_tags())
    tags["Boom"] = {"env_type": "exploding_test", "max_actions_per_traj": 5}
    return tags


def make_manager(tags, split="train", **kw):
    cfg = EsManagerConfig.from_dict(ES_YAML)
    split_cfg = getattr(cfg, split)
    return cfg, EnvStateManager(tags, plan_episodes(split_cfg), format_penalty=cfg.format_penalty,
                                action_sep=cfg.action_sep, max_actions_per_turn=cfg.max_actions_per_turn, **kw)


def test_config_shape_and_plan():
    cfg = EsManagerConfig.from_dict(ES_YAML)
    assert cfg.train.tags == ["FrozenLake", "SlipperyFrozenLake"] and cfg.train.n_groups == [2, 1]
    plan = plan_episodes(cfg.train)
    assert [(e.env_id, e.group_id, e.tag) for e in plan] == [
        (0, 0, "FrozenLake"), (1, 0, "FrozenLake"), (2, 1, "FrozenLake"), (3, 1, "FrozenLake"),
        (4, 2, "SlipperyFrozenLake"), (5, 2, "SlipperyFrozenLake")]
    flat = EnvGroupsConfig.from_dict({"env_groups": 1, "tags": ["A"], "n_groups": [1]})
    assert flat.tags == ["A"]


def test_n_groups_must_sum_to_env_groups():
    bad = {"train": {"env_groups": 4, "env_configs": {"tags": ["A", "B"], "n_groups": [2, 1]}}}
    with pytest.raises(ValueError, match=r"es_manager.train.env_configs.n_groups \[2, 1\] sums to 3 "
                                         r"but es_manager.train.env_groups is 4"):
        EsManagerConfig.from_dict(bad)
    with pytest.raises(ValueError, match="same length"):
        EnvGroupsConfig.from_dict({"env_groups": 2, "tags": ["A"], "n_groups": [1, 1]}, split="val")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['group_sise'\]"):
        EsManagerConfig.from_dict({"val": {"group_sise": 2}})


def test_group_seeds_advance_for_train_and_are_fixed_and_disjoint_for_val():
    r0, r1 = group_seeds("train", 3, 0, 7), group_seeds("train", 3, 1, 7)
    assert r0 == [7, 8, 9] and r1 == [10, 11, 12]
    val = group_seeds("val", 3, 0, 7)
    assert val == group_seeds("val", 3, 99, 7) == [7 + VAL_SEED_OFFSET + g for g in range(3)]
    assert not set(val) & set(group_seeds("train", 3, 5000, 7))
    with pytest.raises(ValueError, match="training seed range"):
        group_seeds("train", 2**20, 2**11, 0)


def test_group_members_share_the_initial_state(tags):
    _, mgr = make_manager(tags)
    outs = mgr.reset({0: 11, 1: 12, 2: 13})
    obs = {o.env_id: o.observation for o in outs}
    assert obs[0] == obs[1] and obs[2] == obs[3] and obs[4] == obs[5]
    assert obs[0] != obs[2]  # different seeds, different maps
    assert "FrozenLake" in outs[0].instruction and "Left | Down | Right | Up" in outs[0].instruction
    assert "up to 2 actions" in outs[0].instruction and "P is you" in outs[0].instruction
    with pytest.raises(ValueError, match=r"no seed for group\(s\) \[2\]"):
        mgr.reset({0: 1, 1: 2})


def test_turns_penalties_caps_and_rollout_states(tags):
    cfg, mgr = make_manager(tags)
    mgr.reset({0: 0, 1: 0, 2: 1, 3: 3})
    # env 0: expert plays two actions per turn; env 1: missing answer; env 2: garbage + valid
    expert = mgr.episodes[0].env
    outs = mgr.step([
        EnvInput(0, "<answer>..</answer>", [expert.expert_action()]),
        EnvInput(1, "no answer tags", []),
        EnvInput(2, "<answer>Jump || Left</answer>", ["Jump", "Left"]),
        EnvInput(3, "<answer>Up || Up || Up</answer>", ["Up", "Up", "Up"]),
    ])
    assert [o.env_id for o in outs] == [0, 1, 2, 3]
    assert outs[0].reward == 0.0 and outs[0].info["action_is_valid"]
    assert outs[1].reward == pytest.approx(-0.1) and not outs[1].info["action_is_valid"]
    assert outs[2].reward == pytest.approx(-0.1) and outs[2].info["num_actions"] == 2
    assert outs[3].info["num_actions"] == 2  # capped by max_actions_per_turn
    # Play env 0 to success with the expert.
    while not outs[0].done:
        outs = mgr.step([EnvInput(0, "r", [expert.expert_action()])])
    assert outs[0].info["success"] and outs[0].reward == 1.0
    after = mgr.step([EnvInput(0, "again", ["Left"])])[0]  # no-op once done
    assert after.done and after.reward == 0.0
    # Env 1 keeps failing until max_actions_per_traj (10) is used up: actions count even when invalid.
    n_turns = 0
    while True:
        out = mgr.step([EnvInput(1, "x", ["Left", "Nope"])])[0]
        n_turns += 1
        if out.done:
            break
    assert out.info.get("truncated") or out.info["success"] is False
    states = {s.env_id: s for s in mgr.get_rollout_states()}
    s0, s1 = states[0], states[1]
    assert isinstance(s0, EpisodeState) and isinstance(s0.history[0], EnvTurn)
    assert s0.tag == "FrozenLake" and s0.group_id == 0 and s0.penalty == 0.0
    assert s0.metrics["success"] == 1.0 and s0.metrics["action_is_valid"] == 1.0
    assert s0.metrics["pass@group"] == 1.0 and s1.metrics["pass@group"] == 1.0
    assert s0.total_reward == sum(t.reward for t in s0.history)
    assert s1.metrics["num_actions"] <= 10 and s1.penalty == pytest.approx(-0.1 * (1 + n_turns))
    assert s1.metrics["action_is_valid"] < 0.6
    summary = summarize_rollout_states(list(states.values()))
    assert summary["env/FrozenLake/pass@group"] == 0.5  # group 0 solved, group 1 not
    assert "env/SlipperyFrozenLake/success" in summary


def test_cap_reached_mid_turn_ends_episode(tags):
    tags = dict(tags)
    tags["Short"] = {"env_type": "frozen_lake", "max_actions_per_traj": 3, "env_config": {"size": 8, "p": 1.0}}
    mgr = EnvStateManager(tags, [EpisodeSpec(0, 0, "Short")], max_actions_per_turn=2)
    mgr.reset({0: 0})
    assert not mgr.step([EnvInput(0, "", ["Right", "Right"])])[0].done
    out = mgr.step([EnvInput(0, "", ["Right", "Right"])])[0]
    assert out.done and out.info["truncated"] and out.info["num_actions"] == 1
    assert mgr.get_rollout_states()[0].metrics["num_actions"] == 3


def test_env_exception_ends_only_that_episode(tags):
    mgr = EnvStateManager(tags, [EpisodeSpec(0, 0, "Boom"), EpisodeSpec(1, 0, "Boom")], max_actions_per_turn=3)
    mgr.reset({0: 0})
    outs = mgr.step([EnvInput(0, "", ["ok", "boom", "ok"]), EnvInput(1, "", ["ok"])])
    assert outs[0].done and "kaboom" in outs[0].info["error"] and outs[0].reward == pytest.approx(0.5 - 0.1)
    assert not outs[1].done and outs[1].reward == 0.5
    states = mgr.get_rollout_states()
    assert states[0].metrics["error"] == 1.0 and states[1].metrics["error"] == 0.0
    assert states[0].metrics["num_actions"] == 2 and "RuntimeError: kaboom" in states[0].error


def test_garbage_inputs_never_raise(tags, garbage_actions):
    _, mgr = make_manager(tags)
    mgr.reset({0: 0, 1: 1, 2: 2})
    for k in range(0, 2000, 2):
        chunk = garbage_actions[k:k + 2]
        outs = mgr.step([EnvInput(i, chunk[0], list(chunk)) for i in range(6)])
        if all(o.done for o in outs):
            mgr.reset({0: k, 1: k + 1, 2: k + 2})


def test_unknown_tag_or_env_id_is_named(tags):
    with pytest.raises(ValueError, match="unknown tag 'Nope'; known tags"):
        EnvStateManager(tags, [EpisodeSpec(0, 0, "Nope")])
    mgr = EnvStateManager(tags, [EpisodeSpec(0, 0, "FrozenLake")])
    mgr.reset({0: 0})
    with pytest.raises(ValueError, match="unknown env_id 5"):
        mgr.step([EnvInput(5, "", ["Up"])])
