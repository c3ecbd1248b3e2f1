"""How often a model's first replies are valid actions of an environment, measured through the rollout's own code.

    python -m launch.validity_probe --model models/tiny-qwen2 [--envs-file my_envs.yaml] [--tag Elevator ...]

Episodes are reset and stepped by ``agent_trainer.episode.es_manager.EnvStateManager`` (the instruction with the env's
``Valid actions:`` line, the format penalty, the env's ``action_is_valid``), prompts are built and replies parsed by
``agent_trainer.agents.ctx_manager.ContextManager``, and replies are sampled by
``agent_trainer.workers.rollout.HFRolloutWorker`` at the trainer's default sampling (temperature 1, no top-k/top-p,
``response_length`` 100 capped by the tag's ``max_tokens``). A turn counts as valid when the env-state manager says so:
the reply parsed and the env accepted every action in it. No parsing or prompt building is repeated here.
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ProbeResult:
    """What one tag's episodes answered."""

    tag: str
    turns: int
    """Turns played (episodes x turns, fewer when episodes ended early)."""
    valid: int
    """Turns whose actions the env accepted (``action_is_valid`` of the env-state manager)."""
    format_ok: int
    """Turns whose reply had the ``<answer>`` format (``prompts.parse_response``)."""
    answers: collections.Counter = field(default_factory=collections.Counter)
    """How often each answer text was given (for uniformity checks)."""
    episodes: int = 0
    successes: int = 0
    """Episodes played and those the env reported ``success`` on (at their last step)."""
    chose_hole: list[float] = field(default_factory=list)
    """FrozenLake's reading diagnostic per turn that tests reading (``info["chose_hole"]``: 1.0 onto the hole)."""

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def chose_hole_rate(self) -> float | None:
        return sum(self.chose_hole) / len(self.chose_hole) if self.chose_hole else None

    @property
    def valid_rate(self) -> float:
        return self.valid / self.turns if self.turns else 0.0

    @property
    def format_ok_rate(self) -> float:
        return self.format_ok / self.turns if self.turns else 0.0


def walk(manager, ctx_mgr, reset_seeds: list[int], turns: int, replies, response_length: int):
    """Reset ``manager``'s episodes (episode ``i`` with ``reset_seeds[i]``) and walk them for up to ``turns`` turns
    through ``ctx_mgr``; yield each episode's ``(EnvInput, EnvOutput)`` of every turn as it is stepped.

    Each turn, ``replies(turn, active)`` gives the reply of every episode still running, in the order of ``active``
    (their contexts): ``(token_ids, logprobs)``. The walk stops early once every episode is done; the next
    observation is appended with ``response_length`` as the context manager's reply budget. The caller builds and
    closes ``manager``."""
    contexts = {out.env_id: ctx_mgr.start(out) for out in manager.reset(dict(enumerate(reset_seeds)))}
    for turn in range(turns):
        active = [ctx for ctx in contexts.values() if not ctx.done]
        if not active:
            break
        inputs = [ctx_mgr.append_reply(ctx, ids, logprobs)
                  for ctx, (ids, logprobs) in zip(active, replies(turn, active))]
        for inp, out in zip(inputs, manager.step(inputs)):
            yield inp, out
            ctx_mgr.append_env_output(contexts[out.env_id], out, response_length)


def probe_tag(engine, tokenizer, tags: dict, tag: str, *, episodes: int = 64, turns: int = 1, seed: int = 0,
              temperature: float = 1.0, response_length: int = 100, enable_think: bool = True,
              reset_seeds: list[int] | None = None) -> ProbeResult:
    """Play ``episodes`` episodes of ``tag`` (reset with ``seed``, ``seed + 1``, ... or with ``reset_seeds``) for up
    to ``turns`` turns with ``engine`` and count valid turns, successes and the reading diagnostic."""
    reset_seeds = list(reset_seeds) if reset_seeds is not None else [seed + i for i in range(episodes)]
    episodes = len(reset_seeds)
    from agent_trainer.agents.ctx_manager import ContextManager
    from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec

    ctx_mgr = ContextManager(tokenizer, enable_think=enable_think)
    manager = EnvStateManager(tags, [EpisodeSpec(env_id=i, group_id=i, tag=tag) for i in range(episodes)])
    budget = min(manager.tags[tag].max_tokens, response_length)
    result = ProbeResult(tag, 0, 0, 0, episodes=episodes)

    def sampled(turn, active):
        generated = engine.generate([ctx_mgr.prompt_ids(ctx) for ctx in active], max_tokens=budget,
                                    temperature=temperature, seed=seed + turn)
        return [(out.token_ids, out.logprobs) for out in generated]

    try:
        for inp, out in walk(manager, ctx_mgr, reset_seeds, turns, sampled, budget):
            parsed_ok = bool(inp.actions)
            result.turns += 1
            result.valid += bool(out.info.get("action_is_valid", False))
            result.format_ok += parsed_ok
            result.answers[" || ".join(inp.actions) if parsed_ok else "<format error>"] += 1
            if "chose_hole" in out.info:
                result.chose_hole.append(float(out.info["chose_hole"]))
            result.successes += bool(out.done and out.info.get("success", False))
    finally:
        manager.close()
    return result


def probe_model(model_path: str | Path, tags: dict, tag_names: list[str] | None = None, **kwargs) -> list[ProbeResult]:
    """:func:`probe_tag` for each of ``tag_names`` (default: every tag of ``tags``) with one HF engine."""
    from transformers import AutoTokenizer

    from agent_trainer.workers.rollout import HFRolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = HFRolloutWorker(str(model_path), seed=kwargs.get("seed", 0))
    return [probe_tag(engine, tokenizer, tags, tag, **kwargs) for tag in (tag_names or list(tags))]


def main(argv: list[str] | None = None) -> list[ProbeResult]:
    """Command-line entry point: one line per tag, then a JSON summary."""
    from envs import load_env_tags

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-qwen2", help="model folder (HF format)")
    p.add_argument("--envs-file", default="config/envs.yaml", help="tags file")
    p.add_argument("--tag", action="append", default=None, help="tag to probe (repeatable; default: all)")
    p.add_argument("--episodes", type=int, default=64, help="episodes per tag")
    p.add_argument("--turns", type=int, default=1, help="turns per episode")
    p.add_argument("--seed", type=int, default=0, help="reset seeds start here; sampling seed")
    p.add_argument("--no-think", action="store_true", help="answer-only prompt (agent_proxy.enable_think=false)")
    a = p.parse_args(argv)
    tags = load_env_tags(a.envs_file)
    results = []
    for tag in a.tag or list(tags):
        try:
            results += probe_model(a.model, tags, [tag], episodes=a.episodes, turns=a.turns, seed=a.seed,
                                   enable_think=not a.no_think)
        except ImportError as exc:  # an env whose optional package is missing (ALFWorld)
            print(f"{tag}: skipped ({str(exc).splitlines()[0]})")
            continue
        r = results[-1]
        top = ", ".join(f"{k!r}: {v}" for k, v in r.answers.most_common(5))
        print(f"{tag}: valid {r.valid_rate:.3f}, format_ok {r.format_ok_rate:.3f} over {r.turns} turns; {top}")
    print(json.dumps({r.tag: round(r.valid_rate, 3) for r in results}))
    return results


if __name__ == "__main__":
    main()
