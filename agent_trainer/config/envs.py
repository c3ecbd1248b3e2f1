"""The ``es_manager`` section: which env tags each split's groups play, group sizes, seeds, timeouts.

Plain dataclasses (RAGEN's es_manager keys); the env-state manager that runs them is
:mod:`agent_trainer.episode.es_manager`. The sizes are checked as the dataclasses are built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from agent_trainer.config.splits import CONFIG_SPLITS, Split


def plain(obj: Any) -> Any:
    """An OmegaConf container as plain dicts and lists (anything else unchanged)."""
    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


@dataclass
class EnvConfigsSpec:
    """Which tags the groups of a split use (RAGEN's ``env_configs``)."""

    tags: list[str] = field(default_factory=lambda: ["FrozenLake"])
    """Env tags from config/envs.yaml."""
    n_groups: list[int] = field(default_factory=lambda: [4])
    """Number of groups per tag (same order as ``tags``); must sum to env_groups."""


@dataclass
class EnvGroupsConfig:
    """One split (train or val) of the es_manager section."""

    env_groups: int = 4
    """Number of groups (distinct initial states) per rollout."""
    group_size: int = 4
    """Episodes per group; all start from the group's seed."""
    env_configs: EnvConfigsSpec = field(default_factory=EnvConfigsSpec)
    """Tag assignment; ``sum(env_configs.n_groups) == env_groups``."""
    split: str = "train"
    """"train" or "val" (:data:`~agent_trainer.config.splits.CONFIG_SPLITS`): picks the seed scheme and names the
    config in errors."""

    def __post_init__(self):
        if isinstance(self.env_configs, Mapping) or not dataclasses.is_dataclass(self.env_configs):
            self.env_configs = EnvConfigsSpec(**plain(self.env_configs))
        self.validate()

    @property
    def tags(self) -> list[str]:
        """Tags of this split (``env_configs.tags``)."""
        return list(self.env_configs.tags)

    @property
    def n_groups(self) -> list[int]:
        """Groups per tag (``env_configs.n_groups``)."""
        return list(self.env_configs.n_groups)

    def validate(self) -> None:
        """Check sizes and that n_groups matches tags and sums to env_groups."""
        where = f"es_manager.{self.split}"
        if self.split not in CONFIG_SPLITS:
            raise ValueError(f"{where}.split must be 'train' or 'val', got {self.split!r}")
        for key in ("env_groups", "group_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.{key} must be a positive int, got {value!r}")
        tags, n_groups = self.tags, self.n_groups
        if len(tags) != len(n_groups):
            raise ValueError(
                f"{where}.env_configs.tags {tags} and {where}.env_configs.n_groups {n_groups} "
                f"must have the same length (one group count per tag)"
            )
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in n_groups):
            raise ValueError(f"{where}.env_configs.n_groups {n_groups} must be non-negative ints")
        if sum(n_groups) != self.env_groups:
            raise ValueError(
                f"{where}.env_configs.n_groups {n_groups} sums to {sum(n_groups)} but "
                f"{where}.env_groups is {self.env_groups}; make the n_groups add up to "
                f"env_groups (or set {where}.env_groups: {sum(n_groups)})"
            )

    @classmethod
    def from_dict(cls, values: Mapping, split: str = "train") -> "EnvGroupsConfig":
        """Build from RAGEN's YAML shape; flat ``tags``/``n_groups`` keys are accepted too."""
        values = dict(plain(values) or {})
        spec = dict(values.pop("env_configs", None) or {})
        for key in ("tags", "n_groups"):
            if key in values:
                spec[key] = values.pop(key)
        allowed = ["env_groups", "group_size", "env_configs"]
        unknown = sorted(set(values) - set(allowed) - {"split"})
        if unknown:
            raise ValueError(f"es_manager.{split}: unknown field(s) {unknown}; allowed fields: {allowed}")
        values["split"] = split
        return cls(env_configs=EnvConfigsSpec(**spec), **values)


