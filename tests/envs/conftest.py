"""Shared fixtures for environment tests: seeded garbage action strings and the contract's fuzz check
(``agent_trainer.checks.env_contract``, which ``python -m agent_trainer.check_env`` runs on a user's tags)."""

import pytest

from agent_trainer.checks.env_contract import check_garbage_actions, random_action_strings


@pytest.fixture(scope="session")
def garbage_actions() -> list[str]:
    """10,000 seeded random action strings."""
    return random_action_strings(10_000)


fuzz_env = check_garbage_actions
"""Step an env with every string; it never raises and keeps the contract (the package's check, one copy)."""


@pytest.fixture
def fuzz():
    """The ``fuzz_env`` helper as a fixture."""
    return fuzz_env
