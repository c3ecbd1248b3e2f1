"""Context condensation as episodes grow: peak context tokens and rollout time, full vs simple vs truncate vs summary.

    python bench/bench_condensation.py [--turns 2 4 8 16] [--episodes 8] [--out docs/bench]

For each condenser and each episode length T, plays one rollout of ``--episodes`` FrozenLake
episodes (an all-ice 4x4 lake, so an episode ends only at the goal or after T turns) with the
real rollout engine (vLLM's CPU build, in this process) on the tiny model, every prompt built
by the condensed context manager with that condenser. Measured per run: the peak context
(longest prompt of any turn, tokens), the mean context of the last turn, the rollout's wall
time and its parts (generation, condensation incl. the policy's summaries). ``full`` keeps
the whole conversation (its budget is the model length); the others get ``--budget`` tokens.
Writes ``condensation.json`` and ``condensation.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("full", "simple", "truncate", "summary")


def lake_tags(max_turns: int) -> dict:
    """A FrozenLake tag without holes whose action budget never ends an episode before ``max_turns``."""
    return {"Lake": {"env_type": "frozen_lake", "max_actions_per_traj": max_turns * 2, "max_tokens": 32,
                     "env_instruction": "Walk to the goal. Answer like <answer>Down</answer>.",
                     "env_config": {"size": 4, "p": 1.0, "is_slippery": False}}}


def play(engine, ctx_mgr, manager, turns: int, max_tokens: int, seed: int) -> dict:
    """One rollout, as ``SyncMultiTurnRollout._play`` runs it (summaries, generate, env step); its measurements."""
    from agent_trainer.common import profiling

    start = time.perf_counter()
    episodes = {o.env_id: ctx_mgr.start(o) for o in manager.reset({0: seed, 1: seed + 1})}
    timings = profiling.TurnTimings()

    def generate(prompts, budgets, temperature):
        outs = engine.generate(prompts, max_tokens=max(budgets), temperature=temperature, seed=seed)
        return [(o.token_ids, o.logprobs) for o in outs]

    for turn in range(turns):
        ctx_mgr.write_summaries(episodes.values(), generate)
        active = [e for e in episodes.values() if not e.done]
        if not active:
            break
        with timings.phase("generate", turn):
            outs = generate([ctx_mgr.prompt_ids(e) for e in active], [max_tokens], 1.0)
        inputs = [ctx_mgr.append_reply(e, ids, lp) for e, (ids, lp) in zip(active, outs)]
        with timings.phase("env_step", turn):
            results = manager.step(inputs)
        for out in results:
            ctx_mgr.append_env_output(episodes[out.env_id], out, max_tokens)
    seconds = time.perf_counter() - start
    played = list(episodes.values())
    prof = profiling.condensation_metrics(played)
    last = max(e.num_turns for e in played)
    return {"rollout_s": seconds, "generate_s": timings.metrics()["timing_s/generate"],
            "condense_s": prof["timing_s/condensation"], "summary_s": prof["timing_s/summary_generate"],
            "peak_context_tokens": prof["profile/context_tokens_max"],
            "peak_uncondensed_tokens": prof["profile/context_tokens_before_max"],
            "last_turn_context_tokens": prof[f"profile/context_tokens_after_turn_{last}"],
            "turns_played_mean": sum(e.num_turns for e in played) / len(played), "summaries": prof["profile/summaries"]}


def run(args) -> dict:
    from transformers import AutoTokenizer

    from agent_trainer.agents.condensed_ctx import CondensedContextManager
    from agent_trainer.config.multiturn import ContextCondenserConfig
    from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
    from agent_trainer.workers.rollout import VLLMRolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = VLLMRolloutWorker(args.model, max_model_len=args.max_model_len, kv_cache_space_gib=0.5, seed=0)
    specs = [EpisodeSpec(env_id=i, group_id=i % 2, tag="Lake") for i in range(args.episodes)]
    warm = CondensedContextManager(tokenizer, max_model_len=args.max_model_len)
    play(engine, warm, EnvStateManager(lake_tags(2), specs), 2, args.max_tokens, 0)  # warm-up, not reported
    results = []
    for turns in args.turns:
        manager = EnvStateManager(lake_tags(turns), specs, format_penalty=-0.1)
        for kind in STRATEGIES:
            budget = args.max_model_len - args.max_tokens if kind == "full" else args.budget
            cfg = ContextCondenserConfig(type=kind, keep_last_n_steps=2, max_condensed_tokens=budget,
                                         summary_max_tokens=args.summary_tokens)
            ctx_mgr = CondensedContextManager(tokenizer, condenser=cfg, max_model_len=args.max_model_len)
            row = {"condenser": kind, "turns": turns, **play(engine, ctx_mgr, manager, turns, args.max_tokens, 7)}
            print(json.dumps(row), flush=True)
            results.append(row)
    return {"results": results, "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ctx, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in STRATEGIES:
        rows = [r for r in report["results"] if r["condenser"] == kind]
        turns = [r["turns"] for r in rows]
        ax_ctx.plot(turns, [r["peak_context_tokens"] for r in rows], marker="o", label=kind)
        ax_time.plot(turns, [r["rollout_s"] for r in rows], marker="o", label=kind)
    for ax, label in ((ax_ctx, "peak context (tokens)"), (ax_time, "rollout time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("turns per episode")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_ctx.legend()
    fig.suptitle("Context condensation on the tiny model (CPU, vLLM in-process)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-qwen2"))
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per turn")
    parser.add_argument("--budget", type=int, default=384, help="max_condensed_tokens of the condensers but full")
    parser.add_argument("--summary-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048, help="the tiny model has 2048 positions")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench")
    args = parser.parse_args()
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "condensation.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out / "condensation.png")
    print(f"wrote {args.out / 'condensation.json'} and {args.out / 'condensation.png'}")


if __name__ == "__main__":
    main()
