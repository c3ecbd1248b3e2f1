"""Pluggable agents (docs/agents.md): the interface (``base.Agent``), the registry and ``make_agent``
(``registry``), the batch-contract check (``contract``) and the tool-calling agent (``tool_call``)."""
