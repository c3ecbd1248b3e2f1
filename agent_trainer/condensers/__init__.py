"""Context condensers for multi-turn GRPO: build each step's context c_{k+1} within a token budget.

Strategies: ``full``, ``simple``, ``truncate``, ``summary`` (register your own
with ``@register_condenser`` in a new module of this package, imported with it,
or name it by import path "package.module:ClassName"). The condensed context
manager (``agent_trainer.agents.condensed_ctx``, ``ctx_manager.mode=condensed``) builds
every turn's prompt through the configured one: see docs/multiturn_grpo.md.
"""

from agent_trainer.condensers.base import (
    CondensedContext,
    ContextCondenser,
    Draft,
    GenerateFn,
    StepRecord,
    SummaryCall,
    SummaryRequest,
    TrajectorySoFar,
    fit_to_budget,
    get_condenser_cls,
    list_condensers,
    make_condenser,
    register_condenser,
)
from agent_trainer.condensers.strategies import FullCondenser, SimpleCondenser, TruncateCondenser
from agent_trainer.condensers.summary import SummaryCondenser
from agent_trainer.common.plugins import import_package_modules

import_package_modules(__name__, __path__)  # a new condenser is one file here: its @register_condenser runs now

__all__ = [
    "CondensedContext", "ContextCondenser", "Draft", "GenerateFn",
    "StepRecord", "SummaryCall", "SummaryRequest", "TrajectorySoFar", "fit_to_budget", "get_condenser_cls",
    "list_condensers", "make_condenser", "register_condenser", "FullCondenser", "SimpleCondenser", "TruncateCondenser",
    "SummaryCondenser",
]
