"""Two-armed bandit (RAGEN's): one pull, then the episode ends.

The low arm always pays ``lo_arm_score`` (0.1); the high arm pays
``hi_arm_hiscore`` (1) with probability ``hi_arm_hiscore_prob`` (0.25) and
``hi_arm_loscore`` (0) otherwise. With the defaults the high arm is better in
expectation (0.25 > 0.1); ``success`` means the agent pulled the arm with the
higher expected payout. The payout draw is seeded by ``reset(seed)``.

The observation names the arms and nothing else; the action is an arm's name
(case-insensitive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import BaseEnv, make_info, parse_choice


@dataclass
class BanditConfig:
    """Options of the two-armed bandit."""

    lo_arm_name: str = "Phoenix"
    """Name of the safe arm."""
    hi_arm_name: str = "Dragon"
    """Name of the risky arm."""
    lo_arm_score: float = 0.1
    """Payout of the safe arm."""
    hi_arm_loscore: float = 0.0
    """Payout of the risky arm when it misses."""
    hi_arm_hiscore: float = 1.0
    """Payout of the risky arm when it hits."""
    hi_arm_hiscore_prob: float = 0.25
    """Probability that the risky arm hits."""

    def __post_init__(self):
        for key in ("lo_arm_name", "hi_arm_name"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                raise ValueError(f"{key} must be a non-empty string, got {getattr(self, key)!r}")
        if self.lo_arm_name.strip().lower() == self.hi_arm_name.strip().lower():
            raise ValueError(f"arm names must differ, got {self.lo_arm_name!r} twice")
        if not 0.0 <= float(self.hi_arm_hiscore_prob) <= 1.0:
            raise ValueError(f"hi_arm_hiscore_prob must be in [0, 1], got {self.hi_arm_hiscore_prob!r}")


class BanditEnv(BaseEnv):
    """Single-turn two-armed bandit with named arms."""

    config_cls = BanditConfig

    def __init__(self, config: BanditConfig | None = None):
        """Create the env; call reset() before step()."""
        super().__init__(config)
        self.arms = [self.config.lo_arm_name.strip(), self.config.hi_arm_name.strip()]
        self._rng = np.random.default_rng()
        self.done = False
        self.last_arm: str | None = None
        self.last_reward = 0.0

    def expected_payouts(self) -> dict[str, float]:
        """Expected payout per arm name."""
        c = self.config
        p = float(c.hi_arm_hiscore_prob)
        return {self.arms[0]: float(c.lo_arm_score),
                self.arms[1]: p * float(c.hi_arm_hiscore) + (1 - p) * float(c.hi_arm_loscore)}

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start a new pull; the seed fixes the risky arm's outcome."""
        self._rng = np.random.default_rng(seed)
        self.done, self.last_arm, self.last_reward = False, None, 0.0
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Pull the named arm; unknown names are invalid and keep the episode open."""
        arm = parse_choice(action, self.arms)
        if arm is None or self.done:
            return self.render(), 0.0, self.done, make_info(self._success(), arm is not None, False)
        c = self.config
        if arm == self.arms[0]:
            reward = float(c.lo_arm_score)
        else:
            hit = self._rng.random() < float(c.hi_arm_hiscore_prob)
            reward = float(c.hi_arm_hiscore if hit else c.hi_arm_loscore)
        self.done, self.last_arm, self.last_reward = True, arm, reward
        return self.render(), reward, True, make_info(self._success(), True, True)

    def _success(self) -> bool:
        if self.last_arm is None:
            return False
        payouts = self.expected_payouts()
        return payouts[self.last_arm] >= max(payouts.values())

    def render(self) -> str:
        """The two arm names, and the outcome after the pull."""
        if self.last_arm is None:
            return f"You face two slot machine arms: {self.arms[0]} and {self.arms[1]}. Pull one."
        return f"You pulled {self.last_arm} and won {self.last_reward:g}."

    def action_description(self) -> str:
        """The two arm names."""
        return " | ".join(self.arms)

    def expert_action(self) -> str:
        """The arm with the higher expected payout."""
        payouts = self.expected_payouts()
        return max(self.arms, key=lambda a: payouts[a])
