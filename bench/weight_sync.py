"""Weight sync, old against new, side by side in one run (docs/benchmarks.md, "Weight sync: buckets").

A 2-rank FSDP2 actor and one vLLM CPU engine on ``--model``. Each way of syncing runs ``--repeats`` times,
interleaved (old, new, old, new, ...), and is reported as its median wall time and its largest single transfer
(the bytes one message carries: the whole float32 state dict before, one bucket now), which is what the sync
holds on top of the actor's own shards:

- ``full_state_dict``: the previous sync: rank 0 gathers the whole model and one state dict goes through the
  object store to the engine (``full_state_dict`` + ``update_weights``).
- ``object_store``: the bucketed sync at the default bucket size and at ``--small-mb``.
- ``collective``: the bucketed sync broadcast over a gloo group (kept between syncs); the first sync's group
  set-up is reported on its own.

    python -m bench.weight_sync --model models/tiny-qwen2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small-mb", type=float, default=0.25)
    args = parser.parse_args()

    import ray
    from safetensors import safe_open

    from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig
    from agent_trainer.ray_cluster import shutdown_ray
    from agent_trainer.workers.actor import ActorWorker
    from agent_trainer.workers.rollout import VLLMRolloutWorker
    from agent_trainer.workers.weight_sync import SyncPlan, sync_weights
    from agent_trainer.workers.worker_group import WorkerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                        fsdp=FSDPConfig(world_size=2, num_cpus_per_rank=0.25))
    actor_wg = WorkerGroup(ActorWorker, name="bench_actor", world_size=2, num_cpus_per_rank=0.25,
                           num_gpus_per_rank=0.0, distributed=True, placement_timeout_s=120, collective_timeout_s=300,
                           init_kwargs={"model": ModelConfig(path=args.model), "actor": actor, "device": "cpu",
                                        "seed": 0})
    actor_wg.execute_all("init_model")
    engine = ray.remote(num_cpus=0.25)(VLLMRolloutWorker).options(
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(
        args.model, device="cpu", max_model_len=64, kv_cache_space_gib=0.05, seed=0)
    ray.get(engine.prompt_logprobs.remote([[1, 2, 3]]))

    def old() -> dict:
        refs = actor_wg.execute_all_async("full_state_dict")
        ray.get(refs[1:])
        ray.get(engine.update_weights.remote(refs[0]))
        state = ray.get(refs[0])
        return {"max_transfer_bytes": sum(t.numel() * t.element_size() for t in state.values()), "buckets": 1}

    def new(transport: str, mb: float):
        def run() -> dict:
            seen: list[dict] = []
            sync_weights(actor_wg, [engine], SyncPlan(transport, mb, False, 300.0), on_stats=seen.append)
            return seen[0]
        return run

    ways = {"full_state_dict (before)": old, "object_store, 256 MiB buckets": new("object_store", 256),
            f"object_store, {args.small_mb:g} MiB buckets": new("object_store", args.small_mb),
            f"collective (gloo), {args.small_mb:g} MiB buckets": new("collective", args.small_mb)}
    first_collective = new("collective", args.small_mb)()  # builds the group: its cost on its own
    times: dict[str, list[float]] = {k: [] for k in ways}
    stats: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            stats[name] = way()
            times[name].append(time.perf_counter() - start)
    params = sum(math.prod(fh.get_slice(n).get_shape()) for file in Path(args.model).glob("*.safetensors")
                 for fh in [safe_open(str(file), framework="pt")] for n in fh.keys())
    base = statistics.median(times["full_state_dict (before)"])
    base_bytes = stats["full_state_dict (before)"]["max_transfer_bytes"]
    rows = []
    for name in ways:
        med = statistics.median(times[name])
        peak = stats[name]["max_transfer_bytes"]
        rows.append({"way": name, "median_s": med, "time_vs_before": med / base, "buckets": stats[name]["buckets"],
                     "max_transfer_bytes": peak, "transfer_vs_before": peak / base_bytes})
    print(json.dumps({"model": args.model, "parameters": params, "repeats": args.repeats,
                      "collective_group_setup_s": first_collective["group_setup_s"], "rows": rows}, indent=1))
    print("| way | median s | vs before | buckets | largest transfer | vs before |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['way']} | {r['median_s']:.3f} | {r['time_vs_before']:.2f}x | {r['buckets']} | "
              f"{r['max_transfer_bytes'] / 2**20:.2f} MiB | {r['transfer_vs_before']:.2f}x |")
    print(f"collective group set-up (first sync only): {first_collective['group_setup_s'] * 1e3:.1f} ms")
    actor_wg.shutdown()
    shutdown_ray()


if __name__ == "__main__":
    main()
