"""The slow test env (bench P6): seeded long-tailed latency around FrozenLake's game."""

from __future__ import annotations

import time

import pytest

import envs
from envs.slow_env import SlowFrozenLakeConfig, step_latency_ms


def test_latency_spans_min_to_max_with_a_long_tail():
    cfg = SlowFrozenLakeConfig(min_latency_ms=50, max_latency_ms=500, tail_power=3)
    assert step_latency_ms(0.0, cfg) == pytest.approx(50)
    assert step_latency_ms(1.0, cfg) == pytest.approx(500)
    assert step_latency_ms(0.5, cfg) == pytest.approx(50 * 10 ** 0.125)  # median ~67 ms
    draws = sorted(step_latency_ms(i / 1000, cfg) for i in range(1000))
    assert draws[500] < 70 and 0.05 < sum(d > 300 for d in draws) / 1000 < 0.12


def test_same_seed_same_delays_and_the_game_is_frozen_lake():
    env = envs.make_env("slow_frozen_lake", size=3, p=0.9, min_latency_ms=1, max_latency_ms=20)
    plain = envs.make_env("frozen_lake", size=3, p=0.9)
    delays = []
    for _ in range(2):
        assert env.reset(seed=7) == plain.reset(seed=7)
        start = time.perf_counter()
        out = env.step("Down")
        assert time.perf_counter() - start >= env.last_latency_ms / 1000
        assert out[:3] == plain.step("Down")[:3]
        delays.append(env.last_latency_ms)
    assert delays[0] == delays[1] and 1 <= delays[0] <= 20


@pytest.mark.parametrize("bad", [{"min_latency_ms": 600, "max_latency_ms": 500}, {"tail_power": 0}])
def test_bad_latency_options_are_refused(bad):
    with pytest.raises(ValueError):
        SlowFrozenLakeConfig(**bad)
