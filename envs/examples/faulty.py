"""A misbehaving environment for fault-injection tests (tests/faults, docs/reliability.md).

``env_config.fault`` picks what goes wrong; everything else is a trivial game: any answer is
valid, the reward is 0.1 per step and the episode ends after ``steps`` steps.

| fault | what the env does |
| --- | --- |
| ``none`` | behaves |
| ``hang_step`` / ``hang_reset`` | ``step`` / ``reset`` sleeps ``seconds`` (default an hour) |
| ``raise_step`` / ``raise_reset`` | ``step`` / ``reset`` raises ``RuntimeError`` |
| ``wrong_types`` | ``step`` returns an int observation and a str reward |
| ``nan_reward`` | ``step`` returns a NaN reward |
| ``megabytes`` | ``reset`` and ``step`` print ``chars`` characters and return an observation that long |
| ``surrogates`` | observations hold a lone surrogate (``\\ud800``) and a NUL byte |
| ``exit_step`` | ``step`` ends the process at once (``os._exit``): an env actor, or a server serving the env, dies |
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from envs import BaseEnv, make_info

FAULTS = ("none", "hang_step", "hang_reset", "raise_step", "raise_reset", "wrong_types", "nan_reward",
          "megabytes", "surrogates", "exit_step")


@dataclass
class FaultyConfig:
    """Which fault to inject."""

    fault: str = "none"
    """One of :data:`FAULTS`."""
    seconds: float = 3600.0
    """How long a hang lasts."""
    chars: int = 2_000_000
    """Length of a ``megabytes`` observation (and of what it prints)."""
    steps: int = 3
    """Steps until the episode ends."""

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {list(FAULTS)}, got {self.fault!r}")


class FaultyEnv(BaseEnv):
    """Injects ``config.fault`` into a trivial game."""

    config_cls = FaultyConfig

    def reset(self, seed=None, **kwargs):
        self.t = 0
        fault = self.config.fault
        if fault == "hang_reset":
            time.sleep(self.config.seconds)
        if fault == "raise_reset":
            raise RuntimeError(f"injected reset failure (seed {seed})")
        return self.render()

    def step(self, action):
        fault = self.config.fault
        self.t += 1
        if fault == "exit_step":
            os._exit(3)
        done = self.t >= self.config.steps
        if fault == "hang_step":
            time.sleep(self.config.seconds)
        if fault == "raise_step":
            raise RuntimeError("injected step failure")
        if fault == "wrong_types":
            return 12345, "high", done, {}
        reward = float("nan") if fault == "nan_reward" else 0.1
        return self.render(), reward, done, make_info(False, True, True)

    def render(self):
        if self.config.fault == "megabytes":
            text = "M" * self.config.chars
            print(text, flush=True)
            return text
        if self.config.fault == "surrogates":
            return f"step {self.t}: lone \ud800 surrogate and a NUL \x00 byte"
        return f"step {self.t} of {self.config.steps}"

    def action_description(self):
        return "any word"
