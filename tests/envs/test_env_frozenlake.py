"""FrozenLake: determinism, solvable maps, legend, fuzzing, slippery dynamics."""

import itertools

import pytest
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

import envs
from envs.base import parse_choice
from envs.frozen_lake import ACTIONS, FrozenLakeConfig, FrozenLakeEnv, generate_map, has_down_right_dead_end


def run_expert(env, seed, max_steps=100):
    env.reset(seed=seed)
    total, info = 0.0, {}
    for _ in range(max_steps):
        _, reward, done, info = env.step(env.expert_action())
        total += reward
        if done:
            break
    return info.get("success", False), total


def test_same_seed_same_observation():
    a, b = envs.make_env("frozen_lake", size=5), envs.make_env("frozen_lake", size=5)
    for seed in range(10):
        assert a.reset(seed=seed) == b.reset(seed=seed)
    assert len({a.reset(seed=s) for s in range(20)}) > 5  # seeds give different maps


@pytest.mark.parametrize("slippery", [False, True])
def test_two_episodes_of_one_map_in_one_process_move_apart(slippery):
    """Envs of the same map share gymnasium's transition table (built once per map): each keeps its own position and
    slips, so an episode played beside another of the same seed plays as it does alone."""
    moves = ["Right", "Down", "Right", "Down", "Down", "Right"]
    alone = envs.make_env("frozen_lake", size=4, is_slippery=slippery)
    alone.reset(seed=7)
    expected = [alone.step(m)[0] for m in moves]
    a, b = (envs.make_env("frozen_lake", size=4, is_slippery=slippery) for _ in range(2))
    start = a.reset(seed=7)
    assert b.reset(seed=7) == start
    played = []
    for m in moves:
        played.append(a.step(m)[0])
        assert b.render() == start  # b has not moved
    assert played == expected
    assert a._gym is not b._gym and a._gym.P is b._gym.P


def test_map_matches_gymnasium_generator():
    for seed in range(5):
        assert generate_map(6, 0.8, seed) == generate_random_map(6, 0.8, seed)


def _stuck_walk(desc: list[str]) -> bool:
    """Brute force: some sequence of safe Down/Right moves (onto ice, on the map) stops short of the goal with
    no safe Down/Right move left."""
    size = len(desc)

    def safe(r, c):
        return r < size and c < size and desc[r][c] != "H"

    for moves in itertools.product([(1, 0), (0, 1)], repeat=2 * (size - 1)):
        r, c = 0, 0
        for dr, dc in moves:
            if desc[r][c] == "G" or not safe(r + dr, c + dc):
                break
            r, c = r + dr, c + dc
        if desc[r][c] != "G" and not safe(r + 1, c) and not safe(r, c + 1):
            return True
    return False


@pytest.mark.parametrize("size", [3, 4, 5])
def test_dead_end_check_agrees_with_brute_force(size):
    maps = [generate_map(size, 0.7, seed) for seed in range(300)]
    verdicts = [has_down_right_dead_end(desc) for desc in maps]
    assert verdicts == [_stuck_walk(desc) for desc in maps]
    assert 0 < sum(verdicts) < len(maps)  # both kinds of map occur


def test_maps_without_dead_ends_are_won_by_safe_down_right_moves():
    env = envs.make_env("frozen_lake", size=4, p=0.8, no_dead_ends=True, describe_surroundings=True)
    plain = envs.make_env("frozen_lake", size=4, p=0.8)
    differ = 0
    for seed in range(100):
        env.reset(seed=seed)
        plain.reset(seed=seed)
        differ += env.desc != plain.desc
        assert not has_down_right_dead_end(env.desc)
        for turn in range(6):  # the walker of the docstring: Down if Down is ice or the goal, else Right
            line = env.render().splitlines()[-1]
            action = "Down" if ("Down: ice" in line or "Down: goal" in line) else "Right"
            _, reward, done, info = env.step(action)
            if done:
                break
        assert done and info["success"] and turn == 5, (seed, env.desc)
    assert differ > 20  # a subset of the p maps: where the seed's first map has a dead end, a later draw
    again = envs.make_env("frozen_lake", size=4, p=0.8, no_dead_ends=True, describe_surroundings=True)
    assert [again.reset(seed=s) for s in range(5)] == [env.reset(seed=s) for s in range(5)]  # seeded
    with pytest.raises(ValueError, match="no_dead_ends"):
        FrozenLakeConfig(no_dead_ends="yes")



