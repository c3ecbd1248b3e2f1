"""The contract every built-in environment keeps (issue: "What must be true").

For each env: same seed -> same observation; the expert solver reaches
success from reset; 10,000 garbage strings never raise and carry the three
info keys; info flags are booleans; close() is safe twice. The checks are the package's
(``agent_trainer.checks.env_contract``): ``python -m agent_trainer.check_env``
runs the same ones on a user's own tags.
"""

import pytest

import envs
from agent_trainer.checks.env_contract import (
    check_close_twice,
    check_determinism,
    check_expert_success,
    check_text_methods,
)

# name -> (config overrides, seeds checked with the expert)
CASES = {
    "frozen_lake": ({"size": 5}, range(10)),
    "sokoban": ({"dim_room": [6, 6], "num_boxes": 1}, range(10)),
    "bandit": ({}, range(5)),
    "countdown": ({"num_operands": 4}, range(10)),
    "metamathqa": ({}, range(10)),
    "webshop": ({}, range(10)),
    "gymnasium": ({}, []),  # CliffWalking: no expert (the wrapper is generic)
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_seed_same_observation(name):
    overrides, _ = CASES[name]
    check_determinism(lambda: envs.make_env(name, **overrides), seeds=(0, 1, 12345))


@pytest.mark.parametrize("name", sorted(CASES))
def test_expert_reaches_success(name):
    overrides, seeds = CASES[name]
    env = envs.make_env(name, **overrides)
    if not seeds:
        pytest.skip(f"{name} has no expert solver")
    check_expert_success(env, seeds, max_steps=200)


@pytest.mark.parametrize("name", sorted(CASES))
def test_garbage_actions_never_raise(name, garbage_actions, fuzz):
    overrides, _ = CASES[name]
    env = envs.make_env(name, **overrides)
    fuzz(env, garbage_actions)
    check_close_twice(env)


@pytest.mark.parametrize("name", sorted(CASES))
def test_action_description_is_text(name):
    env = envs.make_env(name, **CASES[name][0])
    check_text_methods(env, seed=0)
    assert isinstance(env.action_description(), str) and env.action_description()
    assert isinstance(env.render(), str) and isinstance(env.legend(), str)
