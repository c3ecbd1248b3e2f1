"""ALFWorld: household tasks as text games, over the ``alfworld`` package.

Needs the optional extra (``pip install 'agent-trainer[alfworld]'``) and
ALFWorld's data (PDDL game files, ~2 GB)::

    pip install 'agent-trainer[alfworld]'
    export ALFWORLD_DATA=~/.cache/alfworld      # where the data goes
    alfworld-download                           # fetches json_2.1.1/, logic/, ...

Games are ``$ALFWORLD_DATA/json_2.1.1/<split>/**/game.tw-pddl``; they are
played through TextWorld with ALFWorld's own wrappers (``AlfredDemangler``,
``AlfredInfos``), with the same command/reward semantics as
``envs.text_world.TextWorldEnv``: admissible commands are the valid actions,
``success`` means the task is done. ``reset(seed)`` plays game
``seed % number of games`` (games sorted by path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from envs.text_world import TextWorldConfig, TextWorldEnv

SPLITS = ("train", "valid_seen", "valid_unseen")
HOW_TO_GET_DATA = (
    "ALFWorld data not found at {path}. Get it with:\n"
    "    pip install 'agent-trainer[alfworld]'\n"
    "    export ALFWORLD_DATA={path}\n"
    "    alfworld-download\n"
    "then set env_config.data_dir (or ALFWORLD_DATA) to that directory."
)


def default_data_dir() -> str:
    """``$ALFWORLD_DATA`` or ``~/.cache/alfworld`` (alfworld's own default)."""
    return os.environ.get("ALFWORLD_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "alfworld")


@dataclass
class ALFWorldConfig(TextWorldConfig):
    """Options of the ALFWorld adapter (TextWorld options for generation are ignored)."""

    data_dir: str | None = None
    """ALFWorld data directory (None: $ALFWORLD_DATA or ~/.cache/alfworld)."""
    split: str = "train"
    """One of train, valid_seen, valid_unseen."""
    max_games: int | None = None
    """Use only the first N games of the split (sorted by path)."""

    def __post_init__(self):
        super().__post_init__()
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {self.split!r}")


class ALFWorldEnv(TextWorldEnv):
    """ALFWorld's TextWorld games with ALFWorld's wrappers."""

    config_cls = ALFWorldConfig

    def __init__(self, config: ALFWorldConfig | None = None):
        """Check the alfworld package and its data, then index the split's games."""
        config = config if config is not None else ALFWorldConfig()
        try:
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        except ImportError as exc:  # one line: a corpus build or check over every shipped tag skips it in one
            raise ImportError(
                f"ALFWorld needs the optional 'alfworld' package ({exc}): pip install 'agent-trainer[alfworld]', "
                f"then alfworld-download its data into $ALFWORLD_DATA "
                f"({config.data_dir or default_data_dir()}; docs/environments.md)"
            ) from exc
        self._wrappers = [AlfredDemangler, AlfredInfos]
        data_dir = Path(config.data_dir or default_data_dir()).expanduser()
        split_dir = data_dir / "json_2.1.1" / config.split
        if not split_dir.is_dir():
            raise FileNotFoundError(HOW_TO_GET_DATA.format(path=data_dir))
        games = sorted(str(p) for p in split_dir.rglob("game.tw-pddl"))
        if config.max_games is not None:
            games = games[: config.max_games]
        if not games:
            raise FileNotFoundError(f"no game.tw-pddl files under {split_dir}. " + HOW_TO_GET_DATA.format(path=data_dir))
        config.game_files = games
        super().__init__(config)

    def wrappers(self) -> list:
        """ALFWorld's demangler (readable object names) and info wrapper."""
        return list(self._wrappers)