def test_noting_reader_notes_the_tiles_and_wins_every_map_without_dead_ends():
    """make distill's teacher's demonstrator: the note of noting_walker, then the move its first word decides."""
    import random

    from envs.frozen_lake import noted_tiles, noting_reader

    env = envs.make_env("frozen_lake", size=4, p=0.8, no_dead_ends=True, describe_surroundings=True)
    rng, moves = random.Random(0), set()
    for seed in range(100):
        env.reset(seed=seed)
        for turn in range(6):
            action, think = noting_reader(env, rng)
            assert think == noted_tiles(env) == env.note()
            assert action == ("Down" if think.startswith(("Down: ice", "Down: goal")) else "Right"), think
            moves.add((think.split(",")[0], action))
            _, _, done, info = env.step(action)
            if done:
                break
        assert done and info["success"] and turn == 5, (seed, env.desc)
    assert moves == {("Down: ice", "Down"), ("Down: goal", "Down"), ("Down: hole", "Right"), ("Down: wall", "Right")}

@pytest.mark.parametrize("size", [3, 4, 6, 8])
def test_expert_solves_every_map(size):
    env = envs.make_env("frozen_lake", size=size)
    for seed in range(25):
        success, total = run_expert(env, seed)
        assert success and total == 1.0, (size, seed, env.render())


def test_expert_on_slippery_is_usually_right_and_deterministic_per_seed():
    env = envs.make_env("frozen_lake", size=4, is_slippery=True)
    wins = sum(run_expert(env, seed)[0] for seed in range(30))
    assert wins >= 15  # optimal policy on slippery 4x4 maps succeeds well above chance
    # Same seed, same actions -> same trajectory (slips are seeded by reset).
    traj = []
    for _ in range(2):
        env.reset(seed=7)
        traj.append([env.step(a)[0] for a in ["Right", "Down", "Right", "Down", "Down", "Right"]])
    assert traj[0] == traj[1]


def test_render_legend_and_rewards():
    env = FrozenLakeEnv(FrozenLakeConfig(size=4))
    obs = env.reset(seed=0)
    assert set(obs) <= set("P_OG \n") and obs.count("P") == 1 and obs.count("G") == 1
    assert "P is you" in env.legend() and "O is a hole" in env.legend()
    assert env.action_description() == "Left | Down | Right | Up"
    # Moving left from the start corner hits the wall: valid but not effective.
    _, reward, done, info = env.step("Left")
    info.pop("chose_hole", None)  # the reading diagnostic, tested below
    assert info == {"success": False, "action_is_valid": True, "action_is_effective": False}
    assert (reward, done) == (0.0, False)
    success, _ = run_expert(env, 0)
    assert success and "W" in env.render() and "P" not in env.render()


def test_falling_into_a_hole_ends_the_episode():
    env = FrozenLakeEnv(FrozenLakeConfig(size=4, map_seed=0))
    env.reset(seed=0)
    desc = env.desc
    hole = next((r, c) for r, row in enumerate(desc) for c, t in enumerate(row) if t == "H")
    # Put the player next to the hole (left of it, or above it), then step in.
    env._gym.unwrapped.s = hole[0] * 4 + hole[1] - 1 if hole[1] > 0 else (hole[0] - 1) * 4 + hole[1]
    move = "Right" if hole[1] > 0 else "Down"
    obs, reward, done, info = env.step(move)
    assert done and reward == 0.0 and not info["success"] and "X" in obs
    obs2, reward2, done2, info2 = env.step("Up")  # stepping after the end is a no-op
    assert (obs2, reward2, done2, info2["action_is_effective"]) == (obs, 0.0, True, False)


