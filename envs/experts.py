"""Expert solvers: the oracle behind each environment's ``expert_action``.

Pure functions over small state descriptions, so tests, SFT data generation
and benchmarks share one implementation:

- ``mdp_greedy_policy``: value iteration over a tabular MDP (FrozenLake);
  shortest path when deterministic, highest success probability when slippery.
- ``sokoban_solve``: breadth-first search over (player, boxes) states;
  returns a shortest move sequence for small rooms.
- ``countdown_solve``: exhaustive search combining numbers with + - * /.
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction
from typing import Iterable, Mapping, Sequence


def mdp_greedy_policy(
    transitions: Mapping[int, Mapping[int, Sequence[tuple]]],
    n_states: int,
    n_actions: int,
    gamma: float = 0.99,
    iters: int = 1000,
    tol: float = 1e-6,
) -> list[int]:
    """Greedy policy of value iteration on gymnasium's tabular ``P[s][a]`` format.

    ``transitions[s][a]`` is a list of ``(prob, next_state, reward, done)``.
    The discount makes shorter paths strictly better, so on deterministic maps
    the policy follows a shortest path to the reward.
    """
    values = [0.0] * n_states

    def q(s: int, a: int) -> float:
        return sum(p * (r + (0.0 if done else gamma * values[s2])) for p, s2, r, done in transitions[s][a])

    for _ in range(iters):
        delta = 0.0
        for s in range(n_states):
            best = max(q(s, a) for a in range(n_actions))
            delta = max(delta, abs(best - values[s]))
            values[s] = best
        if delta < tol:
            break
    return [max(range(n_actions), key=lambda a, s=s: (q(s, a), -a)) for s in range(n_states)]


# --------------------------------------------------------------------------- Sokoban

# Directions shared with envs/sokoban.py: name -> (d_row, d_col)
SOKOBAN_MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def sokoban_solve(
    walls: Iterable[tuple[int, int]],
    targets: Iterable[tuple[int, int]],
    boxes: Iterable[tuple[int, int]],
    player: tuple[int, int],
    max_states: int = 500_000,
) -> list[str] | None:
    """Shortest action sequence solving a Sokoban room, or None if none is found.

    Breadth-first search over (player, frozenset(boxes)); fine for the small
    rooms used in training (6x6 to 8x8 with 1-2 boxes). ``max_states`` bounds
    the work on rooms that are too large.
    """
    walls, targets = frozenset(walls), frozenset(targets)
    start = (tuple(player), frozenset(map(tuple, boxes)))
    if start[1] <= targets:
        return []
    parents: dict = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        (pr, pc), bxs = state
        for name, (dr, dc) in SOKOBAN_MOVES.items():
            nxt = (pr + dr, pc + dc)
            if nxt in walls:
                continue
            new_boxes = bxs
            if nxt in bxs:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in walls or beyond in bxs:
                    continue
                new_boxes = (bxs - {nxt}) | {beyond}
            new_state = (nxt, new_boxes)
            if new_state in parents:
                continue
            parents[new_state] = (state, name)
            if new_boxes <= targets:
                return _unwind(parents, new_state)
            if len(parents) >= max_states:
                return None
            queue.append(new_state)
    return None


def _unwind(parents: dict, state) -> list[str]:
    actions = []
    while parents[state] is not None:
        state, name = parents[state]
        actions.append(name)
    return actions[::-1]


# --------------------------------------------------------------------------- Countdown


def countdown_solve(numbers: Sequence[int], target: int, use_all: bool = False) -> str | None:
    """An expression over ``numbers`` (each used at most once) equal to ``target``.

    Exhaustive search merging pairs with + - * / on exact fractions; returns
    the first expression found (with full parentheses) or None. With
    ``use_all`` every number must appear.
    """
    items = [(Fraction(n), str(n)) for n in numbers]
    target = Fraction(target)
    seen: set = set()

    def search(items: list) -> str | None:
        if not use_all or len(items) == 1:
            for value, expr in items:
                if value == target:
                    return expr
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i in range(len(items)):
            for j in range(len(items)):
                if i == j:
                    continue
                (a, ea), (b, eb) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                candidates = [(a - b, f"({ea} - {eb})"), (a + b, f"({ea} + {eb})") if i < j else None,
                              (a * b, f"({ea} * {eb})") if i < j else None,
                              (a / b, f"({ea} / {eb})") if b != 0 else None]
                for cand in candidates:
                    if cand is None:
                        continue
                    found = search(rest + [cand])
                    if found is not None:
                        return found
        return None

    found = search(items)
    if found is not None and found.startswith("(") and found.endswith(")") and _balanced(found[1:-1]):
        found = found[1:-1]
    return found


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0
