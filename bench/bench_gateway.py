"""The cost of the gateway's HTTP hop: rollout tokens/s of the plain-``openai`` FrozenLake agent through the gateway
against the built-in agent, on the same episodes (benchmark of docs/benchmarks.md and docs/gateway.md, not a test).

Plays the training split of ``config/frozenlake_gateway.yaml`` (make train's task: 8 maps x 8 episodes) from one
model with one vLLM engine: the built-in agent (``MultiTurnRollout``), then the gateway agent (``GatewayRollout``,
examples/gateway/frozenlake_openai.py: the same messages), then the same agent written with the synchronous
``openai.OpenAI`` client (examples/gateway/frozenlake_openai_sync.py), on the same group seeds, in one process. Per rollout: generated tokens / wall seconds; medians over ``--rollouts`` rollouts after one warm-up
each. Writes ``gateway.json`` to a results folder (``bench/results/<UTC stamp>`` unless ``--out``).

``--floor`` measures instead what the HTTP hop costs with nothing else: the gateway app (its own process, as in a
run) with an engine that answers at once, and 64 ``AsyncOpenAI`` agents on one event loop sending the example's
messages for 4 turns each, no env and no Ray; and the same agents against a bare FastAPI route that returns a
canned completion (the HTTP stack and the client alone). Milliseconds of wall time per chat completion.

    python bench/bench_gateway.py [--model DIR] [--rollouts 3] [--out DIR] [--floor] [overrides ...]
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
SFT = REPO / "outputs" / "agent_trainer" / "sft_frozenlake_nodeadends_seed0" / "final"
"""make train's warm start (SEED=0)."""
SYNC_AGENT = "examples.gateway.frozenlake_openai_sync.run"
"""The same agent written with the synchronous ``openai.OpenAI`` client."""


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


FLOOR_EPISODES, FLOOR_TURNS = 64, 4
REPLY = "<think>The goal is below.</think><answer>Down</answer>"


def _serve_floor(model: str, bare: bool, port_out) -> None:
    """The floor's server process: the gateway app over an engine that answers at once, or a bare route."""
    import time as _time

    from fastapi import FastAPI
    from transformers import AutoTokenizer

    from agent_trainer.gateway.app import Gateway, create_app
    from agent_trainer.gateway.server import GatewayServer
    from agent_trainer.gateway.sessions import SessionStore
    from agent_trainer.workers.rollout import GenerationOutput

    tokenizer = AutoTokenizer.from_pretrained(model)
    reply = tokenizer.encode(REPLY, add_special_tokens=False) + [tokenizer.eos_token_id]
    if bare:
        app = FastAPI()

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def canned(session_id: str) -> dict:
            return {"id": "chatcmpl-0", "object": "chat.completion", "created": int(_time.time()), "model": "floor",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": REPLY}}]}
    else:
        store = SessionStore()
        gateway = Gateway(tokenizer=tokenizer, store=store, api_key="floor", model="floor", max_model_len=4096,
                          generate=lambda prompts, **_: [GenerationOutput(reply, [-0.1] * len(reply), "stop")
                                                         for _ in prompts])
        for k in range(FLOOR_EPISODES):
            store.open(f"s{k}")
        app = create_app(gateway)
    server = GatewayServer(app)
    port_out.put(server.port)
    _time.sleep(3600)


def _floor(model: str) -> dict:
    """Milliseconds per chat completion of 64 agents x 4 turns, against the gateway app and a bare route."""
    import asyncio
    import multiprocessing

    import openai

    from examples.gateway.frozenlake_openai import after_step, first_messages

    class _Task:
        instruction, observation = "Reach the goal.", "_P_\n_G_"

    class _Step:
        observation, reward = "_P_\n_G_", 0.0

    async def agents(port: int) -> float:
        http = openai.DefaultAsyncHttpxClient(timeout=60)

        async def episode(k: int) -> None:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/sessions/s{k}/v1", api_key="floor",
                                        max_retries=0, http_client=http)
            messages = first_messages(_Task())
            for _ in range(FLOOR_TURNS):
                reply = await client.chat.completions.create(model="floor", messages=messages)
                messages += after_step(reply.choices[0].message.content or "", _Step())

        await asyncio.gather(*(episode(k) for k in range(FLOOR_EPISODES)))  # warm-up: connections, first calls
        start = time.perf_counter()
        await asyncio.gather(*(episode(k) for k in range(FLOOR_EPISODES)))
        wall = time.perf_counter() - start
        await http.aclose()
        return wall

    out = {}
    for name, bare in (("gateway_app", False), ("bare_route", True)):
        ctx = multiprocessing.get_context("spawn")
        port_out = ctx.Queue()
        server = ctx.Process(target=_serve_floor, args=(model, bare, port_out), daemon=True)
        server.start()
        try:
            wall = asyncio.run(agents(port_out.get(timeout=120)))
        finally:
            server.kill()
        calls = FLOOR_EPISODES * FLOOR_TURNS
        out[name] = {"calls": calls, "wall_s": wall, "ms_per_call": 1000 * wall / calls}
        print(f"floor, {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SFT if SFT.exists() else REPO / "models" / "tiny-qwen2"),
                        help="the policy (default: make train's warm start when it exists, else the tiny model)")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--floor", action="store_true", help="only the HTTP hop's floor (module docstring)")
    args, overrides = parser.parse_known_args()
    if args.floor:
        out = args.out or results_dir()
        out.mkdir(parents=True, exist_ok=True)
        (out / "gateway_floor.json").write_text(json.dumps({"model": args.model, **_floor(args.model)}, indent=2))
        return
    import ray
    from transformers import AutoTokenizer

    from agent_trainer.ray_cluster import shutdown_ray
    from agent_trainer.rollout import GatewayRollout, MultiTurnRollout
    from agent_trainer.workers.env_worker import EnvWorker
    from agent_trainer.workers.rollout import VLLMRolloutWorker

    cfg, tags = _config(args.model, overrides)
    sync_cfg, _ = _config(args.model, [*overrides, f"agent_proxy.gateway.agent={SYNC_AGENT}"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = ray.remote(VLLMRolloutWorker).options(num_cpus=0.5).remote(
        args.model, max_model_len=cfg.actor_rollout_ref.rollout.max_model_len)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results = {"config": "frozenlake_gateway", "model": args.model, "overrides": overrides}
    seeds = None
    for name, cls, run_cfg in (("built_in", MultiTurnRollout, cfg), ("gateway", GatewayRollout, cfg),
                               ("gateway_sync", GatewayRollout, sync_cfg)):
        rollout = cls(run_cfg, tokenizer, [engine], EnvWorker, tags, split="train", num_env_actors=1)
        try:
            seeds = seeds or [rollout.next_group_seeds() for _ in range(args.rollouts + 1)]
            results[name] = _play(rollout, seeds)
            print(f"{name}: {results[name]}", flush=True)
        finally:
            rollout.close()
            _release(rollout)
    for name in ("gateway", "gateway_sync"):
        results[f"{name}_over_built_in_tokens_per_s"] = (results[name]["tokens_per_s"]
                                                         / results["built_in"]["tokens_per_s"])
    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(json.dumps(results, indent=2))
    print(f"gateway / built-in tokens/s: async agent {results['gateway_over_built_in_tokens_per_s']:.2f}, "
          f"sync agent {results['gateway_sync_over_built_in_tokens_per_s']:.2f}; wrote {out / 'gateway.json'}")
    shutdown_ray()


if __name__ == "__main__":
    main()
