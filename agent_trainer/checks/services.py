"""The services a run talks to, checked before Ray starts: every training and validation tag whose environment
is an OpenEnv server (``env_type: openenv``, envs/openenv_env.py) must answer its health check with the key, and
its per-call timeout must fit inside the env actors' deadline; every MCP server of the tool-calling agent
(``agent_proxy.mcp_servers``) must start or answer and list its tools (:func:`check_tool_servers`). One line names
the tag or the server, the key and the fix.

This runs whether or not ``es_manager.preflight`` is on: a server that is down at start-up is refused here, not
found by the first rollout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlparse

from agent_trainer.agents.mcp_tools import shared_toolbox
from agent_trainer.agents.registry import resolve_agent_cls
from agent_trainer.agents.tool_call import ToolCallAgent
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import CONFIG_SPLITS
from envs import ServiceError, get_env_classes
from envs.openenv_env import OpenEnvEnv, probe
from envs.registry import build_config, normalize_tags


def check_services(cfg: AgentTrainerConfig, env_tags: Mapping) -> None:
    """Probe the OpenEnv server of every tag the splits play and the tool-calling agent's MCP servers; raises
    ValueError with one line on the first that is unreachable, refuses the key, or has ``step_timeout_s`` not below
    ``es_manager.env_step_timeout_s``."""
    check_tool_servers(cfg)
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


def check_tool_servers(cfg: AgentTrainerConfig) -> None:
    """``agent_proxy.mcp_servers``: only with the tool-calling agent, each server's keys consistent, and each one
    started (stdio) or reached (HTTP, with its key) and its tools listed, names not clashing (the connection stays
    open for the run's agents: ``agents.mcp_tools.shared_toolbox``). Raises ValueError with one line."""
    servers = cfg.agent_proxy.mcp_servers
    if not servers:
        return
    key = "agent_proxy.mcp_servers"
    if cfg.agent_proxy.gateway.agent:
        raise ValueError(f"{key} is set but agent_proxy.gateway.agent = {cfg.agent_proxy.gateway.agent!r} plays the "
                         "episodes (its own tools); unset one of them")
    agent = resolve_agent_cls(cfg)
    if not issubclass(agent, ToolCallAgent):
        raise ValueError(f"{key} is set but agent_proxy.agent_cls = {cfg.agent_proxy.agent_cls!r} does not call tools; "
                         "set agent_proxy.agent_cls=tool_call (docs/agents.md, \"MCP tools\")")
    names = [s.name for s in servers]
    for i, server in enumerate(servers):
        _check_server_keys(f"{key}[{i}]", server, names)
    shared_toolbox(servers)


def _check_server_keys(key: str, server, names: list[str]) -> None:
    if not server.name or names.count(server.name) > 1:
        raise ValueError(f"{key}.name = {server.name!r}: every MCP server needs a name of its own (names: {names})")
    if bool(server.command) == bool(server.url):
        raise ValueError(f"{key} ({server.name!r}) sets {'both' if server.command else 'neither'} of command and url; "
                         "set command (a stdio server the run starts) or url (a streamable HTTP server)")
    if server.url and (urlparse(server.url).scheme not in ("http", "https") or not urlparse(server.url).hostname):
        raise ValueError(f"{key}.url = {server.url!r} is not an http(s) address; give the server's MCP endpoint, "
                         "e.g. http://127.0.0.1:8765/mcp")
    for field in ("connect_timeout_s", "call_timeout_s"):
        if not float(getattr(server, field)) > 0:
            raise ValueError(f"{key}.{field} = {getattr(server, field)!r} must be > 0")
    if server.max_result_chars < 1:
        raise ValueError(f"{key}.max_result_chars = {server.max_result_chars!r} must be >= 1")
    if server.api_key_env and not server.url:
        raise ValueError(f"{key}.api_key_env = {server.api_key_env!r} is for an HTTP server (url); a stdio server gets "
                         "variables through env_vars")
    if server.env_vars and not server.command:
        raise ValueError(f"{key}.env_vars = {list(server.env_vars)} is for a stdio server (command); an HTTP server "
                         "runs elsewhere")
    if server.api_key_env and not os.environ.get(server.api_key_env):
        raise ValueError(f"{key}.api_key_env = {server.api_key_env!r} names a variable that is not set; set it to the "
                         "server's key where you start the run")
