"""A thermostat: an environment written from docs/writing_an_environment.md alone, as a user would.

The room starts a few degrees off the set point; each turn the agent reads whether the room is too cold,
too hot or just right and answers Heat (one degree up), Chill (one degree down) or Steady. Steady ends the
episode: a success when the room is just right. Reading the observation is what pays: a fixed sequence of
actions, blind to the room, wins only the rooms that start where that sequence happens to end.
"""

from dataclasses import dataclass

import numpy as np

from envs import BaseEnv, make_info, parse_choice

ACTIONS = ("Heat", "Chill", "Steady")


@dataclass
class ThermostatConfig:
    """Options; the tag's env_config is checked against these fields."""

    max_offset: int = 2
    """The room starts 0..max_offset degrees below or above the set point."""

    def __post_init__(self):
        if self.max_offset < 1:
            raise ValueError(f"max_offset must be >= 1, got {self.max_offset}")


class ThermostatEnv(BaseEnv):
    """Bring the room to the set point, then hold it: Steady when just right wins (reward 1)."""

    config_cls = ThermostatConfig

    def reset(self, seed=None, **kwargs):
        self.offset = int(np.random.default_rng(seed).integers(-self.config.max_offset, self.config.max_offset + 1))
        self.done = False
        return self.render()

    def step(self, action):
        choice = parse_choice(action, ACTIONS)
        if self.done or choice is None:  # garbage is flagged invalid and changes nothing
            return self.render(), 0.0, self.done, make_info(self.done, False, False)
        if choice == "Steady":
            self.done = True
            success = self.offset == 0
            return self.render(), float(success), True, make_info(success, True, True)
        self.offset += 1 if choice == "Heat" else -1
        return self.render(), 0.0, False, make_info(False, True, True)

    def render(self):
        if self.offset < 0:
            return "The room is too cold."
        if self.offset > 0:
            return "The room is too hot."
        return "The room is just right."

    def action_description(self):
        return " | ".join(ACTIONS)

    def expert_action(self):
        return "Heat" if self.offset < 0 else "Chill" if self.offset > 0 else "Steady"
