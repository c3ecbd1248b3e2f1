"""Loading a config: the typed schema as an OmegaConf node, unknown keys refused, a config merged onto it.

No validation of values here: :mod:`agent_trainer.checks` runs every check on the merged config
(``agent_trainer.checks.load.load_config`` does both, before ``ray.init``).
"""

from __future__ import annotations

import dataclasses
import logging
from functools import lru_cache
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agent_trainer.config import compat, errors
from agent_trainer.config.schema import AgentTrainerConfig
from agent_trainer.config.sft import SFTConfig

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def config_schema() -> DictConfig:
    """The typed schema as an OmegaConf node: every key, its type and default (callers must not modify it)."""
    return OmegaConf.structured(AgentTrainerConfig)


def merge_config(cfg: DictConfig | Mapping[str, Any], overrides: Sequence[str] = ()) -> AgentTrainerConfig:
    """Rewrite align-anything sections, check the keys against the typed schema, merge, resolve ``${...}``.

    The keys are checked on the plain key tree first: hydra's ``+key=value`` adds a key
    that the schema lacks, and a merge onto the schema would keep it (``agent_trainer.config.errors``).
    ``overrides`` (the command line's) win over a config file's ``train_cfgs`` / ``model_cfgs`` /
    ``env_cfgs`` keys (``compat.rewrite_config_sections``, one notice per key).
    Raises ``ValueError`` with one line naming the key, the value and the fix.
    """
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    raw, notices = compat.rewrite_config_sections(raw, overrides)
    raw, estimator_notices = compat.rewrite_bi_level_gae(raw)  # one spelling: algorithm.adv_estimator=bi_level_gae
    for notice in [*notices, *estimator_notices]:
        logger.warning(notice)
    return merge_onto_schema(raw, config_schema())


def merge_onto_schema(cfg: DictConfig | Mapping[str, Any], schema: DictConfig) -> Any:
    """Refuse unknown keys, merge ``cfg`` onto a structured ``schema``, resolve ``${...}``; the typed object.

    Shared by every entry point's config (RL, SFT). Raises ``ValueError`` with one line.
    """
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    check_known_keys(raw, schema)
    merged = None
    try:
        merged = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(errors.one_line(err, schema, config=merged)) from None


@lru_cache(maxsize=1)
def sft_schema() -> DictConfig:
    """The typed schema as an OmegaConf node (callers must not modify it)."""
    return OmegaConf.structured(SFTConfig)


def check_known_keys(raw: Mapping, schema: DictConfig) -> None:
    """Raise ValueError naming the first key of ``raw`` that the schema does not have."""
    _check_keys(raw, schema, schema, "")


def _check_keys(raw: Mapping, node: DictConfig, root: DictConfig, prefix: str) -> None:
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if not prefix and key == "hydra":
            continue
        if key not in node:
            raise ValueError(compat.unknown_key_message(path, value) or errors.unknown_key_message(path, root, value))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and isinstance(value, Mapping):
            _check_keys(value, child, root, path)
        element = getattr(getattr(child, "_metadata", None), "element_type", None)
        if isinstance(child, ListConfig) and dataclasses.is_dataclass(element) and isinstance(value, list):
            for i, item in enumerate(value):  # a list of sections (agent_proxy.mcp_servers): each item's keys
                if isinstance(item, Mapping):
                    unknown = next((k for k in item if k not in {f.name for f in dataclasses.fields(element)}), None)
                    if unknown is not None:
                        raise ValueError(f"{path}[{i}].{unknown} is not a config key (got {unknown}="
                                         f"{errors.hydra_literal(item[unknown])}); the keys of an item of {path} are "
                                         f"{[f.name for f in dataclasses.fields(element)]}")
