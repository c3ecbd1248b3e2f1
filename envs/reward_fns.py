"""Reward functions for prompt datasets: a user's function loaded by file path, or the default scorer.

A reward function has verl's signature::

    def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict) -> float

and returns a float (or a dict with a ``"score"`` float, as verl allows). It is named by
``reward.custom_reward_function.path`` (a ``.py`` file, loaded by path like verl) and
``.name`` (the function in that file). Without a path, :func:`default_compute_score` scores
the answer against the ground truth with the MetaMathQA comparison (numbers, fractions,
``\\boxed{}``, simple LaTeX): 1.0 when they match, else 0.0.

``solution_str`` is the answer the agent extracted from the reply (the text inside
``<answer>...</answer>``; see docs/rewards.md). The file is the user's own code and runs in
the environment actors; model output only ever reaches it as the ``solution_str`` argument.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

from envs.metamathqa import answers_match

RewardFn = Callable[[str, str, Any, dict], Any]


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
                          ) -> float:
    """1.0 when the answer equals the ground truth (MetaMathQA's number/fraction/LaTeX comparison), else 0.0."""
    if ground_truth is None:
        return 0.0
    return float(answers_match(solution_str, str(ground_truth)))


@functools.lru_cache(maxsize=8)
def load_reward_fn(path: str = "", name: str = "compute_score") -> RewardFn:
    """The function ``name`` in the Python file ``path``; the default scorer when ``path`` is empty.

    Raises ValueError naming the key when the file or the function is missing or not callable
    with verl's four arguments.
    """
    if not path:
        return default_compute_score
    file = Path(path)
    if not file.is_file() or file.suffix != ".py":
        raise ValueError(f"reward.custom_reward_function.path = {path!r} is not a .py file; point it at the "
                         "file that defines the reward function (see docs/rewards.md)")
    spec = importlib.util.spec_from_file_location(f"custom_reward_{abs(hash(str(file.resolve())))}", file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]  # the user's own file, as in verl
    except Exception as err:  # noqa: BLE001 - any error in the user's file is reported with the key
        raise ValueError(f"reward.custom_reward_function.path = {path!r} failed to import "
                         f"({type(err).__name__}: {err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward.custom_reward_function.name = {name!r} is not a function in {path}; "
                         f"functions there: {found}")
    try:
        inspect.signature(fn).bind("", "", None, {})
    except TypeError:
        raise ValueError(f"reward.custom_reward_function.name = {name!r} in {path} must take verl's arguments "
                         "(data_source, solution_str, ground_truth, extra_info)") from None
    return fn


def score(fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """Call a reward function and return its score as a float (a dict's ``"score"``).

    A result that is not a number (or a dict holding one) raises naming the function's result.
    """
    out = fn(data_source, solution_str, ground_truth, dict(extra_info))
    if isinstance(out, dict):
        out = out.get("score")
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned {out!r}; it must return a "
                         "number or a dict with a numeric 'score'")
    return float(out)  # NaN/inf reach the rollout's algorithm.nonfinite_reward policy
