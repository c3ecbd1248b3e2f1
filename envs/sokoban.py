"""Sokoban: push every box onto a target.

Rooms are generated per seed by *reverse play* (as in gym_sokoban's
``room_utils`` and RAGEN): a random-walk room topology, boxes placed on their
targets, then a breadth-first search of up to ``search_depth`` reverse moves
in which the player walks and *pulls* boxes. The state whose boxes are all
off target and farthest from the targets (then deepest) becomes the start. Replaying those
pulls forward as pushes solves the room, so every room is solvable.
(gym_sokoban's own generator uses the global ``random`` state and has no
``search_depth`` argument, hence this seeded port.)

Rewards (gym_sokoban's): -0.1 per step, +1 for pushing a box onto a target,
-1 for pushing one off, +10 when all boxes are on targets. The episode ends
when solved or after ``max_steps`` steps. Actions: Up | Down | Left | Right
(moving into a box pushes it if the cell behind it is free).

Legend: # wall, _ floor, O target, X box, * box on target, P player,
S player on target.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import BaseEnv, make_info, parse_choice
from envs.experts import SOKOBAN_MOVES, sokoban_solve

ACTIONS = ["Up", "Down", "Left", "Right"]
LEGEND = ("Legend: # is a wall, _ is floor, O is a target, X is a box, * is a box on a target, "
          "P is you, S is you standing on a target.")
_MASKS = [  # room-topology brushes from gym_sokoban
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
]
_MAX_REVERSE_STATES = 20_000  # bounds generation time on large rooms


@dataclass
class SokobanConfig:
    """Options of the Sokoban environment."""

    dim_room: tuple = (6, 6)
    """Room size (rows, cols), walls included."""
    num_boxes: int = 1
    """Number of boxes (and targets)."""
    max_steps: int = 100
    """Episode ends after this many steps."""
    search_depth: int = 30
    """Reverse-play depth: deeper gives harder (longer) puzzles."""
    dim_x: int | None = None
    """RAGEN-style alias: rows of the room (overrides dim_room[0])."""
    dim_y: int | None = None
    """RAGEN-style alias: columns of the room (overrides dim_room[1])."""
    p_change_directions: float = 0.35
    """Topology random walk: probability of turning at each step."""

    def __post_init__(self):
        dims = list(self.dim_room)
        if self.dim_x is not None:
            dims[0] = self.dim_x
        if self.dim_y is not None:
            dims[1] = self.dim_y
        if len(dims) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and 5 <= d <= 15 for d in dims):
            raise ValueError(f"dim_room must be two ints in [5, 15], got {dims!r}")
        self.dim_room = tuple(dims)
        if not isinstance(self.num_boxes, int) or not 1 <= self.num_boxes <= 4:
            raise ValueError(f"num_boxes must be an int in [1, 4], got {self.num_boxes!r}")
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {self.max_steps!r}")
        if not isinstance(self.search_depth, int) or not 1 <= self.search_depth <= 300:
            raise ValueError(f"search_depth must be an int in [1, 300], got {self.search_depth!r}")
        if not 0.0 <= float(self.p_change_directions) <= 1.0:
            raise ValueError(f"p_change_directions must be in [0, 1], got {self.p_change_directions!r}")


def _topology(dim: tuple, p_change: float, rng: np.random.Generator) -> set:
    """Floor cells carved by a random walk with 3x3 brushes (gym_sokoban's algorithm)."""
    rows, cols = dim
    directions = [(1, 0), (0, 1), (-1, 0), (0, -1)]
    direction = directions[rng.integers(4)]
    pos = [int(rng.integers(1, rows - 1)), int(rng.integers(1, cols - 1))]
    level = np.zeros(dim, dtype=int)
    for _ in range(int(1.7 * (rows + cols))):
        if rng.random() < p_change:
            direction = directions[rng.integers(4)]
        pos = [min(max(pos[0] + direction[0], 1), rows - 2), min(max(pos[1] + direction[1], 1), cols - 2)]
        mask = np.array(_MASKS[rng.integers(len(_MASKS))])
        level[pos[0] - 1:pos[0] + 2, pos[1] - 1:pos[1] + 2] += mask
    level[:, [0, cols - 1]] = 0
    level[[0, rows - 1], :] = 0
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(level))}


