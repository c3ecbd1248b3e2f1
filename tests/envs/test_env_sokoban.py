"""Sokoban: generation by reverse play, dynamics, rewards, legend."""

import pytest

import envs
from envs.experts import sokoban_solve
from envs.sokoban import SokobanConfig, SokobanEnv, generate_room


@pytest.mark.parametrize("dims, boxes, depth", [((6, 6), 1, 30), ((7, 7), 2, 40), ((8, 8), 2, 60)])
def test_every_generated_room_is_solvable(dims, boxes, depth):
    cfg = SokobanConfig(dim_room=dims, num_boxes=boxes, search_depth=depth)
    for seed in range(15):
        walls, targets, box_cells, player = generate_room(cfg, seed)
        assert len(targets) == len(box_cells) == boxes and not box_cells & targets
        plan = sokoban_solve(walls, targets, box_cells, player)
        assert plan, (dims, seed)


def test_generation_is_deterministic_and_varies_with_seed():
    env = SokobanEnv()
    obs = [env.reset(seed=s) for s in range(10)]
    assert obs == [SokobanEnv().reset(seed=s) for s in range(10)]
    assert len(set(obs)) > 5


def test_ragen_dim_aliases():
    env = envs.make_env("sokoban", dim_x=7, dim_y=8)
    assert env.config.dim_room == (7, 8)
    assert len(env.reset(seed=0).splitlines()) == 7


def test_rewards_and_legend():
    env = SokobanEnv(SokobanConfig(dim_room=(6, 6), num_boxes=1))
    obs = env.reset(seed=3)
    assert set(obs) <= set("#_OX*PS \n") and obs.count("X") == 1
    assert "# is a wall" in env.legend() and "* is a box on a target" in env.legend()
    rewards = []
    while True:
        _, r, done, info = env.step(env.expert_action())
        rewards.append(r)
        if done:
            break
    assert info["success"] and rewards[-1] == pytest.approx(-0.1 + 1 + 10)
    assert all(r == pytest.approx(-0.1) for r in rewards[:-1])  # single box: only the last push lands
    assert "*" in env.render()


def test_walls_block_and_pushing_off_target_costs():
    env = SokobanEnv()
    env.reset(seed=0)
    # Hand-built room: player left of a box that sits on a target; a second box is off target.
    env.walls = {(r, c) for r in range(5) for c in range(6) if r in (0, 4) or c in (0, 5)}
    env.player, env.boxes, env.targets = (2, 1), frozenset({(2, 2), (1, 4)}), frozenset({(2, 2), (3, 4)})
    env.config.dim_room = (5, 6)
    _, r, done, info = env.step("Right")  # push the box off its target
    assert r == pytest.approx(-1.1) and env.boxes == {(2, 3), (1, 4)} and info["action_is_effective"]
    _, r, _, info = env.step("Up")
    _, r, _, info = env.step("Up")  # into the wall: a step, not effective
    assert r == pytest.approx(-0.1) and not info["action_is_effective"] and info["action_is_valid"]


def test_max_steps_ends_the_episode():
    env = envs.make_env("sokoban", max_steps=3)
    env.reset(seed=0)
    dones = [env.step("Up")[2] for _ in range(3)]
    assert dones == [False, False, True]
    assert env.step("Down")[1] == 0.0


@pytest.mark.parametrize("bad, match", [
    ({"dim_room": [3, 3]}, "dim_room"), ({"num_boxes": 0}, "num_boxes"), ({"search_depth": 0}, "search_depth"),
    ({"dim_room": "6x6"}, "dim_room"),
])
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        envs.make_env("sokoban", **bad)
