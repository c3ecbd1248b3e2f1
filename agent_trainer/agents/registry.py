"""Which agent a run uses: ``agent_proxy.agent_cls`` (a registered name or an import path) or the class given
to ``AgentTrainer(..., agent_cls=...)``; unset, the context manager of ``ctx_manager.mode``.

Registered names: ``full`` (``ctx_manager.ContextManager``), ``condensed``
(``condensed_ctx.CondensedContextManager``) and ``tool_call`` (``agents.tool_call.ToolCallAgent``).
An import path is ``package.module.ClassName`` or ``package.module:ClassName``; the module must be
importable by the driver (the rollout runs there). Resolved before ``ray.init``; every refusal is one
line naming ``agent_proxy.agent_cls``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent_trainer.agents.base import LAYOUTS, Agent
from agent_trainer.agents.tool_call import ToolCallAgent
from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.agents.ctx_manager import ContextManager
from agent_trainer.common.plugins import PluginRegistry

if TYPE_CHECKING:
    from agent_trainer.config import AgentTrainerConfig

KEY = "agent_proxy.agent_cls"
AGENTS: PluginRegistry[Agent] = PluginRegistry(Agent, KEY)
AGENTS.register("full")(ContextManager)
AGENTS.register("condensed")(CondensedContextManager)
AGENTS.register("tool_call")(ToolCallAgent)




def resolve_agent_cls(cfg: AgentTrainerConfig, agent_cls: type | None = None) -> type[Agent]:
    """The agent class of the run (``agent_cls`` wins over the config); raises ValueError naming the key.

    The class must subclass ``Agent`` and build the rows ``ctx_manager.mode`` says (the estimators and
    the batch-size checks read the mode).
    """
    name = cfg.agent_proxy.agent_cls
    if agent_cls is not None:
        shown = f"AgentTrainer(agent_cls={getattr(agent_cls, '__qualname__', agent_cls)!r})"
        if not (isinstance(agent_cls, type) and issubclass(agent_cls, Agent)):
            raise ValueError(f"{shown} is not a subclass of agent_trainer.agents.base.Agent (docs/agents.md)")
        cls = agent_cls
    elif name is None or name == "":
        return CondensedContextManager if cfg.ctx_manager.mode == "condensed" else ContextManager
    else:
        shown = f"{KEY} = {name!r}"
        cls = AGENTS.get(_import_path(name))
    layout = cls.layout
    if layout not in LAYOUTS:
        raise ValueError(f"{shown}: {cls.__qualname__}.layout = {layout!r} must be one of {list(LAYOUTS)}")
    if layout != cfg.ctx_manager.mode:
        raise ValueError(f"{shown} builds the {layout} layout (one row per {'turn' if layout == 'condensed' else 'episode'})"
                         f" but ctx_manager.mode = {cfg.ctx_manager.mode!r}; set ctx_manager.mode={layout} or pick an "
                         f"agent with the {cfg.ctx_manager.mode} layout")
    return cls


def _import_path(name: str) -> str:
    """``package.module.ClassName`` as the registry's ``package.module:ClassName``; names and ':' paths as given."""
    if name in AGENTS.names() or ":" in name or "." not in name:
        return name
    module, _, attr = name.rpartition(".")
    return f"{module}:{attr}"
