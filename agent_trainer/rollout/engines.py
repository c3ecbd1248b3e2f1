"""The rollout engines, called from the turn loops: one turn's prompts fanned out over the engines
(:func:`generate`), an engine that dies or stalls restarted and the turn generated once more."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from agent_trainer.rollout.splits import SamplingParams
from agent_trainer.workers.weight_sync import synced_tag
from agent_trainer.workers.worker_group import wait_until_ready

logger = logging.getLogger(__name__)


def generate(engines: list, prompts: list[list[int]], sampling: SamplingParams, seed: int, timeout_s: float,
             on_engine_restart: Callable[[], object] | None, on_failure: Callable[[], object],
             budgets: list[int] | None = None,
             prompt_seeds: list[int] | None = None) -> list[tuple[list[int], list[float]]]:
    """Split prompts across the engines, generate, keep the order.

    ``budgets[k]`` is prompt k's max new tokens (``sampling.max_tokens`` for all when
    None). Each engine gets one call per distinct budget; call j of engine i samples
    with ``seed + i + j * len(engines)``, so with one budget engine i samples with ``seed + i``.

    An engine that dies mid-turn is restarted by Ray (``max_restarts``) from the
    checkpoint on disk; one that misses ``timeout_s`` (``rollout.generate_timeout_s``) is killed and
    restarted the same way. One that died and was restarted between two turns answers with the weights it
    started from (its :meth:`~agent_trainer.workers.engines.base.RolloutEngine.weights_tag` is not the last
    sync's): its outputs are dropped. ``on_failure`` counts each, ``on_engine_restart`` re-syncs the policy
    weights and the turn is generated once more. A second failure raises.

    ``prompt_seeds`` (one per prompt) seeds each request instead (vLLM only): a prompt then
    samples the same tokens whichever prompts share its call (``rollout.mode=async``).
    """
    budgets = budgets or [sampling.max_tokens] * len(prompts)
    calls = []  # (engine, prompt indices, sampling, seed)
    for j, budget in enumerate(sorted(set(budgets))):
        same_budget = [k for k, b in enumerate(budgets) if b == budget]
        for i, chunk in enumerate(np.array_split(same_budget, len(engines))):
            if len(chunk):
                calls.append((engines[i], chunk.tolist(), dataclasses.replace(sampling, max_tokens=budget),
                              seed + i + j * len(engines)))
    for attempt in range(2):
        tags = _ask_weights_tags([c[0] for c in calls])  # before the calls: an engine answers them in order
        refs = [engine.generate.remote([prompts[k] for k in chunk], **vars(params), seed=call_seed,
                                       **({} if prompt_seeds is None else
                                          dict(seeds=[prompt_seeds[k] for k in chunk])))
                for engine, chunk, params, call_seed in calls]
        try:
            outputs = get_or_kill(refs, [c[0] for c in calls], timeout_s)
            _check_weights_tags(tags)
            break
        except (RayActorError, ActorUnavailableError, GetTimeoutError, StaleEngine) as err:
            if attempt == 1 or on_engine_restart is None:
                raise
            on_failure()
            logger.error("rollout engine failed (%s); re-syncing weights into its restart and retrying", err)
            wait_until_ready(engines)
            on_engine_restart()
    results: list = [None] * len(prompts)
    for (_, chunk, _, _), chunk_outputs in zip(calls, outputs):
        for k, out in zip(chunk, chunk_outputs):
            results[k] = (list(out.token_ids), list(out.logprobs))
    return results


class StaleEngine(RuntimeError):
    """An engine answered with weights other than the last sync's: Ray restarted it between two turns."""


def _ask_weights_tags(engines: list) -> list[tuple[object, str, object]]:
    """(engine, the tag its last sync left, the engine's answer) for every engine this process has synced."""
    asked, out = set(), []
    for engine in engines:
        expected = synced_tag(engine)
        if expected is not None and id(engine) not in asked:
            asked.add(id(engine))
            out.append((engine, expected, engine.weights_tag.remote()))
    return out


def _check_weights_tags(tags: list[tuple[object, str, object]]) -> None:
    """Raise :class:`StaleEngine` when an engine held other weights than the last sync's while it generated."""
    answers = ray.get([ref for _, _, ref in tags])
    stale = [i for i, ((_, expected, _), got) in enumerate(zip(tags, answers)) if got != expected]
    if stale:
        raise StaleEngine(f"{len(stale)} rollout engine(s) were restarted by Ray since the last weight sync and "
                          "generated from the checkpoint they started from")


def get_or_kill(refs: list, engines: list, timeout_s: float) -> list:
    """``ray.get(refs)`` within ``timeout_s``; on a timeout, kill the engines still busy (Ray restarts them)."""
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        stuck = {id(engines[refs.index(r)]): engines[refs.index(r)] for r in pending}
        for engine in stuck.values():
            ray.kill(engine, no_restart=False)
        raise GetTimeoutError(f"{len(stuck)} rollout engine(s) did not finish a turn within {timeout_s:g} s "
                              "(actor_rollout_ref.rollout.generate_timeout_s); killed them for a restart")
    return ray.get(refs)
