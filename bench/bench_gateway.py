"""The cost of the gateway's HTTP hop: rollout tokens/s of the plain-``openai`` FrozenLake agent through the gateway
against the built-in agent, on the same episodes (benchmark of docs/benchmarks.md and docs/gateway.md, not a test).

Plays the training split of ``config/frozenlake_gateway.yaml`` (make train's task: 8 maps x 8 episodes) from one
model with one vLLM engine, alternating the built-in agent (``MultiTurnRollout``) and the gateway agent
(``GatewayRollout``, examples/gateway/frozenlake_openai.py: the same messages) on the same group seeds, in one
process. Per rollout: generated tokens / wall seconds; medians over ``--rollouts`` rollouts after one warm-up
each. Writes ``gateway.json`` to a results folder (``bench/results/<UTC stamp>`` unless ``--out``).

    python bench/bench_gateway.py [--model DIR] [--rollouts 3] [--out DIR] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_turn_barrier import _release  # noqa: E402
from results import results_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SFT = REPO / "outputs" / "agent_trainer" / "sft_frozenlake_nodeadends" / "final"


def _config(model: str, overrides: list[str]):
    from agent_trainer.checks.prepare import compose, prepare

    return prepare(compose("frozenlake_gateway", [f"model_path={model}", "agent_proxy.num_env_actors=1", *overrides]))


def _play(rollout, seeds: list[list[int]]) -> dict:
    """Rollouts on the given group seeds (the first a warm-up): median seconds, tokens/s and what they did."""
    seconds, tokens, metrics, batches = [], [], [], []
    for k, group_seeds in enumerate(seeds):
        start = time.perf_counter()
        result = rollout.rollout(step=k, seeds=group_seeds)
        wall = time.perf_counter() - start
        if k:
            seconds.append(wall)
            tokens.append(float(result.batch["response_mask"].sum()))
            metrics.append(result.metrics)
            loop = getattr(rollout, "loop", None)
            if loop is not None:
                batches.append(loop.batcher.batch_sizes)
    rates = [t / s for t, s in zip(tokens, seconds)]
    return {"rollout_s": statistics.median(seconds), "tokens_per_s": statistics.median(rates), "all_tokens_per_s": rates,
            **{key: statistics.mean(m[f"rollout/{key}"] for m in metrics)
               for key in ("num_turns_mean", "format_error_rate", "success_rate")},
            **({"engine_calls": statistics.mean(m["rollout/gateway_engine_calls"] for m in metrics),
                "calls": statistics.mean(m["rollout/gateway_calls"] for m in metrics)}
               if "rollout/gateway_calls" in metrics[0] else {}),
            **({"requests_per_engine_call": batches} if batches else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SFT if SFT.exists() else REPO / "models" / "tiny-qwen2"),
                        help="the policy (default: make train's warm start when it exists, else the tiny model)")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    import ray
    from transformers import AutoTokenizer

    from agent_trainer.ray_cluster import shutdown_ray
    from agent_trainer.rollout import GatewayRollout, MultiTurnRollout
    from agent_trainer.workers.env_worker import EnvWorker
    from agent_trainer.workers.rollout import VLLMRolloutWorker

    cfg, tags = _config(args.model, overrides)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = ray.remote(VLLMRolloutWorker).options(num_cpus=0.5).remote(
        args.model, max_model_len=cfg.actor_rollout_ref.rollout.max_model_len)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results = {"config": "frozenlake_gateway", "model": args.model, "overrides": overrides}
    seeds = None
    for name, cls in (("built_in", MultiTurnRollout), ("gateway", GatewayRollout)):
        rollout = cls(cfg, tokenizer, [engine], EnvWorker, tags, split="train", num_env_actors=1)
        try:
            seeds = seeds or [rollout.next_group_seeds() for _ in range(args.rollouts + 1)]
            results[name] = _play(rollout, seeds)
            print(f"{name}: {results[name]}", flush=True)
        finally:
            rollout.close()
            _release(rollout)
    results["gateway_over_built_in_tokens_per_s"] = results["gateway"]["tokens_per_s"] / results["built_in"][
        "tokens_per_s"]
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(json.dumps(results, indent=2))
    print(f"gateway / built-in tokens/s: {results['gateway_over_built_in_tokens_per_s']:.2f}; wrote {out / 'gateway.json'}")
    shutdown_ray()


if __name__ == "__main__":
    main()
