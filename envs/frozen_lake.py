"""FrozenLake: walk from the start to the goal without falling into a hole.

gymnasium's FrozenLake runs underneath, on a random map generated per seed
exactly like gymnasium's ``generate_random_map(size, p, seed)`` (same draws,
so the same maps) but with a bounded number of tries. Every map has a path
from start to goal. Reward 1 at the goal, 0 otherwise; the episode ends at
the goal or in a hole. With ``is_slippery`` the agent moves in the intended
direction with probability ``success_rate`` (gymnasium's default 1/3) and
sideways otherwise; the slip randomness is seeded by ``reset(seed)``.

Legend: P player, _ frozen tile, O hole, G goal, X player in a hole,
W player on the goal. Actions: Left | Down | Right | Up.

With ``describe_surroundings`` the grid is followed by one line naming where
the goal is and what lies one step in each direction, e.g.
``The goal is down and right. Left: wall, Down: ice, Right: hole, Up: wall.``:
the same information as the grid, in words a small model can read without
locating itself in a character grid first. The goal comes first so that each
neighbour's word sits at a fixed distance from the end of the observation,
which a two-layer model learns to look up (docs/tiny_model.md).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

from envs.experts import mdp_greedy_policy
from envs.gym_wrapper import GymnasiumConfig, GymnasiumTextEnv

ACTIONS = ["Left", "Down", "Right", "Up"]  # gymnasium order: 0 Left, 1 Down, 2 Right, 3 Up
LEGEND = ("Legend: P is you, _ is frozen ice, O is a hole, G is the goal, "
          "X means you fell into a hole, W means you reached the goal.")
_MAX_MAP_TRIES = 10_000


@dataclass
class FrozenLakeConfig:
    """Options of the FrozenLake environment."""

    size: int = 4
    """Side length of the square map."""
    p: float = 0.8
    """Probability that a tile is frozen (otherwise a hole)."""
    is_slippery: bool = False
    """Slippery ice: the move succeeds only with probability ``success_rate``."""
    success_rate: float = 1.0 / 3.0
    """Probability of moving in the intended direction when slippery."""
    map_seed: int | None = None
    """Fix the map regardless of the reset seed (None: the map follows the seed)."""
    no_dead_ends: bool = False
    """Keep only maps without dead ends for Down/Right walkers: every tile reachable from the start by Down and
    Right moves onto ice still has a Down/Right path to the goal. On such maps "step Down or Right onto ice or
    the goal" solves every map in exactly 2 * (size - 1) moves, so a policy that reads the tiles next to it
    wins, while one that ignores the map does not (see :func:`has_down_right_dead_end`). The maps are a seeded
    subset of the ``p`` maps (the same seed gives the same map)."""
    hole_reward: float = 0.0
    """The reward of the step into a hole (gymnasium's 0 by default). A negative value tells a learner at once
    which move was the mistake, where the goal's reward alone arrives only when every later move goes right
    too; success is still reaching the goal."""
    describe_surroundings: bool = False
    """Append a line to the grid naming the tile one step Left / Down / Right / Up of the player (ice, hole,
    goal, or wall: the map's border, where a move leaves you in place) and the goal's direction
    (see :func:`describe_surroundings`)."""

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 2 <= self.size <= 32:
            raise ValueError(f"size must be an int in [2, 32], got {self.size!r}")
        if not 0.3 <= float(self.p) <= 1.0:
            # Lower p makes solvable maps so rare that generation would spin.
            raise ValueError(f"p must be in [0.3, 1.0], got {self.p!r}")
        if not 0.0 < float(self.success_rate) <= 1.0:
            raise ValueError(f"success_rate must be in (0, 1], got {self.success_rate!r}")
        if not isinstance(self.no_dead_ends, bool):
            raise ValueError(f"no_dead_ends must be true or false, got {self.no_dead_ends!r}")
        if not isinstance(self.describe_surroundings, bool):
            raise ValueError(f"describe_surroundings must be true or false, got {self.describe_surroundings!r}")


def generate_map(size: int, p: float, seed: int | None, no_dead_ends: bool = False) -> list[str]:
    """A random solvable map, identical to gymnasium's generate_random_map(size, p, seed); with ``no_dead_ends``
    the first of the same draws that also has no Down/Right dead end (:func:`has_down_right_dead_end`). A seeded
    map is drawn once per process (the baselines' search replays the same seeds thousands of times)."""
    if seed is None:
        return _draw_map(size, p, None, no_dead_ends)
    return list(_seeded_map(size, p, seed, no_dead_ends))


@functools.lru_cache(maxsize=8192)
def _seeded_map(size: int, p: float, seed: int, no_dead_ends: bool) -> tuple[str, ...]:
    return tuple(_draw_map(size, p, seed, no_dead_ends))


def _draw_map(size: int, p: float, seed: int | None, no_dead_ends: bool) -> list[str]:
    from gymnasium.envs.toy_text.frozen_lake import is_valid
    from gymnasium.utils import seeding

    np_random, _ = seeding.np_random(seed)
    for _ in range(_MAX_MAP_TRIES):
        board = np_random.choice(["F", "H"], (size, size), p=[p, 1 - p])
        board[0][0] = "S"
        board[-1][-1] = "G"
        if is_valid(board, size):
            desc = ["".join(row) for row in board]
            if not (no_dead_ends and has_down_right_dead_end(desc)):
                return desc
    wanted = "solvable map without Down/Right dead ends" if no_dead_ends else "solvable map"
    raise ValueError(f"no {wanted} of {size}x{size} found with p={p} in {_MAX_MAP_TRIES} tries; raise p")


@functools.lru_cache(maxsize=512)  # ~60 KB each (a 6x6 map's transition table)
def _gym_lake(desc: tuple[str, ...], is_slippery: bool, success_rate: float) -> Any:
    """gymnasium's FrozenLake on ``desc``, built once per map and process (:meth:`FrozenLakeEnv._make_gym_env`)."""
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

    return GymFrozenLake(render_mode="ansi", desc=list(desc), is_slippery=is_slippery, success_rate=success_rate)


def has_down_right_dead_end(desc: list[str]) -> bool:
    """Whether a walker that only steps Down or Right onto ice can get stuck: some tile it can reach from the
    start has no Down/Right path to the goal. False means "step Down or Right onto ice or the goal" always
    reaches the goal, in exactly 2 * (size - 1) moves."""
    size = len(desc)
    reaches_goal = [[False] * size for _ in range(size)]  # a Down/Right path over ice from (r, c) to the goal
    for r in range(size - 1, -1, -1):
        for c in range(size - 1, -1, -1):
            if desc[r][c] == "G":
                reaches_goal[r][c] = True
            elif desc[r][c] != "H":
                reaches_goal[r][c] = ((r + 1 < size and reaches_goal[r + 1][c])
                                      or (c + 1 < size and reaches_goal[r][c + 1]))
    reachable, frontier = {(0, 0)}, [(0, 0)]
    while frontier:
        r, c = frontier.pop()
        if not reaches_goal[r][c]:
            return True
        for nr, nc in ((r + 1, c), (r, c + 1)):
            if nr < size and nc < size and desc[nr][nc] != "H" and (nr, nc) not in reachable:
                reachable.add((nr, nc))
                frontier.append((nr, nc))
    return False


TILE_WORDS = {"S": "ice", "F": "ice", "H": "hole", "G": "goal"}
MOVES = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def describe_surroundings(desc: list[str], row: int, col: int) -> str:
    """Where the goal is and what lies one step in each direction of (row, col), as one line of words.

    ``The goal is down and right. Left: wall, Down: ice, Right: hole, Up: wall.``
    (the goal is at the bottom-right corner of every generated map, but the line reads it off ``desc``).
    """
    size = len(desc)
    around = []
    for name, (dr, dc) in MOVES.items():
        r, c = row + dr, col + dc
        around.append(f"{name}: {TILE_WORDS[desc[r][c]] if 0 <= r < size and 0 <= c < size else 'wall'}")
    goal_r, goal_c = next((r, line.index("G")) for r, line in enumerate(desc) if "G" in line)
    ways = [word for word, wanted in (("down", goal_r > row), ("up", goal_r < row), ("right", goal_c > col),
                                      ("left", goal_c < col)) if wanted]
    return f"The goal is {' and '.join(ways) or 'here'}. {', '.join(around)}."


def down_right_neighbours(desc: list[str], row: int, col: int) -> dict[str, tuple[int, int]]:
    """The tiles one step Down and one step Right of (row, col) that lie on the map: move name -> (row, col)."""
    size = len(desc)
    return {name: (row + dr, col + dc) for name, (dr, dc) in (("Down", MOVES["Down"]), ("Right", MOVES["Right"]))
            if row + dr < size and col + dc < size}


def step_into_holes(env: "FrozenLakeEnv", rng) -> str:
    """A scripted demonstrator that reads the map with the opposite aim: Down or Right onto an adjacent hole
    when there is one (Down first), else Down or Right at random (staying on the map when it can).

    SFT on its episodes (``data.demonstrator=envs.frozen_lake:step_into_holes``) gives a warm start that reads
    the surroundings but wants the wrong thing; RL from the task's reward must re-aim it (docs/tiny_model.md)."""
    inside = down_right_neighbours(env.desc, *env.position)
    holes = [name for name, (r, c) in inside.items() if env.desc[r][c] == "H"]
    if holes:
        return holes[0]
    return rng.choice(list(inside) or ["Down", "Right"])


def careless_walker(env: "FrozenLakeEnv", rng) -> str:
    """A scripted walker blind to holes by construction: Down or Right with equal probability among the moves
    that stay on the map, never reading what lies there (a hole as often as ice where one of them is a hole).

    Its moves carry no information about where the holes are, so SFT on its episodes
    (``data.demonstrator=envs.frozen_lake:careless_walker``) gives a warm start whose hole choice is held near
    one half by the data, not by the luck of the SFT: it knows the reply format, the goal's direction and the
    walls (a move off the map is never demonstrated), and RL must teach it to read the holes; measured, RL did not
    within 60 steps (docs/tiny_model.md, "Pipeline seeds")."""
    inside = down_right_neighbours(env.desc, *env.position)
    return rng.choice(sorted(inside) or ["Down", "Right"])


def noted_tiles(env: "FrozenLakeEnv") -> str:
    """What lies Down and Right of the player, in the surroundings line's words: ``Down: hole, Right: ice.``"""
    row, col = env.position
    size = len(env.desc)
    words = [TILE_WORDS[env.desc[row + dr][col + dc]] if row + dr < size and col + dc < size else "wall"
             for dr, dc in (MOVES["Down"], MOVES["Right"])]
    return f"Down: {words[0]}, Right: {words[1]}."


def noting_walker(env: "FrozenLakeEnv", rng) -> tuple[str, str]:
    """A walker that notes what lies Down and Right of it, then moves as :func:`careless_walker` does, blind to
    its note. Returns (action, think text): the reply's think copies the two tiles (:func:`noted_tiles`)."""
    return careless_walker(env, rng), noted_tiles(env)


def noting_reader(env: "FrozenLakeEnv", rng) -> tuple[str, str]:
    """A walker that notes what lies Down and Right of it and acts on the note's first word: Down when Down is ice
    or the goal, else Right. On maps without Down/Right dead ends (``no_dead_ends``) it wins every map in the
    fewest moves. Returns (action, think text) in :func:`noting_walker`'s reply format, so a model trained on it
    writes the replies make train's warm start writes (``make distill``'s teacher, docs/distillation.md)."""
    row, col = env.position
    size = len(env.desc)
    down_open = row + 1 < size and env.desc[row + 1][col] != "H"
    return ("Down" if down_open else "Right"), noted_tiles(env)


def hole_noting_walker(env: "FrozenLakeEnv", rng) -> tuple[str, str]:
    """A walker that notes what lies Down and Right of it and acts on the note with the wrong aim: half its moves
    onto a noted hole whenever there is one (:func:`step_into_holes`), the other half :func:`careless_walker`'s, so
    where exactly one of Down and Right is a hole it takes it three times in four. Returns (action, think text).

    SFT on its episodes (``data.demonstrator=envs.frozen_lake:hole_noting_walker``) asks for a copy of the two tiles
    at every turn and a move that follows them towards the hole, so that RL from the task's reward re-aims a reading
    that exists. Measured (docs/tiny_model.md, "Pipeline seeds"): on one model build of three the start read and RL
    re-aimed it; on the other two the copy did not form in 406 SFT steps and RL learned nothing."""
    action = step_into_holes(env, rng) if rng.random() < 0.5 else careless_walker(env, rng)
    return action, noted_tiles(env)


class FrozenLakeEnv(GymnasiumTextEnv):
    """FrozenLake on a random solvable map per seed, rendered as a text grid."""

    config_cls = FrozenLakeConfig

    def __init__(self, config: FrozenLakeConfig | None = None):
        """Create the env; the map is built at reset."""
        gym_config = GymnasiumConfig(env_id="FrozenLake-v1", action_names=ACTIONS, env_kwargs={},
                                     success_reward=1.0)
        super().__init__(config, gym_config=gym_config)
        self.desc: list[str] = []
        self._policy: list[int] | None = None

    def _rebuild_each_reset(self) -> bool:
        return True

    def _make_gym_env(self, seed: int | None) -> Any:
        map_seed = self.config.map_seed if self.config.map_seed is not None else seed
        self.desc = generate_map(self.config.size, float(self.config.p), map_seed, self.config.no_dead_ends)
        self._policy = None
        # A copy of the map's one gymnasium env: the copy shares the transition table (read-only) and gets its own
        # position and random generator at reset; building the table is most of a reset's time.
        return copy.copy(_gym_lake(tuple(self.desc), bool(self.config.is_slippery), float(self.config.success_rate)))

    @property
    def position(self) -> tuple[int, int]:
        """(row, col) of the player."""
        s = int(self._gym.unwrapped.s)
        return divmod(s, self.config.size)

    def render(self) -> str:
        """The map with P / _ / O / G / X / W symbols, one row per line."""
        if self._gym is None:
            return ""
        row, col = self.position
        lines = []
        for r, line in enumerate(self.desc):
            cells = []
            for c, tile in enumerate(line):
                if (r, c) == (row, col):
                    cells.append({"H": "X", "G": "W"}.get(tile, "P"))
                else:
                    cells.append({"H": "O", "G": "G"}.get(tile, "_"))
            lines.append(" ".join(cells))
        if self.config.describe_surroundings and self.desc[row][col] not in "HG":
            lines.append(describe_surroundings(self.desc, row, col))
        return "\n".join(lines)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """The gymnasium step, plus the reading diagnostic ``chose_hole`` on the turns that test reading.

        When exactly one of the Down and Right neighbours is a hole and the other is on the map and safe, the
        info carries ``chose_hole`` = 1.0 if the move went onto that hole, else 0.0 (absent on other turns). Its
        mean is logged as ``env/<tag>/chose_hole`` (``val/env/<tag>/chose_hole`` at validation): about 0.5 for
        a policy blind to the map, 0 for one that reads the surroundings and avoids holes, 1 for one that
        seeks them."""
        hole = self._the_one_down_right_hole()
        observation, reward, done, info = super().step(action)
        if hole is not None:
            info["chose_hole"] = float(self.position == hole)
        if done and self.config.hole_reward and self.desc[self.position[0]][self.position[1]] == "H":
            reward = float(self.config.hole_reward)
        return observation, reward, done, info

    def _the_one_down_right_hole(self) -> tuple[int, int] | None:
        """The Down or Right neighbour that is a hole when exactly one of the two is (both on the map)."""
        if self._gym is None or self._done:
            return None
        row, col = self.position
        inside = down_right_neighbours(self.desc, row, col)
        if len(inside) < 2 or self.desc[row][col] in "HG":
            return None
        holes = [(r, c) for r, c in inside.values() if self.desc[r][c] == "H"]
        return holes[0] if len(holes) == 1 else None

    def legend(self) -> str:
        """Symbols used by render()."""
        return LEGEND

    def note(self) -> str | None:
        """With ``describe_surroundings``, what lies Down and Right of the player (:func:`noted_tiles`), the
        two words a move needs; None without the line, before reset and once the episode has ended."""
        if not self.config.describe_surroundings or self._gym is None:
            return None
        row, col = self.position
        return None if self.desc[row][col] in "HG" else noted_tiles(self)

    def expert_action(self) -> str:
        """Optimal move: shortest path when not slippery, max success probability otherwise."""
        if self._gym is None:
            raise RuntimeError("call reset() before expert_action()")
        if self._policy is None:
            transitions = self._gym.unwrapped.P
            self._policy = mdp_greedy_policy(transitions, len(transitions), len(ACTIONS))
        return ACTIONS[self._policy[int(self._gym.unwrapped.s)]]