def test_action_parsing_is_lenient_on_case_and_punctuation():
    for text, want in [("left", "Left"), (" UP. ", "Up"), ("`Down`", "Down"), ("**Right**", "Right"),
                       ("Left Up", None), ("go left", None), ("", None), (None, None), ("1", None)]:
        assert parse_choice(text, ACTIONS) == want, text


def test_garbage_actions_never_raise(garbage_actions, fuzz):
    env = envs.make_env("frozen_lake", size=4)
    fuzz(env, garbage_actions, valid_check=lambda a: parse_choice(a, ACTIONS) is not None)


@pytest.mark.parametrize("bad, match", [
    ({"size": 1}, "size"), ({"p": 0.0}, "p must be"), ({"sise": 4}, "allowed fields"),
    ({"is_slippery": "yes"}, "is_slippery"), ({"success_rate": 2.0}, "success_rate"),
])
def test_bad_config_values_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        envs.make_env("frozen_lake", **bad)


def test_gymnasium_wrapper_on_cliffwalking(garbage_actions, fuzz):
    env = envs.make_env("gymnasium")  # CliffWalking-v1 by default
    obs = env.reset(seed=0)
    assert "x" in obs and "T" in obs
    for action in ["Up"] + ["Right"] * 11 + ["Down"]:
        _, _, done, info = env.step(action)
    assert done and info["success"]
    fuzz(env, garbage_actions[:2000])
    with pytest.raises(ValueError, match="discrete actions"):
        envs.make_env("gymnasium", action_names=["A", "B"]).reset(seed=0)


def test_describe_surroundings_names_each_neighbour_and_the_goal():
    from envs.frozen_lake import describe_surroundings

    desc = ["SFH", "FHF", "FFG"]
    both = "The goal is down and right."
    assert describe_surroundings(desc, 0, 0) == f"{both} Left: wall, Down: ice, Right: ice, Up: wall."
    assert describe_surroundings(desc, 0, 1) == f"{both} Left: ice, Down: hole, Right: hole, Up: wall."
    assert describe_surroundings(desc, 1, 2) == "The goal is down. Left: hole, Down: goal, Right: wall, Up: hole."
    assert describe_surroundings(desc, 2, 1) == "The goal is right. Left: ice, Down: wall, Right: goal, Up: hole."


def test_the_neighbours_words_sit_at_a_fixed_distance_from_the_end_of_the_line():
    """The goal comes first, so each neighbour's word is the same number of words from the end wherever the goal
    is: the lookup a two-layer model learns."""
    from envs.frozen_lake import describe_surroundings

    desc = ["SFH", "FHF", "FFG"]
    for row, col in [(0, 0), (0, 1), (1, 2), (2, 1), (1, 0)]:
        words = describe_surroundings(desc, row, col).split()
        assert [words[k] for k in (-8, -6, -4, -2)] == ["Left:", "Down:", "Right:", "Up:"]


def test_note_names_the_down_and_right_tiles_only_where_the_line_is_shown():
    described = FrozenLakeEnv(FrozenLakeConfig(size=4, describe_surroundings=True))
    assert described.note() is None  # before reset
    for seed in range(5):
        obs, done = described.reset(seed=seed), False
        while not done:
            words = obs.splitlines()[-1].split()
            assert described.note() == f"Down: {words[-5].rstrip(',')}, Right: {words[-3].rstrip(',')}."
            obs, _, done, info = described.step(described.expert_action())
        assert info["success"] and described.note() is None  # on the goal: no line, no note
    plain = FrozenLakeEnv(FrozenLakeConfig(size=4))
    plain.reset(seed=0)
    assert plain.note() is None


