"""TextWorld: text adventures generated locally (and the base of the ALFWorld adapter).

Games come from the ``textworld`` package (optional extra:
``pip install 'agent-trainer[textworld]'``), whose wheel ships the Inform7
compiler. A pool of ``num_games`` games is generated on first use into
``cache_dir`` with textworld's generator, the same as running::

    tw-make custom --world-size 3 --nb-objects 6 --quest-length 3 --seed <game_seed + i> --output <cache>/...z8

``reset(seed)`` plays game ``seed % num_games``, so the same seed always gives
the same game and the same first observation. Explicit ``game_files`` (any
.z8 / .ulx / .tw-pddl) replace the generated pool.

The action is a command such as ``go south`` or ``take glass``; it is valid
when it is one of the game's admissible commands (case and extra spaces
ignored), which every observation lists after "Available actions:". Invalid
commands are not sent to the game. Reward is the increase of the game score;
``success`` means the game is won.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import BaseEnv, make_info

MAX_COMMAND_CHARS = 200
_INSTALL_HINT = "TextWorld is an optional dependency: pip install 'agent-trainer[textworld]' (textworld==1.7.0)"


def default_cache_dir() -> str:
    """``$AGENT_TRAINER_CACHE/textworld`` or ``~/.cache/agent_trainer/textworld``."""
    root = os.environ.get("AGENT_TRAINER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "agent_trainer")
    return os.path.join(root, "textworld")


def _import_textworld():
    try:
        import textworld
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return textworld


@dataclass
class TextWorldConfig:
    """Options of the TextWorld environment."""

    world_size: int = 3
    """Rooms per generated game (tw-make --world-size)."""
    nb_objects: int = 6
    """Objects per generated game (tw-make --nb-objects)."""
    quest_length: int = 3
    """Commands the quest needs (tw-make --quest-length)."""
    num_games: int = 8
    """Size of the generated game pool; seed s plays game s % num_games."""
    game_seed: int = 0
    """Generator seed of game 0 (game i uses game_seed + i)."""
    cache_dir: str | None = None
    """Where generated games are stored (None: $AGENT_TRAINER_CACHE/textworld or ~/.cache/agent_trainer/textworld)."""
    game_files: list = field(default_factory=list)
    """Play these game files instead of generated ones."""
    show_admissible: bool = True
    """List the admissible commands after each observation."""

    def __post_init__(self):
        for key in ("world_size", "nb_objects", "quest_length", "num_games"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        missing = [f for f in self.game_files if not Path(f).exists()]
        if missing:
            raise ValueError(f"game_files not found: {missing}")


def generate_game(config: TextWorldConfig, game_seed: int, cache_dir: str) -> str:
    """Path of the generated game for ``game_seed``, generating it once (process-safe)."""
    import fcntl

    name = f"tw_w{config.world_size}_o{config.nb_objects}_q{config.quest_length}_s{game_seed}"
    path = Path(cache_dir) / f"{name}.z8"
    if path.exists():
        return str(path)
    textworld = _import_textworld()
    import textworld.generator

    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    # Several env actors may ask for the same game at once: one generates, the others wait.
    with open(Path(cache_dir) / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return str(path)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            options = textworld.GameOptions()
            options.seeds = game_seed
            options.nb_rooms = config.world_size
            options.nb_objects = config.nb_objects
            options.quest_length = config.quest_length
            options.path = str(Path(tmp) / f"{name}.z8")
            options.force_recompile = True
            game = textworld.generator.make_game(options)
            built = Path(textworld.generator.compile_game(game, options))
            shutil.move(str(built.with_suffix(".json")), str(path.with_suffix(".json")))
            shutil.move(str(built), str(path))  # the .z8 appears last: it marks a complete game
    return str(path)


def clean_text(text: str) -> str:
    """Drop TextWorld's banner, the input prompt and the status line; squeeze blank lines."""
    text = text or ""
    if "$$" in text:  # the ASCII-art banner of the first observation
        text = text.split("\n")
        text = "\n".join(line for line in text if "$$" not in line and "__" not in line)
    text = re.split(r"\n>", "\n" + text)[0] if ">" in text else text
    lines = [line.strip() for line in text.split("\n") if "Would you like to RESTART" not in line]
    return re.sub(r"\n\s*\n+", "\n\n", "\n".join(lines)).strip()


