"""Turn any gymnasium environment with discrete actions and a text render into a BaseEnv.

Given an action-name table (index i of the table is gymnasium action i), the
wrapper parses the model's action text case-insensitively, steps the
gymnasium env and returns its ANSI render (escape codes stripped) as the
observation::

    env = GymnasiumTextEnv(GymnasiumConfig(env_id="CliffWalking-v1",
                                           action_names=["Up", "Right", "Down", "Left"]))

or wrap an env you built yourself: ``GymnasiumTextEnv.from_gym(gym_env, names)``.
An episode is a success when it terminates with a reward of at least
``success_reward``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.base import BaseEnv, make_info, parse_choice

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class GymnasiumConfig:
    """Options of the gymnasium wrapper."""

    env_id: str = "CliffWalking-v1"
    """gymnasium id passed to ``gymnasium.make(env_id, render_mode="ansi", **env_kwargs)``.
    The default renders x (you), o (floor), C (cliff), T (target)."""
    action_names: list = field(default_factory=lambda: ["Up", "Right", "Down", "Left"])
    """Name of each discrete action, in gymnasium's action order."""
    env_kwargs: dict = field(default_factory=lambda: {"max_episode_steps": 100})
    """Extra keyword arguments for ``gymnasium.make``."""
    success_reward: float = -1.0
    """A terminating step with reward >= this counts as success (CliffWalking
    pays -1 per step, also on the step reaching the target)."""

    def __post_init__(self):
        names = list(self.action_names)
        if not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise ValueError(f"action_names must be non-empty strings, got {self.action_names!r}")
        if len({n.lower() for n in names}) != len(names):
            raise ValueError(f"action_names must be unique ignoring case, got {names!r}")


class GymnasiumTextEnv(BaseEnv):
    """BaseEnv over a gymnasium env with a ``Discrete`` action space and ANSI rendering."""

    config_cls = GymnasiumConfig

    def __init__(self, config: Any = None, gym_env: Any = None,
                 gym_config: GymnasiumConfig | None = None):
        """Build from a config, or wrap ``gym_env`` (which must render in "ansi" mode).

        Subclasses with their own config class pass the wrapper options as
        ``gym_config``; otherwise ``config`` is the GymnasiumConfig.
        """
        super().__init__(config)
        self.gym_config = gym_config if gym_config is not None else self.config
        self.action_names = list(self.gym_config.action_names)
        self._gym = gym_env
        self._done = False
        self._success = False
        self._last_obs: Any = None
        if gym_env is not None:
            self._check_action_space(gym_env)

    @classmethod
    def from_gym(cls, gym_env: Any, action_names: list[str], success_reward: float = 1.0):
        """Wrap an existing gymnasium env given the name of each discrete action."""
        cfg = GymnasiumConfig(env_id="", action_names=list(action_names), env_kwargs={},
                              success_reward=success_reward)
        return cls(cfg, gym_env=gym_env)

    # -- hooks for subclasses -------------------------------------------------
    def _make_gym_env(self, seed: int | None) -> Any:
        """Create the gymnasium env; subclasses may build a new one per seed."""
        import gymnasium

        try:
            return gymnasium.make(self.gym_config.env_id, render_mode="ansi", **self.gym_config.env_kwargs)
        except gymnasium.error.Error as exc:
            raise ValueError(f"gymnasium could not make env_id={self.gym_config.env_id!r}: {exc}") from exc

    def _rebuild_each_reset(self) -> bool:
        """Whether reset builds a new gymnasium env (e.g. a new map per seed)."""
        return False

    def _check_action_space(self, gym_env: Any) -> None:
        n = getattr(gym_env.action_space, "n", None)
        if n is None:
            raise ValueError(f"gymnasium env needs a Discrete action space, got {gym_env.action_space}")
        if int(n) != len(self.action_names):
            raise ValueError(
                f"action_names has {len(self.action_names)} names {self.action_names} "
                f"but the env has {int(n)} discrete actions; give one name per action"
            )

    # -- BaseEnv ---------------------------------------------------------------
    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Reset (building the gymnasium env when needed) and return the render."""
        if self._gym is None or self._rebuild_each_reset():
            if self._gym is not None:
                self._gym.close()
            self._gym = self._make_gym_env(seed)
            self._check_action_space(self._gym)
        self._last_obs, _ = self._gym.reset(seed=seed)
        self._done = False
        self._success = False
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Parse the action name and step the gymnasium env; never raises on bad text."""
        if self._gym is None:
            raise RuntimeError("call reset() before step()")
        name = parse_choice(action, self.action_names)
        if name is None or self._done:
            # An unknown action (or any action after the end) leaves the state unchanged.
            info = make_info(self._success, name is not None, False)
            return self.render(), 0.0, self._done, info
        obs, reward, terminated, truncated, _ = self._gym.step(self.action_names.index(name))
        effective = not _same(obs, self._last_obs)
        self._last_obs = obs
        self._done = bool(terminated or truncated)
        if terminated and float(reward) >= self.gym_config.success_reward:
            self._success = True
        return self.render(), float(reward), self._done, make_info(self._success, True, effective)

    def render(self) -> str:
        """The gymnasium ANSI render without colour codes."""
        if self._gym is None:
            return ""
        out = self._gym.render()
        if isinstance(out, (list, tuple)):
            out = "\n".join(map(str, out))
        return _ANSI_ESCAPE.sub("", str(out)).strip("\n").rstrip()

    def action_description(self) -> str:
        """The action names joined by " | "."""
        return " | ".join(self.action_names)

    def close(self) -> None:
        """Close the gymnasium env."""
        if self._gym is not None:
            self._gym.close()
            self._gym = None


def _same(a: Any, b: Any) -> bool:
    """Observation equality that works for ints, arrays and tuples."""
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except Exception:  # exotic observation types: fall back to ==
        return a == b
