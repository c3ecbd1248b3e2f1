"""The environments' preflight: each training and validation tag played for a few steps in the driver, before
Ray and the workers start (``es_manager.preflight``; docs/writing_an_environment.md, "Check it").

For every tag the splits name, :func:`preflight_tag` builds the environment (``envs.make_env``), resets it,
steps it with valid actions (its ``expert_action`` where it has one, else the names ``action_description``
lists as ``A | B | C``; neither: junk only), resets it again and steps it with junk text. It refuses, in one line (a ``ValueError`` naming the
tag, the call, what came back and the fix):

- an exception from the constructor, ``reset``, ``step``, ``render`` or ``action_description``;
- ``reset`` not returning a str; ``step`` not returning four items ``(observation, reward, done, info)``;
- a non-str observation, a reward that is not a number (a str, None, a list; NaN passes: that is
  ``algorithm.nonfinite_reward``'s), a ``done`` that is not a bool (numpy's bool, 0 and 1 pass), an ``info``
  that is not a dict;
- an ``info`` without ``success`` (success would read 0 for ever) or ``action_is_valid`` (every turn would count as
  a format error and pay ``es_manager.format_penalty``);
- a call that does not return within the env actors' deadline (``es_manager.env_reset_timeout_s`` /
  ``env_step_timeout_s``).

An ``info`` without ``action_is_effective`` only costs a metric (``env/<tag>/action_is_effective`` reads 0): it is
logged as a warning, once per tag. The checks are the env-state manager's own at run time, made before the
run instead of costing it its episodes (``agent_trainer.episode.es_manager``, ``es_manager.max_env_error_fraction``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import CONFIG_SPLITS
from agent_trainer.agents.demonstrations import valid_actions
from envs import BaseEnv, make_env

logger = logging.getLogger(__name__)

VALID_STEPS = 3
"""Steps taken with valid actions (fewer when the episode ends first)."""
JUNK_ACTIONS = ("", "qwxz ###", "<answer>Left</answer> " + "z" * 300)
"""What an untrained policy writes: nothing, a word that is no action, a long string. ``step`` must take any str."""
REQUIRED_INFO = ("success", "action_is_valid")
"""Keys every ``info`` must hold: refused when missing."""
WARNED_INFO = ("action_is_effective",)
"""Keys every ``info`` should hold: a warning when missing."""
FIX_INFO = "build info with envs.make_info(success, action_is_valid, action_is_effective, **extra)"
FIX_STEP = "step must return (observation: str, reward: float, done: bool, info: dict)"


def preflight_envs(cfg: AgentTrainerConfig, env_tags: Mapping) -> dict[str, float]:
    """Preflight every tag of the training and validation splits (unless ``es_manager.preflight`` is false);
    returns the seconds each took. Raises ValueError with one line on the first broken tag."""
    if not cfg.es_manager.preflight:
        return {}
    tags = dict.fromkeys(tag for split in CONFIG_SPLITS
                         for tag in getattr(cfg.es_manager, split).env_configs.tags)
    es = cfg.es_manager
    return {tag: preflight_tag(tag, env_tags, reset_timeout_s=es.env_reset_timeout_s,
                               step_timeout_s=es.env_step_timeout_s) for tag in tags}


def preflight_tag(tag: str, env_tags: Mapping, *, reset_timeout_s: float = 60.0, step_timeout_s: float = 60.0,
                  seed: int = 0) -> float:
    """Build, reset and step one tag's environment (valid, then junk actions); returns the seconds it took.

    Each call runs under the env actors' deadline: a call that hangs is refused (its thread is left behind,
    a daemon, and the run does not start)."""
    start = time.perf_counter()
    where = f"env tag {tag!r}"
    env = _call(where, "the constructor (envs.make_env)", lambda: make_env(tag, env_tags), reset_timeout_s)
    where = f"env tag {tag!r} ({type(env).__module__}:{type(env).__qualname__})"
    try:
        _check_reset(where, env, seed, reset_timeout_s)
        _call(where, "action_description()", env.action_description, step_timeout_s)
        warned: set[str] = set()
        listed = valid_actions(env)
        for k in range(VALID_STEPS):
            action = _expert_action(where, env, step_timeout_s)
            if action is None and not listed:
                break  # no valid action known: the junk steps below still run
            if _check_step(where, env, listed[k % len(listed)] if action is None else action, step_timeout_s, warned):
                break
        _check_reset(where, env, seed + 1, reset_timeout_s)
        for action in JUNK_ACTIONS:
            if _check_step(where, env, action, step_timeout_s, warned):
                _check_reset(where, env, seed + 1, reset_timeout_s)
        _call(where, "render()", env.render, step_timeout_s)
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - closing is best effort, as in the env-state manager
            pass
    return time.perf_counter() - start


def has_expert(env: BaseEnv) -> bool:
    """Whether the env's class overrides ``BaseEnv.expert_action``."""
    return type(env).expert_action is not BaseEnv.expert_action