def _reverse_play(floor: set, targets: frozenset, player: tuple, depth: int):
    """BFS over reverse moves (walk or pull); return the hardest start found or None."""
    start = (player, targets)
    seen = {start}
    frontier = deque([(start, 0)])
    best, best_score = None, (0, 0)
    while frontier:
        (ply, boxes), d = frontier.popleft()
        if not boxes & targets:  # every box off target
            # Prefer boxes far from targets, then more reverse moves (a longer solution).
            score = (sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in targets) for b in boxes), d)
            if score > best_score:
                best, best_score = (ply, boxes), score
        if d >= depth or len(seen) >= _MAX_REVERSE_STATES:
            continue
        for dr, dc in SOKOBAN_MOVES.values():
            nxt = (ply[0] + dr, ply[1] + dc)
            if nxt not in floor or nxt in boxes:
                continue
            options = [(nxt, boxes)]
            behind = (ply[0] - dr, ply[1] - dc)
            if behind in boxes:  # pull the box behind the player along
                options.append((nxt, (boxes - {behind}) | {ply}))
            for state in options:
                if state not in seen:
                    seen.add(state)
                    frontier.append((state, d + 1))
    return best


def generate_room(config: SokobanConfig, seed: int | None, tries: int = 50):
    """(walls, targets, boxes, player) for a solvable room, deterministic per seed."""
    rng = np.random.default_rng(seed)
    rows, cols = config.dim_room
    for _ in range(tries):
        floor = _topology(config.dim_room, float(config.p_change_directions), rng)
        cells = sorted(floor)
        if len(cells) < config.num_boxes + 2:
            continue
        picks = rng.choice(len(cells), size=config.num_boxes + 1, replace=False)
        player, targets = cells[picks[0]], frozenset(cells[i] for i in picks[1:])
        found = _reverse_play(floor, targets, player, config.search_depth)
        if found is not None:
            walls = {(r, c) for r in range(rows) for c in range(cols)} - floor
            return walls, targets, found[1], found[0]
    raise RuntimeError(f"could not generate a {config.dim_room} room with {config.num_boxes} boxes "
                       f"in {tries} tries; use a larger room or fewer boxes")


class SokobanEnv(BaseEnv):
    """Sokoban on a reverse-played room per seed."""

    config_cls = SokobanConfig

    def __init__(self, config: SokobanConfig | None = None):
        """Create the env; the room is generated at reset."""
        super().__init__(config)
        self.walls: set = set()
        self.targets: frozenset = frozenset()
        self.boxes: frozenset = frozenset()
        self.player: tuple = (0, 0)
        self.steps = 0
        self._plan: list[str] = []
        self._plan_state: Any = None

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Generate the room for ``seed`` and return its rendering."""
        self.walls, self.targets, self.boxes, self.player = generate_room(self.config, seed)
        self.steps = 0
        self._plan, self._plan_state = [], None
        return self.render()

    @property
    def solved(self) -> bool:
        """All boxes are on targets."""
        return bool(self.boxes) and self.boxes <= self.targets

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Move or push; invalid text leaves the room unchanged with reward 0."""
        name = parse_choice(action, ACTIONS)
        done = self.solved or self.steps >= self.config.max_steps
        if name is None or done:
            return self.render(), 0.0, done, make_info(self.solved, name is not None, False)
        dr, dc = SOKOBAN_MOVES[name]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        reward, moved = -0.1, False
        if nxt not in self.walls:
            if nxt not in self.boxes:
                self.player, moved = nxt, True
            else:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond not in self.walls and beyond not in self.boxes:
                    self.boxes = (self.boxes - {nxt}) | {beyond}
                    self.player, moved = nxt, True
                    reward += (beyond in self.targets) - (nxt in self.targets)
        self.steps += 1
        if self.solved:
            reward += 10.0
        done = self.solved or self.steps >= self.config.max_steps
        return self.render(), float(reward), done, make_info(self.solved, True, moved)

    def render(self) -> str:
        """Grid rows with the legend's symbols, cells separated by spaces."""
        rows, cols = self.config.dim_room
        lines = []
        for r in range(rows):
            cells = []
            for c in range(cols):
                p = (r, c)
                if p in self.walls:
                    cells.append("#")
                elif p == self.player:
                    cells.append("S" if p in self.targets else "P")
                elif p in self.boxes:
                    cells.append("*" if p in self.targets else "X")
                else:
                    cells.append("O" if p in self.targets else "_")
            lines.append(" ".join(cells))
        return "\n".join(lines)

    def action_description(self) -> str:
        """``Up | Down | Left | Right``."""
        return " | ".join(ACTIONS)

    def legend(self) -> str:
        """Symbols used by render()."""
        return LEGEND

    def expert_action(self) -> str:
        """Next move of a shortest solution (BFS), replanned if the state changed."""
        state = (self.player, self.boxes)
        if not self._plan or self._plan_state != state:
            plan = sokoban_solve(self.walls, self.targets, self.boxes, self.player)
            if not plan:
                raise RuntimeError("no solution from the current state (a box is stuck)")
            self._plan = plan
        action = self._plan.pop(0)
        dr, dc = SOKOBAN_MOVES[action]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        boxes = self.boxes
        if nxt in boxes:
            boxes = (boxes - {nxt}) | {(nxt[0] + dr, nxt[1] + dc)}
        self._plan_state = (nxt, boxes)  # the state the plan expects after this move
        return action
