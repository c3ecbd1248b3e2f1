"""Shared fixtures for environment tests: seeded garbage action strings."""

import random

import pytest

_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    " \t\n.,;:!?'\"`*()[]{}<>|/\\+-=_#$%^&~@"
    "éßø中文😀\u200b\x00\x7f²٣½"
)
# Fragments a model is likely to emit, so mutations land near valid syntax.
_FRAGMENTS = [
    "Left", "Right", "Up", "Down", "search[", "click[", "]", "buy now", "<answer>", "</answer>",
    "||", "1 + 2", "(3 * 4) - 5", "/ 0", "**", "10**10**10", "\\frac{1}{2}", "go to", "take",
    "open", "look", "inventory", "arm", "__import__('os')", "lambda: 0", "9" * 50,
]


def random_action_strings(n: int, seed: int = 0) -> list[str]:
    """``n`` garbage strings from a seeded generator (deterministic across runs)."""
    rng = random.Random(seed)
    out = ["", " ", "\n", "||", "None", "nan", "inf", "-0", "x" * 5000]
    while len(out) < n:
        kind = rng.random()
        if kind < 0.4:
            s = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 40)))
        elif kind < 0.8:
            s = "".join(rng.choice(_FRAGMENTS + [rng.choice(_ALPHABET)]) for _ in range(rng.randint(1, 6)))
        else:
            s = rng.choice(_FRAGMENTS)
            i = rng.randint(0, len(s))
            s = s[:i] + rng.choice(_ALPHABET) + s[i:]
        out.append(s)
    return out[:n]


@pytest.fixture(scope="session")
def garbage_actions() -> list[str]:
    """10,000 seeded random action strings."""
    return random_action_strings(10_000)


def fuzz_env(env, actions, seed: int = 0, valid_check=None):
    """Step ``env`` with every string; assert it never raises and info keys are present.

    Resets when an episode ends. ``valid_check(action)`` (optional) returns True
    for strings the env must accept; every other string must be flagged invalid.
    """
    env.reset(seed=seed)
    for k, action in enumerate(actions):
        obs, reward, done, info = env.step(action)
        assert isinstance(obs, str) and isinstance(reward, float) and isinstance(done, bool)
        for key in ("success", "action_is_valid", "action_is_effective"):
            assert isinstance(info[key], bool), (key, info)
        if valid_check is not None:
            assert info["action_is_valid"] == valid_check(action), (action, info)
        if done:
            env.reset(seed=seed + k)


@pytest.fixture
def fuzz():
    """The ``fuzz_env`` helper as a fixture."""
    return fuzz_env