def _expert_action(where: str, env: BaseEnv, timeout_s: float) -> str | None:
    """The env's expert action, or None when it has no solver (``NotImplementedError``, as ``BaseEnv``'s) or
    none for this state (a prompt row without ground truth)."""
    if not has_expert(env):
        return None

    def expert() -> str | None:
        try:
            return env.expert_action()
        except NotImplementedError:
            return None

    action = _call(where, "expert_action()", expert, timeout_s)
    return action if isinstance(action, str) else None


def _check_reset(where: str, env: BaseEnv, seed: int, timeout_s: float) -> None:
    obs = _call(where, f"reset(seed={seed})", lambda: env.reset(seed=seed), timeout_s)
    if not isinstance(obs, str):
        raise ValueError(f"{where}: reset(seed={seed}) returned {show(obs)}, not the first observation as a "
                         "str; return the observation text (e.g. self.render())")


def _check_step(where: str, env: BaseEnv, action: str, timeout_s: float, warned: set[str]) -> bool:
    """Step once and check what came back; returns ``done``."""
    call = f"step({show(action, 40)})"
    out = _call(where, call, lambda: env.step(action), timeout_s)
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        size = f" of {len(out)} items" if isinstance(out, (tuple, list)) else ""
        raise ValueError(f"{where}: {call} returned a {type(out).__name__}{size}: {show(out)}; {FIX_STEP}")
    obs, reward, done, info = out
    if not isinstance(obs, str):
        raise ValueError(f"{where}: {call} returned an observation of type {type(obs).__name__} ({show(obs)}); "
                         f"{FIX_STEP}")
    if isinstance(reward, (str, bytes)) or not hasattr(reward, "__float__"):  # the env-state manager's test
        raise ValueError(f"{where}: {call} returned a reward of type {type(reward).__name__} ({show(reward)}); "
                         "the reward must be a number (int or float)")
    if not (isinstance(done, bool) or type(done).__name__ == "bool_" or (isinstance(done, int) and done in (0, 1))):
        raise ValueError(f"{where}: {call} returned done of type {type(done).__name__} ({show(done)}); "
                         "done must be a bool")  # numpy's bool and 0 / 1 pass: the env-state manager reads them right
    if not isinstance(info, Mapping):
        raise ValueError(f"{where}: {call} returned info of type {type(info).__name__} ({show(info)}); {FIX_INFO}")
    missing = [key for key in REQUIRED_INFO if key not in info]
    if missing:
        raise ValueError(f"{where}: {call} returned info without {', '.join(map(repr, missing))} (it has "
                         f"{sorted(map(str, info))}); {FIX_INFO}")
    for key in WARNED_INFO:
        if key not in info and key not in warned:
            warned.add(key)
            logger.warning("%s: %s returned info without %r, so env/<tag>/%s reads 0; %s", where, call, key, key,
                           FIX_INFO)
    return bool(done)


def _call(where: str, call: str, fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` under a deadline; an exception or a missed deadline is a ValueError naming the call."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below, in one line
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"preflight {where}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ValueError(f"{where}: {call} did not return within {timeout_s:g} s (the env actors' deadline, "
                         "es_manager.env_reset_timeout_s / env_step_timeout_s); make it return, or raise the deadline")
    if "error" in box:
        exc = box["error"]
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ValueError(f"{where}: {call} raised {text}; {_fix(call)}") from None
    return box.get("value")


def _fix(call: str) -> str:
    if call.startswith("step("):
        return "step must take any str: answer text it cannot parse with the unchanged observation, reward 0 " \
               "and action_is_valid=False"
    if call.startswith("the constructor"):
        return "fix the env's __init__ or the tag's env_config"
    return f"fix {call.split('(')[0]}()"


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a one-line refusal."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
