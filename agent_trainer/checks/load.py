"""Load a config and check it: the one call each entry point makes before ``ray.init``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from omegaconf import DictConfig

from agent_trainer.checks.rl import validate_config
from agent_trainer.checks.sft import validate_sft_config
from agent_trainer.config.loading import merge_config, merge_onto_schema, sft_schema
from agent_trainer.config.schema import AgentTrainerConfig
from agent_trainer.config.sft import SFTConfig


def load_config(cfg: DictConfig | Mapping[str, Any], overrides: Sequence[str] = ()) -> AgentTrainerConfig:
    """Merge ``cfg`` onto the typed schema (``agent_trainer.config.loading.merge_config``), then run every check.

    Raises ``ValueError`` with one line naming the key, the value and the fix.
    """
    typed = merge_config(cfg, overrides)
    validate_config(typed)
    return typed


def load_sft_config(cfg: DictConfig | Mapping[str, Any]) -> SFTConfig:
    """Check the keys against the SFT schema, merge, resolve, validate (like :func:`load_config`)."""
    typed: SFTConfig = merge_onto_schema(cfg, sft_schema())
    validate_sft_config(typed)
    return typed