@dataclass
class EsManagerConfig:
    """The ``es_manager`` config section."""

    format_penalty: float = -0.1
    """Added once to a turn's reward when its action is missing or invalid; an episode's reward, the sum of its
    turns' rewards, so holds each penalty once (env/<tag>/penalty sums them on their own)."""
    action_sep: str = "||"
    """Separator between several actions in one answer."""
    max_actions_per_turn: int = 1
    """Actions executed per turn at most (extra ones are dropped)."""
    train: EnvGroupsConfig = field(default_factory=lambda: EnvGroupsConfig(split="train"))
    """Training split."""
    val: EnvGroupsConfig = field(
        default_factory=lambda: EnvGroupsConfig(group_size=1, split="val")
    )
    """Validation split (fixed seeds, disjoint from training seeds)."""
    seed: int = 0
    """Base seed for both splits (see ``group_seeds``)."""
    env_step_timeout_s: float = 60.0
    """Seconds one env actor may take to step its episodes for one turn; past it the actor is killed and
    replaced, its episodes of this turn end with info["error"] (metrics env/<tag>/timeouts, rollout/env_timeouts)."""
    env_reset_timeout_s: float = 60.0
    """Seconds one env actor may take to reset its episodes; past it the actor is killed and replaced and its
    episodes are dropped from the step (metric rollout/reset_failures)."""
    prefetch_reset: bool = True
    """Reset the training envs for the next step as soon as a rollout is done, while the step trains, so the
    next rollout starts with its first turn (the same group seeds; an env whose reset is slow costs nothing
    while it is shorter than the step). false: each rollout resets its envs when it starts."""
    max_failed_reset_fraction: float = 0.5
    """The rollout stops with an error naming the tag, the seed and the exception when more than this fraction
    of a split's episodes fail to reset; below it they are dropped from the step (rollout/reset_failures)."""
    min_group_left: int = 2
    """A group that lost episodes to a fault (its reset failed, its env actor was lost or timed out, its service
    failed, a non-finite reward) is dropped from the batch when fewer than this many of its episodes are left
    (rollout/small_groups_dropped): a group baseline (GRPO, RLOO, GiGPO) of fewer would say little. Groups that
    lost nothing are never dropped, so group_size 1 runs are unaffected. At least 1."""
    max_env_error_fraction: float = 0.5
    """The rollout stops with an error naming the tag, the seed and the exception when more than this fraction
    of a split's started episodes end in an environment error (step raised, or returned the wrong shape, a
    non-numeric reward or a non-str observation); below it they train as they ended (env/<tag>/error)."""
    preflight: bool = True
    """Before any worker starts, the driver builds every training and validation tag's environment, resets it
    and steps it with valid and junk actions, and refuses one that breaks the env contract in one line naming
    the tag, the call, what came back and the fix (docs/writing_an_environment.md, "Check it"); false skips it."""
    max_observation_chars: int = 20000
    """Longest observation (characters) shown to the policy; a longer one is cut, ending in a marker that
    says how many characters were dropped. Lone surrogates and NUL bytes in env text are replaced."""

    def __post_init__(self):
        if isinstance(self.max_actions_per_turn, bool) or not isinstance(self.max_actions_per_turn, int) \
                or self.max_actions_per_turn < 1:
            raise ValueError(
                f"es_manager.max_actions_per_turn must be a positive int, got {self.max_actions_per_turn!r}"
            )
        if not isinstance(self.action_sep, str) or not self.action_sep:
            raise ValueError(f"es_manager.action_sep must be a non-empty string, got {self.action_sep!r}")
        if self.train.split != Split.TRAIN or self.val.split != Split.VAL:
            raise ValueError("es_manager.train/val must have split 'train'/'val'; use EsManagerConfig.from_dict")

    @classmethod
    def from_dict(cls, values: Mapping) -> "EsManagerConfig":
        """Build from the YAML/OmegaConf ``es_manager`` section."""
        values = dict(plain(values) or {})
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"es_manager: unknown field(s) {unknown}; allowed fields: {allowed}")
        for split in CONFIG_SPLITS:
            if split in values:
                values[split] = EnvGroupsConfig.from_dict(values[split], split=split.value)
        return cls(**values)
