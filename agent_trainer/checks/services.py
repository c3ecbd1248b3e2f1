"""The env services a run talks to, checked before Ray starts: every training and validation tag whose environment
is an OpenEnv server (``env_type: openenv``, envs/openenv_env.py) must answer its health check with the key, and
its per-call timeout must fit inside the env actors' deadline. One line names the tag, the key and the fix.

This runs whether or not ``es_manager.preflight`` is on: a server that is down at start-up is refused here, not
found by the first rollout.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import CONFIG_SPLITS
from envs import ServiceError, get_env_classes
from envs.openenv_env import OpenEnvEnv, probe
from envs.registry import build_config, normalize_tags


def check_services(cfg: AgentTrainerConfig, env_tags: Mapping) -> None:
    """Probe the OpenEnv server of every tag the splits play; raises ValueError with one line on the first that is
    unreachable, refuses the key, or has ``step_timeout_s`` not below ``es_manager.env_step_timeout_s``."""
    tags = dict.fromkeys(tag for split in CONFIG_SPLITS for tag in getattr(cfg.es_manager, split).env_configs.tags)
    for tag in tags:
        if tag not in env_tags:
            continue  # refused by check_inputs
        tag_cfg = normalize_tags({tag: env_tags[tag]})[tag]
        env_cls, config_cls = get_env_classes(tag_cfg.env_type)
        if not issubclass(env_cls, OpenEnvEnv):
            continue
        env_config = build_config(config_cls, tag_cfg.env_config, f"env tag {tag!r}: env_config")
        deadline = cfg.es_manager.env_step_timeout_s
        if env_config.step_timeout_s >= deadline:
            raise ValueError(f"env tag {tag!r}: env_config.step_timeout_s = {env_config.step_timeout_s:g} is not below "
                             f"es_manager.env_step_timeout_s = {deadline:g}: a server that hangs would cost the env "
                             f"actor's other episodes too; set env_config.step_timeout_s below {deadline:g}")
        try:
            probe(env_config)
        except ServiceError as err:
            raise ValueError(f"env tag {tag!r}: env_config.base_url = {env_config.base_url}: {err}; start the server "
                             "(python -m agent_trainer.serve_env serves a tag of this project) or fix base_url "
                             "(docs/environments.md, \"Services\")") from None