def test_describe_surroundings_option_adds_a_line_under_the_grid_until_the_episode_ends():
    plain = FrozenLakeEnv(FrozenLakeConfig(size=4))
    described = FrozenLakeEnv(FrozenLakeConfig(size=4, describe_surroundings=True))
    for seed in range(10):
        grid, obs = plain.reset(seed=seed), described.reset(seed=seed)
        assert obs.startswith(grid + "\n") and obs.count("\n") == grid.count("\n") + 1
        assert obs.splitlines()[-1].startswith("The goal is ") and ". Left: wall, Down: " in obs
        done = False
        while not done:  # the expert walks to the goal: every observation on the way has the line
            obs, _, done, info = described.step(described.expert_action())
            assert ("Left: " in obs) == (not done)
        assert info["success"]
    # a hole ends the episode: no line under the grid either
    seed = next(s for s in range(200) if generate_map(4, 0.8, s)[0][1] == "H")
    described.reset(seed=seed)
    obs, _, done, info = described.step("Right")
    assert done and not info["success"] and "X" in obs and "Left: " not in obs


def test_describe_surroundings_is_off_by_default_and_validated_by_the_tag():
    assert FrozenLakeConfig().describe_surroundings is False
    with pytest.raises(ValueError, match="describe_surroundings must be true or false, got 'yes'"):
        FrozenLakeConfig(describe_surroundings="yes")
    tags = envs.load_env_tags()
    env = envs.make_env("FrozenLakeDescribed", tags)
    assert env.config.describe_surroundings and env.config.size == 4 and not env.config.is_slippery
    assert "Left: wall" in env.reset(seed=1)


def _map_of(seed: int) -> list[str]:
    """The 4x4 map (p 0.7) of ``seed``."""
    probe = FrozenLakeEnv(FrozenLakeConfig(size=4, p=0.7))
    probe.reset(seed=seed)
    return probe.desc


def _standing_on(seed: int, row: int, col: int, **options) -> FrozenLakeEnv:
    """An env on the map of ``seed`` with the player put on (row, col)."""
    env = FrozenLakeEnv(FrozenLakeConfig(size=4, p=0.7, map_seed=seed, **options))
    env.reset(seed=seed)
    env._gym.unwrapped.s = row * 4 + col
    return env


def test_chose_hole_is_reported_exactly_where_one_of_down_and_right_is_a_hole():
    """The reading diagnostic: on every state of many maps, a move Down and a move Right report chose_hole only
    when exactly one of the two neighbours is a hole, with 1.0 for the move onto it."""
    seen = {0.0: 0, 1.0: 0}
    for seed in range(60):
        desc = _map_of(seed)
        for row, col in itertools.product(range(3), range(3)):
            if desc[row][col] in "HG":
                continue
            below, right = desc[row + 1][col] == "H", desc[row][col + 1] == "H"
            for action, onto_hole in (("Down", below), ("Right", right)):
                info = _standing_on(seed, row, col).step(action)[3]
                if below != right:
                    assert info["chose_hole"] == float(onto_hole)
                    seen[float(onto_hole)] += 1
                else:
                    assert "chose_hole" not in info
    assert min(seen.values()) > 20


@pytest.mark.parametrize("hole_reward", [0.0, -1.0])
def test_hole_reward_is_paid_by_the_step_into_a_hole_only(hole_reward):
    """hole_reward replaces gymnasium's 0 on the step that falls into a hole; ice steps pay 0 and the goal 1."""
    rewards = {"H": [], "F": [], "G": []}
    for seed in range(40):
        desc = _map_of(seed)
        for row, col in itertools.product(range(4), range(4)):
            if desc[row][col] in "HG":
                continue
            for action, (r, c) in (("Down", (row + 1, col)), ("Right", (row, col + 1))):
                if r > 3 or c > 3:
                    continue
                _, reward, done, info = _standing_on(seed, row, col, hole_reward=hole_reward).step(action)
                tile = desc[r][c] if desc[r][c] in "HG" else "F"
                rewards[tile].append((reward, done, info["success"]))
    assert rewards["H"] and rewards["F"] and rewards["G"]
    assert set(rewards["H"]) == {(hole_reward, True, False)}
    assert set(rewards["F"]) == {(0.0, False, False)}
    assert set(rewards["G"]) == {(1.0, True, True)}
