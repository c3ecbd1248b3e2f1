"""Guess the hidden number: a complete custom environment (docs/writing_an_environment.md)."""

from dataclasses import dataclass

import numpy as np

from envs import BaseEnv, make_info


@dataclass
class GuessNumberConfig:
    """Options; the tag's env_config is checked against these fields."""

    high: int = 100
    """The hidden number is drawn from 1..high."""

    def __post_init__(self):
        if self.high < 2:
            raise ValueError(f"high must be >= 2, got {self.high}")


class GuessNumberEnv(BaseEnv):
    """Each turn the agent guesses; the env answers higher / lower; reward 1 when right."""

    config_cls = GuessNumberConfig

    def reset(self, seed=None, **kwargs):
        self.secret = int(np.random.default_rng(seed).integers(1, self.config.high + 1))
        self.lo, self.hi, self.done, self.text = 1, self.config.high, False, "Make a guess."
        return self.render()

    def step(self, action):
        text = action.strip() if isinstance(action, str) else ""
        if self.done or not (text.isascii() and text.isdigit()) or len(text) > 9:  # garbage is flagged
            return self.render(), 0.0, self.done, make_info(self.done, False, False)
        guess = int(text)
        effective = self.lo <= guess <= self.hi  # a guess outside the known range teaches nothing
        if guess < self.secret:
            self.lo, self.text = max(self.lo, guess + 1), f"{guess} is too low."
        elif guess > self.secret:
            self.hi, self.text = min(self.hi, guess - 1), f"{guess} is too high."
        else:
            self.done, self.text = True, f"{guess} is right!"
        return self.render(), float(self.done), self.done, make_info(self.done, True, effective)

    def render(self):
        return f"{self.text} The number is between {self.lo} and {self.hi}."

    def action_description(self):
        return f"a whole number from 1 to {self.config.high}"

    def expert_action(self):
        return str((self.lo + self.hi) // 2)  # binary search
