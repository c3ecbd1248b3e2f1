"""FrozenLake with a simulated slow backend: every ``step`` sleeps a long-tailed latency (``reset`` a fixed one).

A test environment for the rollout's turn barrier (bench P6): web or
tool environments (WebShop, search, code execution) answer in 50-500 ms with a
long tail, and a turn-synchronous rollout waits for the slowest episode of every
turn. The game is FrozenLake (so the tiny model's replies parse); only the delay
is added, drawn per step from a seeded distribution so runs are repeatable.

Latency of one step, with ``u`` uniform in [0, 1) from the episode's generator::

    latency_ms = min_latency_ms * (max_latency_ms / min_latency_ms) ** (u ** tail_power)

``tail_power`` 1 is log-uniform; larger values put most steps near the minimum and
a few near the maximum (3, the default: median ~67 ms, ~8% of steps above 300 ms
for 50-500 ms).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from envs.frozen_lake import FrozenLakeConfig, FrozenLakeEnv


@dataclass
class SlowFrozenLakeConfig(FrozenLakeConfig):
    """FrozenLake's options plus the simulated per-step latency."""

    min_latency_ms: float = 50.0
    """Shortest simulated step latency."""
    max_latency_ms: float = 500.0
    """Longest simulated step latency (the tail)."""
    tail_power: float = 3.0
    """Shape of the tail: 1 = log-uniform between min and max; larger = rarer slow steps."""
    reset_latency_ms: float = 0.0
    """Simulated time of every reset (an environment that starts a container or loads a page)."""

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= float(self.min_latency_ms) <= float(self.max_latency_ms):
            raise ValueError(f"need 0 <= min_latency_ms <= max_latency_ms, got {self.min_latency_ms!r} and "
                             f"{self.max_latency_ms!r}; e.g. min_latency_ms: 50, max_latency_ms: 500")
        if float(self.reset_latency_ms) < 0.0:
            raise ValueError(f"reset_latency_ms must be >= 0, got {self.reset_latency_ms!r}; "
                             "e.g. reset_latency_ms: 500")
        if float(self.tail_power) <= 0.0:
            raise ValueError(f"tail_power must be > 0, got {self.tail_power!r}; e.g. tail_power: 3")


def step_latency_ms(u: float, config: SlowFrozenLakeConfig) -> float:
    """The latency for a uniform draw ``u`` (formula in the module docstring)."""
    low, high = float(config.min_latency_ms), float(config.max_latency_ms)
    if low == 0.0:
        return high * u ** float(config.tail_power)
    return low * (high / low) ** (u ** float(config.tail_power))


class SlowFrozenLakeEnv(FrozenLakeEnv):
    """FrozenLake whose every step takes a seeded, long-tailed wall-clock latency."""

    config_cls = SlowFrozenLakeConfig

    def __init__(self, config: SlowFrozenLakeConfig | None = None):
        """Create the env; the latency generator is seeded at reset."""
        super().__init__(config)
        self._latency_rng = random.Random(0)
        self.last_latency_ms = 0.0

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Sleep ``reset_latency_ms``, then reset the game and the latency draws (same seed, same delays)."""
        time.sleep(float(self.config.reset_latency_ms) / 1000.0)
        self._latency_rng = random.Random(seed)
        return super().reset(seed=seed, **kwargs)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Sleep the simulated backend latency, then step FrozenLake."""
        self.last_latency_ms = step_latency_ms(self._latency_rng.random(), self.config)
        time.sleep(self.last_latency_ms / 1000.0)
        return super().step(action)