class TextWorldEnv(BaseEnv):
    """Play TextWorld games with admissible-command actions."""

    config_cls = TextWorldConfig

    def __init__(self, config: TextWorldConfig | None = None):
        """Check textworld is importable; games are generated on first reset."""
        super().__init__(config)
        self._textworld = _import_textworld()
        self._env: Any = None
        self._game_file: str | None = None
        self._state: Any = None
        self.admissible: list[str] = []
        self.score, self.done, self.success = 0.0, False, False
        self.observation = ""

    # -- hooks for ALFWorld ---------------------------------------------------
    def game_pool_size(self) -> int:
        """Number of games seeds are mapped onto."""
        return len(self.config.game_files) or self.config.num_games

    def game_file(self, index: int) -> str:
        """Path of game ``index`` (generated on demand)."""
        if self.config.game_files:
            return str(self.config.game_files[index])
        cache = self.config.cache_dir or default_cache_dir()
        return generate_game(self.config, self.config.game_seed + index, cache)

    def wrappers(self) -> list:
        """TextWorld wrappers applied to each game."""
        return []

    # -- BaseEnv ---------------------------------------------------------------
    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start game ``seed % pool size`` from its beginning."""
        rng = np.random.default_rng(seed)
        index = seed % self.game_pool_size() if seed is not None else int(rng.integers(self.game_pool_size()))
        path = self.game_file(index)
        if path != self._game_file:
            self.close()
            infos = self._textworld.EnvInfos(admissible_commands=True, policy_commands=True, won=True,
                                             lost=True, score=True, max_score=True, objective=True,
                                             description=True)
            with warnings.catch_warnings():  # jericho warns that generated games are "not fully supported"
                warnings.simplefilter("ignore")
                self._env = self._textworld.start(path, request_infos=infos, wrappers=self.wrappers())
            self._game_file = path
        self._state = self._env.reset()
        self.score, self.done, self.success = float(self._state.get("score") or 0), False, False
        self.admissible = list(self._state.get("admissible_commands") or [])
        objective = self._state.get("objective") or ""
        self.observation = f"{objective}\n\n{clean_text(self._state.get('description') or self._state.feedback)}".strip()
        return self.render()

    @staticmethod
    def _normalize(command: str) -> str:
        return re.sub(r"\s+", " ", command.strip().strip(".!").strip().lower())

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Run an admissible command; anything else is invalid and not sent to the game."""
        if self._env is None:
            raise RuntimeError("call reset() before step()")
        command = self._normalize(action) if isinstance(action, str) and len(action) <= MAX_COMMAND_CHARS else ""
        lookup = {self._normalize(c): c for c in self.admissible}
        if command not in lookup or self.done:
            return self.render(), 0.0, self.done, make_info(self.success, command in lookup, False)
        before = (sorted(self.admissible), self._state.get("description"))
        self._state, score, done = self._env.step(lookup[command])
        score = float(score or 0)
        reward, self.score = score - self.score, score
        self.success = bool(self._state.get("won"))
        self.done = bool(done or self.success or self._state.get("lost"))
        self.admissible = list(self._state.get("admissible_commands") or [])
        self.observation = clean_text(self._state.feedback)
        effective = reward != 0 or before != (sorted(self.admissible), self._state.get("description"))
        return self.render(), float(reward), self.done, make_info(self.success, True, effective)

    def render(self) -> str:
        """The last game text, then the admissible commands."""
        if self.config.show_admissible and self.admissible and not self.done:
            return f"{self.observation}\nAvailable actions: {self.action_description()}"
        return self.observation

    def action_description(self) -> str:
        """The admissible commands of the current state, or the general form before a reset."""
        if self.admissible:
            return " | ".join(self.admissible)
        return "a text command such as 'go north', 'take key' or 'open door'"

    def legend(self) -> str:
        """How to read the observation."""
        return "Act with exactly one of the listed available actions."

    def expert_action(self) -> str:
        """First command of TextWorld's winning policy from the current state."""
        policy = (self._state or {}).get("policy_commands") if self._state is not None else None
        if not policy:
            raise NotImplementedError("this game provides no policy_commands")
        return policy[0]

    def close(self) -> None:
        """Stop the game interpreter."""
        if self._env is not None:
            self._env.close()
            self._env, self._game_file = None, None
