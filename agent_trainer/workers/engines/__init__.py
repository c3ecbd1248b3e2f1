"""Rollout engines: :class:`agent_trainer.workers.engines.base.RolloutEngine` and one module per engine (``vllm``,
``hf``).

The engines are found by name in :mod:`agent_trainer.checks.engines` (``actor_rollout_ref.rollout.name``: a
registered name or an engine class's import path ``package.module:ClassName``); docs/architecture.md,
"Rollout engines".
"""
