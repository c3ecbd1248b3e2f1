"""The environment contract (docs/writing_an_environment.md, "The contract"), as checks any env can be run through.

The repository's own env tests (tests/envs/) and ``python -m agent_trainer.check_env`` call these same functions,
so a user's environment is held to exactly what the built-in ones are:

- :func:`check_determinism`: same seed, same first observation (two fresh envs, and one env reset twice);
- :func:`check_text_methods`: ``action_description`` a non-empty str, ``render`` and ``legend`` str;
- :func:`check_garbage_actions`: any str is a legal action: ``step`` never raises and returns
  ``(str, float, bool, info)`` whose ``info`` holds the three booleans of ``envs.make_info``;
- :func:`check_expert_success`: an env with an ``expert_action`` reaches ``success`` from reset;
- :func:`check_close_twice`: ``close()`` is safe twice.

Each raises :class:`ContractError` (a ValueError) with one line: what came back and the fix. The preflight
(``agent_trainer.checks.preflight``) adds the run-time view: valid then junk actions under the env actors'
deadlines. :func:`run_contract` runs it and all of them on one tag and reports one :class:`CheckResult` per
check.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent_trainer.checks.preflight import FIX_INFO, has_expert, preflight_tag, show
from envs import BaseEnv, make_env

INFO_KEYS = ("success", "action_is_valid", "action_is_effective")
"""The booleans every ``info`` holds (``envs.make_info``)."""
DETERMINISM_SEEDS = (0, 1, 12345)
EXPERT_SEEDS = range(3)
EXPERT_MAX_STEPS = 200

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


class ContractError(ValueError):
    """An environment broke the contract; the message is one line with the fix."""


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


def check_determinism(make: Callable[[], BaseEnv], seeds: Iterable[int] = DETERMINISM_SEEDS) -> None:
    """Two fresh envs, and one env reset twice, give the same first observation for each seed."""
    a, b = make(), make()
    try:
        _check_same_starts(a, b, seeds)
    finally:
        for env in (a, b):
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing is checked by check_close_twice
                pass


def _check_same_starts(a: BaseEnv, b: BaseEnv, seeds: Iterable[int]) -> None:
    for seed in seeds:
        first, second, again = a.reset(seed=seed), b.reset(seed=seed), a.reset(seed=seed)
        if not isinstance(first, str):
            raise ContractError(f"reset(seed={seed}) returned {show(first, 60)}, not the observation as a str; "
                                "return the observation text (e.g. self.render())")
        if not first == second == again:
            raise ContractError(f"reset(seed={seed}) gave different observations ({show(first, 40)} then "
                                f"{show(second if second != first else again, 40)}); draw all randomness from "
                                "np.random.default_rng(seed) in reset")


def check_text_methods(env: BaseEnv, seed: int = 0) -> None:
    """After ``reset``: ``action_description()`` is a non-empty str, ``render()`` and ``legend()`` are str."""
    env.reset(seed=seed)
    for name, nonempty in (("action_description", True), ("render", False), ("legend", False)):
        value = getattr(env, name)()
        if not isinstance(value, str) or (nonempty and not value.strip()):
            raise ContractError(f"{name}() returned {show(value, 60)}; return "
                                + ("a non-empty str naming the actions, e.g. 'Left | Down | Right | Up'"
                                   if nonempty else "a str"))


def check_step_output(action: str, out: Any) -> tuple[str, float, bool, Mapping]:
    """One ``step`` result: ``(observation: str, reward: float, done: bool, info)`` with the three info booleans."""
    call = f"step({show(action, 30)})"
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        raise ContractError(f"{call} returned {show(out, 60)}; step must return (observation: str, reward: float, "
                            "done: bool, info: dict)")
    obs, reward, done, info = out
    if not isinstance(obs, str):
        raise ContractError(f"{call} returned an observation of type {type(obs).__name__}; return it as a str")
    if not isinstance(reward, float):
        raise ContractError(f"{call} returned a reward of type {type(reward).__name__} ({show(reward, 60)}); "
                            "return a float (e.g. float(reward))")
    if not isinstance(done, bool):
        raise ContractError(f"{call} returned done of type {type(done).__name__} ({show(done, 60)}); return a bool "
                            "(e.g. bool(done))")
    if not isinstance(info, Mapping):
        raise ContractError(f"{call} returned info of type {type(info).__name__}; {FIX_INFO}")
    for key in INFO_KEYS:
        if key not in info:
            raise ContractError(f"{call} returned info without {key!r} (it has {sorted(map(str, info))}); {FIX_INFO}")
        if not isinstance(info[key], bool):
            raise ContractError(f"{call} returned info[{key!r}] = {show(info[key], 60)}, not a bool; {FIX_INFO}")
    return obs, reward, done, info


def check_garbage_actions(env: BaseEnv, actions: Iterable[str], seed: int = 0,
                          valid_check: Callable[[str], bool] | None = None) -> None:
    """Step ``env`` with every string (resetting when an episode ends): it never raises and every result keeps
    the contract (:func:`check_step_output`). ``valid_check(action)`` (optional) is True for the strings the env
    must accept; every other string must be flagged ``action_is_valid=False``."""
    env.reset(seed=seed)
    for k, action in enumerate(actions):
        try:
            out = env.step(action)
        except Exception as exc:  # noqa: BLE001 - reported in one line with the fix
            text = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise ContractError(f"step({show(action, 30)}) raised {text}; step must take any str: answer text it "
                                "cannot parse with the unchanged observation, reward 0 and action_is_valid=False"
                                ) from exc
        _, _, done, info = check_step_output(action, out)
        if valid_check is not None and info["action_is_valid"] != valid_check(action):
            raise ContractError(f"step({show(action, 30)}) gave action_is_valid={info['action_is_valid']}, "
                                f"expected {valid_check(action)}")
        if done:
            env.reset(seed=seed + k)


def check_expert_success(env: BaseEnv, seeds: Iterable[int] = EXPERT_SEEDS, max_steps: int = EXPERT_MAX_STEPS
                         ) -> None:
    """From ``reset(seed)``, stepping ``expert_action()`` ends the episode with ``info['success']``."""
    for seed in seeds:
        env.reset(seed=seed)
        info: Mapping = {}
        for _ in range(max_steps):
            action = env.expert_action()
            _, _, done, info = check_step_output(action, env.step(action))
            if done:
                break
        if not info.get("success"):
            raise ContractError(f"the expert (expert_action()) did not reach success from reset(seed={seed}) in "
                                f"{max_steps} steps (last info {show(dict(info), 80)}); fix expert_action or "
                                "the success flag of info")


def check_close_twice(env: BaseEnv) -> None:
    """``close()`` may be called twice."""
    env.close()
    env.close()


@dataclass
class CheckResult:
    """One check of one tag: passed, or the failure line with the fix; ``note`` says why it was skipped."""

    tag: str
    check: str
    ok: bool
    detail: str = ""

    def line(self) -> str:
        status = "PASS" if self.ok else "FAIL"
        return f"{status}  {self.tag}: {self.check}" + (f" ({self.detail})" if self.ok and self.detail else "") \
            + ("" if self.ok else f": {self.detail}")


def run_contract(tag: str, env_tags: Mapping, *, junk: int = 1000, seed: int = 0,
                 timeout_s: float = 60.0) -> list[CheckResult]:
    """The preflight, then every contract check, on one tag of ``env_tags`` (built with ``envs.make_env``); a tag
    that does not build is one failed ``build`` check, and one whose call misses the preflight's deadline stops
    there (the contract checks have no deadline)."""
    def make() -> BaseEnv:
        return make_env(tag, env_tags)

    def result(check: str, fn: Callable[[], Any]) -> CheckResult:
        try:
            note = fn()
        except Exception as exc:  # noqa: BLE001 - one line per failed check
            text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            return CheckResult(tag, check, False, " ".join(text.split()))
        return CheckResult(tag, check, True, note or "")

    built = result("build (envs.make_env)", lambda: make().close())
    if not built.ok:
        return [built]
    env = make()

    def expert() -> str | None:
        if not has_expert(env):
            return "skipped: no expert_action"
        try:
            check_expert_success(env)
        except NotImplementedError:
            return "skipped: expert_action raises NotImplementedError"
        return None

    preflight = result("preflight (valid and junk actions under the actors' deadlines)",
                       lambda: preflight_tag(tag, env_tags, reset_timeout_s=timeout_s, step_timeout_s=timeout_s,
                                             seed=seed) and None)
    if not preflight.ok and "did not return within" in preflight.detail:
        return [built, preflight]  # the checks below run without a deadline: they would hang the same way
    results = [
        built,
        preflight,
        result("reset is deterministic under a seed", lambda: check_determinism(make)),
        result("render, legend and action_description are text", lambda: check_text_methods(env, seed)),
        result(f"{junk} junk actions: step keeps its return shape and info keys",
               lambda: check_garbage_actions(env, random_action_strings(junk, seed), seed)),
        result("expert_action reaches success", expert),
        result("close() twice", lambda: check_close_twice(env)),
    ]
    return results
