"""The torch-level GPU checks: the project's own FSDP2 actor and HF rollout worker on one CUDA device, no Ray, no vLLM.

What it runs (each part prints one JSON line and the whole record goes to ``--out``):

1. ``pick_device("cuda")`` gives a device with an index that ``torch.cuda.set_device`` accepts.
2. The actor update of a Qwen2.5-0.5B-shaped model (``config/model_shapes/Qwen2.5-0.5B``, random init, written
   as safetensors first): ``ActorWorker`` over a one-rank NCCL process group, meta-device loading with rank 0's
   broadcast, float32 master weights, ``fsdp.mixed_precision=bf16`` (FSDP2's MixedPrecisionPolicy), gradient
   checkpointing, the ``gpu_qwen0.5b_1gpu`` micro-batch (4 rows x 2048 tokens). Reported: seconds per update,
   tokens/s, MFU (model FLOPs 6N + attention per token over the card's dense bf16 peak), peak allocated memory
   against the memory plan's lines for the same job.
3. ``compute_log_prob`` and a colocated bfloat16 reference with ``ref.fsdp.param_offload`` (FSDP2's
   CPUOffloadPolicy: the reference's shards live in host memory) on CUDA.
4. The HF rollout worker on CUDA (bfloat16): tokens/s of ``generate``; its sampled log-probs against the actor's
   ``compute_log_prob`` of the same tokens, before and after an update synced by ``full_state_dict`` ->
   ``update_weights`` (the e2e test's tolerance is 1e-2 on GPUs); ``sleep``/``wake_up`` free and restore memory.
5. ``offload_to_cpu`` / ``reload_to_device`` of the actor (``fsdp.param_offload`` / ``optimizer_offload``) free
   the GPU memory they say and the next update still runs.
6. ``--sweep``: the update alone in four micro-batch layouts (the main one, 8 rows with checkpointing, 2 and 4
   rows without), each beside a plain single-process loop on the same job in this process (the Hugging Face model,
   AdamW, bf16 autocast, the clipped loss on float32 log-probs of the full logits, and again with log-probs in
   chunks): tokens/s and peak memory, project / plain per layout.
7. ``--lora R``: the full update and then the LoRA actor at rank R (docs/lora.md) on the same job: what trains,
   speed, peak memory, the reference as the adapter switched off, and the merged weights of a sync in the HF
   engine (``--skip-main`` leaves out parts 2-5).
8. ``--gateway MODEL``: a trained model (make train's warm start) behind the gateway (docs/gateway.md) on the
   device: uvicorn on 127.0.0.1, the real ``openai`` client, the example FrozenLake agent
   (``examples/gateway/frozenlake_openai.py``) playing real episodes of make train's task at once. Checked:
   the ids and log-probs each call returned are the session's records, the sessions' rows, and the actor's
   bf16 log-probs of those rows against the engine's (the GPU e2e test's 1e-2, here on a model whose sampled
   tokens are likely, unlike the random 0.5B shape).

    python bench/gpu_check.py --out /tmp/gpu_check.json          # on a machine with a CUDA device
    python bench/gpu_check.py --sweep --out /tmp/gpu_check.json
    python bench/gpu_check.py --skip-main --lora 64 --out /tmp/gpu_lora.json
    python bench/gpu_check.py --skip-main --gateway outputs/agent_trainer/sft_frozenlake_nodeadends_seed0/final

Needs torch, transformers, safetensors, omegaconf (the config layer), for ``--lora`` peft, for ``--gateway``
fastapi, uvicorn and openai; not Ray, not vLLM. Figures go to docs/benchmarks.md ("On a GPU") and docs/lora.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent_trainer.common.batch import TensorBatch  # noqa: E402
from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig, RefConfig  # noqa: E402
from agent_trainer.workers.fsdp_base import pick_device  # noqa: E402

SHAPES = REPO / "config" / "model_shapes" / "Qwen2.5-0.5B"
DENSE_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # vendor peak, dense (no sparsity)
GIB = 2**30
RECORD: dict = {}
DEVICE = "cuda"  # --cpu: the same code on CPU over gloo with a smaller shape (to try the script without a GPU)


def on_gpu() -> bool:
    return DEVICE == "cuda"


def allocated() -> int:
    return torch.cuda.memory_allocated() if on_gpu() else 0


def reset_peak() -> None:
    if on_gpu():
        torch.cuda.reset_peak_memory_stats()


def report(part: str, **values) -> None:
    RECORD[part] = values
    print(json.dumps({part: values}), flush=True)


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), None)


def write_random_model(out: Path) -> int:
    """The 0.5B shape with random weights, saved as a Hugging Face folder (float32); returns its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(SHAPES)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    if on_gpu():
        torch.cuda.empty_cache()
    return n


def rows(B: int, T: int, prompt: int, vocab: int, seed: int) -> TensorBatch:
    """B full rows of T tokens: ``prompt`` prompt tokens, the rest generated (response_mask 1)."""
    gen = torch.Generator().manual_seed(seed)
    response = torch.zeros(B, T, dtype=torch.long)
    response[:, prompt:] = 1
    return TensorBatch({"input_ids": torch.randint(0, vocab, (B, T), generator=gen),
                        "attention_mask": torch.ones(B, T, dtype=torch.long),
                        "position_ids": torch.arange(T).expand(B, T).clone(), "response_mask": response,
                        "advantages": torch.randn(B, T, generator=gen) * response})


def flops_per_token(n_params: int, config, seq: int) -> float:
    """Training FLOPs per token (forward + backward, model FLOPs: recomputation not counted): 6N plus the
    attention score and value products, 12 * layers * hidden * seq / 2 with a causal mask."""
    return 6 * n_params + 6 * config.num_hidden_layers * config.hidden_size * seq


def synced(fn):
    if on_gpu():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if on_gpu():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def check_device() -> torch.device:
    if not on_gpu():
        report("device", name="cpu", torch=torch.__version__)
        return torch.device("cpu")
    device = pick_device("cuda")
    torch.cuda.set_device(device)  # refused for torch.device("cuda") without an index
    props = torch.cuda.get_device_properties(device)
    report("device", name=props.name, memory_gib=round(props.total_memory / GIB, 1),
           capability=f"{props.major}.{props.minor}", torch=torch.__version__, device=str(device),
           index=device.index)
    return device


def actor_update(model_dir: Path, n_params: int, args) -> object:
    from transformers import AutoConfig

    from agent_trainer.workers.actor import ActorWorker

    config = AutoConfig.from_pretrained(model_dir)
    actor_cfg = ActorConfig(ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=args.micro_rows,
                            grad_clip=1.0, optim=OptimConfig(lr=1e-6),
                            fsdp=FSDPConfig(world_size=1, mixed_precision="bf16", param_offload=on_gpu(),
                                            optimizer_offload=on_gpu()))
    ref_cfg = RefConfig(log_prob_micro_batch_size_per_gpu=args.micro_rows, dtype="bfloat16",
                        fsdp=FSDPConfig(world_size=1, mixed_precision="bf16", param_offload=on_gpu()))
    model = ModelConfig(path=str(model_dir), dtype="float32", enable_gradient_checkpointing=True)
    worker = ActorWorker(rank=0, world_size=1, model=model, actor=actor_cfg, ref=ref_cfg, device=DEVICE)
    _, load_s = synced(worker.init_model)
    reset_peak()
    report("load", seconds=round(load_s, 1), allocated_gib=round(allocated() / GIB, 2),
           reference_on_gpu_gib=round(sum(p.to_local().numel() * p.element_size() for p in worker.ref_model.parameters()
                                          if p.to_local().device.type == "cuda") / GIB, 3),
           reference_param_device=str(next(worker.ref_model.parameters()).to_local().device))

    batch = rows(args.rows, args.seq, args.prompt, config.vocab_size, seed=0)
    old, logprob_s = synced(lambda: worker.compute_log_prob(batch)["old_log_probs"])
    ref, ref_s = synced(lambda: worker.compute_ref_log_prob(batch)["ref_log_prob"])
    mask = batch["response_mask"].bool()
    report("log_probs", seconds=round(logprob_s, 2), ref_seconds=round(ref_s, 2),
           tokens_per_s=round(batch["attention_mask"].sum().item() / logprob_s),
           finite=bool(torch.isfinite(old[mask]).all()),
           actor_vs_bf16_reference_mean_abs=float((old - ref)[mask].abs().mean()))
    batch["old_log_probs"] = old

    times, metrics = [], {}
    reset_peak()
    for step in range(args.steps + 1):  # the first is the warm-up (allocator, kernels)
        metrics, seconds = synced(lambda: worker.update_actor(batch))
        if step:
            times.append(seconds)
    peak = torch.cuda.max_memory_allocated() if on_gpu() else 0
    tokens = args.rows * args.seq
    per_update = sorted(times)[len(times) // 2]
    achieved = flops_per_token(n_params, config, args.seq) * tokens / per_update / 1e12
    card = torch.cuda.get_device_name() if on_gpu() else "cpu"
    peak_tf = peak_tflops(card)
    report("actor_update", rows=args.rows, micro_rows=args.micro_rows, seq=args.seq, tokens=tokens,
           seconds_per_update=[round(t, 3) for t in times], median_s=round(per_update, 3),
           tokens_per_s=round(tokens / per_update), model_tflops=round(achieved, 1),
           mfu=round(achieved / peak_tf, 3) if peak_tf else None, peak_tflops_assumed=peak_tf,
           peak_allocated_gib=round(peak / GIB, 2), peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2) if on_gpu() else 0,
           grad_norm=metrics.get("actor/grad_norm"), pg_loss=metrics.get("actor/pg_loss"),
           all_finite=all(math.isfinite(v) for v in metrics.values()))

    before = allocated()
    worker.offload_to_cpu()
    after = allocated()
    worker.reload_to_device()
    back = allocated()
    metrics, seconds = synced(lambda: worker.update_actor(batch))
    report("offload", allocated_before_gib=round(before / GIB, 2), after_offload_gib=round(after / GIB, 2),
           after_reload_gib=round(back / GIB, 2), update_after_reload_s=round(seconds, 3),
           finite=all(math.isfinite(v) for v in metrics.values()))
    return worker


SWEEP = [(8, True), (2, False), (4, False)]  # (rows per micro-batch, gradient checkpointing) after the main case
PLAIN_CHUNK = 4096
"""Tokens per chunk of the plain loop's chunked log-probs."""


def update_speed(model_dir: Path, n_params: int, args, micro_rows: int, checkpointing: bool) -> dict:
    """The actor update alone (no reference) with another micro-batch size or checkpointing: speed and peak."""
    import gc

    from transformers import AutoConfig

    from agent_trainer.workers.actor import ActorWorker

    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()
    config = AutoConfig.from_pretrained(model_dir)
    actor_cfg = ActorConfig(ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=micro_rows, grad_clip=1.0,
                            optim=OptimConfig(lr=1e-6), fsdp=FSDPConfig(world_size=1, mixed_precision="bf16"))
    model = ModelConfig(path=str(model_dir), dtype="float32", enable_gradient_checkpointing=checkpointing)
    worker = ActorWorker(rank=0, world_size=1, model=model, actor=actor_cfg, device=DEVICE)
    worker.init_model()
    batch = rows(args.rows, args.seq, args.prompt, config.vocab_size, seed=0)
    batch["old_log_probs"] = worker.compute_log_prob(batch)["old_log_probs"]
    reset_peak()
    times = [synced(lambda: worker.update_actor(batch))[1] for _ in range(3)][1:]
    median = sorted(times)[len(times) // 2]
    tokens = args.rows * args.seq
    achieved = flops_per_token(n_params, config, args.seq) * tokens / median / 1e12
    peak_tf = peak_tflops(torch.cuda.get_device_name() if on_gpu() else "cpu")
    out = dict(micro_rows=micro_rows, micro_tokens=micro_rows * args.seq, gradient_checkpointing=checkpointing,
               seconds_per_update=[round(t, 3) for t in times], tokens_per_s=round(tokens / median),
               mfu=round(achieved / peak_tf, 3) if peak_tf else None,
               peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2) if on_gpu() else 0)
    report(f"actor_update_micro{micro_rows}_{'ckpt' if checkpointing else 'nockpt'}", **out)
    del worker
    return out


def plain_update_speed(model_dir: Path, n_params: int, args, micro_rows: int, checkpointing: bool,
                       chunked: bool) -> dict:
    """The same update as the simplest loop a user could write, in this process: the Hugging Face model on the
    device, float32 weights and AdamW (fused on a GPU), bf16 autocast on a GPU, the clipped PPO loss (token mean
    over the mini-batch) on float32 log-probs of every next token, gradient clipping at 1.0, one optimizer step.
    ``chunked``: the log-probs from the last hidden states in chunks of :data:`PLAIN_CHUNK` tokens, each chunk's
    projection and log-softmax recomputed in the backward (activation checkpointing)."""
    import gc

    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoModelForCausalLM

    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=on_gpu())
    batch = rows(args.rows, args.seq, args.prompt, model.config.vocab_size, seed=0)
    ids = batch["input_ids"].to(DEVICE)
    mask = batch["response_mask"][:, 1:].to(DEVICE).float()
    advantages = batch["advantages"][:, 1:].to(DEVICE)

    def taken(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, model.lm_head.weight).float()
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)

    def log_probs(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=on_gpu()):
            if not chunked:
                logits = model(input_ids=x).logits[:, :-1]
                return torch.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
            hidden = model.model(input_ids=x).last_hidden_state[:, :-1]
            b, t, h = hidden.shape
            flat, targets = hidden.reshape(-1, h), x[:, 1:].reshape(-1)
            parts = [checkpoint(taken, flat[i:i + PLAIN_CHUNK], targets[i:i + PLAIN_CHUNK], use_reentrant=False)
                     for i in range(0, flat.shape[0], PLAIN_CHUNK)]
            return torch.cat(parts).view(b, t)

    with torch.no_grad():
        old = torch.cat([log_probs(ids[i:i + micro_rows]) for i in range(0, args.rows, micro_rows)])
    tokens_scored = mask.sum()

    def update() -> None:
        for i in range(0, args.rows, micro_rows):
            ratio = torch.exp(log_probs(ids[i:i + micro_rows]) - old[i:i + micro_rows])
            a = advantages[i:i + micro_rows]
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
            ((loss * mask[i:i + micro_rows]).sum() / tokens_scored).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    reset_peak()
    times = [synced(update)[1] for _ in range(args.steps + 1)][1:]
    median = sorted(times)[len(times) // 2]
    tokens = args.rows * args.seq
    achieved = flops_per_token(n_params, model.config, args.seq) * tokens / median / 1e12
    peak_tf = peak_tflops(torch.cuda.get_device_name() if on_gpu() else "cpu")
    out = dict(micro_rows=micro_rows, gradient_checkpointing=checkpointing, chunked_log_probs=chunked,
               seconds_per_update=[round(t, 3) for t in times], tokens_per_s=round(tokens / median),
               mfu=round(achieved / peak_tf, 3) if peak_tf else None,
               peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2) if on_gpu() else 0)
    report(f"plain_update_micro{micro_rows}_{'ckpt' if checkpointing else 'nockpt'}_"
           f"{'chunked' if chunked else 'full'}", **out)
    del model, optimizer
    return out


def sweep_against_plain(model_dir: Path, n_params: int, args) -> None:
    """Each micro-batch layout of the sweep (the main one first): the project's update, then the plain loop with
    full and with chunked log-probs, in this process one after the other; project / plain per layout."""
    for micro_rows, checkpointing in [(args.micro_rows, True), *SWEEP]:
        ours = update_speed(model_dir, n_params, args, micro_rows, checkpointing)
        full = plain_update_speed(model_dir, n_params, args, micro_rows, checkpointing, chunked=False)
        chunked = plain_update_speed(model_dir, n_params, args, micro_rows, checkpointing, chunked=True)
        report(f"project_vs_plain_micro{micro_rows}_{'ckpt' if checkpointing else 'nockpt'}",
               project_tokens_per_s=ours["tokens_per_s"], plain_tokens_per_s=full["tokens_per_s"],
               plain_chunked_tokens_per_s=chunked["tokens_per_s"],
               project_over_plain=round(ours["tokens_per_s"] / full["tokens_per_s"], 3),
               project_over_plain_chunked=round(ours["tokens_per_s"] / chunked["tokens_per_s"], 3),
               project_peak_gib=ours["peak_allocated_gib"], plain_peak_gib=full["peak_allocated_gib"],
               plain_chunked_peak_gib=chunked["peak_allocated_gib"])


def sampled_rows(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list, TensorBatch, torch.Tensor]:
    """The engine's samples of ``prompts`` as right-padded rows (response_mask on the sampled tokens) and the
    engine's log-probs of those tokens in the same layout."""
    outs = engine.generate(prompts, max_tokens=max_tokens, temperature=1.0, seed=2)
    width = max(len(p) + len(o.token_ids) for p, o in zip(prompts, outs))
    ids, attn, resp = (torch.zeros(len(outs), width, dtype=torch.long) for _ in range(3))
    engine_lp = torch.zeros(len(outs), width)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        seq = p + o.token_ids
        ids[b, :len(seq)] = torch.tensor(seq)
        attn[b, :len(seq)] = 1
        resp[b, len(p):len(seq)] = 1
        engine_lp[b, len(p):len(seq)] = torch.tensor(o.logprobs)
    batch = TensorBatch({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                         "position_ids": torch.arange(width).expand(len(outs), width).clone()})
    return outs, batch, engine_lp


def lora_check(model_dir: Path, n_params: int, args) -> None:
    """The actor with a LoRA adapter (``actor_rollout_ref.model.lora_rank``; docs/lora.md) on the same job: what
    trains, the update's speed and peak memory, the reference as the adapter switched off, and the merged weights
    of a sync (the buckets the engines get) loaded into the HF engine, which then scores as the actor does."""
    import gc

    from transformers import AutoConfig

    from agent_trainer.workers.actor import ActorWorker
    from agent_trainer.workers.rollout import HFRolloutWorker
    from agent_trainer.workers.weight_buckets import unpack_bucket
    from agent_trainer.workers.weight_sync import iter_weight_buckets

    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()
    config = AutoConfig.from_pretrained(model_dir)
    actor_cfg = ActorConfig(ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=args.micro_rows,
                            grad_clip=1.0, optim=OptimConfig(lr=1e-4),
                            fsdp=FSDPConfig(world_size=1, mixed_precision="bf16"))
    ref_cfg = RefConfig(log_prob_micro_batch_size_per_gpu=args.micro_rows, dtype="float32",
                        fsdp=FSDPConfig(world_size=1, mixed_precision="bf16"))
    model = ModelConfig(path=str(model_dir), dtype="float32", enable_gradient_checkpointing=True,
                        lora_rank=args.lora, lora_alpha=2.0 * args.lora, target_modules=["all-linear"])
    reset_peak()
    worker = ActorWorker(rank=0, world_size=1, model=model, actor=actor_cfg, ref=ref_cfg, device=DEVICE)
    _, load_s = synced(worker.init_model)
    trained = sum(p.numel() for p in worker.model.parameters() if p.requires_grad)
    batch = rows(args.rows, args.seq, args.prompt, config.vocab_size, seed=0)
    batch["old_log_probs"] = worker.compute_log_prob(batch)["old_log_probs"]
    ref = worker.compute_ref_log_prob(batch)["ref_log_prob"]
    mask = batch["response_mask"].bool()
    start_equal = float((ref - batch["old_log_probs"])[mask].abs().max())  # lora_B starts at 0: the same model
    reset_peak()
    times = [synced(lambda: worker.update_actor(batch))[1] for _ in range(args.steps + 1)][1:]
    median = sorted(times)[len(times) // 2]
    tokens = args.rows * args.seq
    achieved = flops_per_token(n_params, config, args.seq) * tokens / median / 1e12
    peak_tf = peak_tflops(torch.cuda.get_device_name() if on_gpu() else "cpu")
    after = worker.compute_log_prob(batch)["old_log_probs"]
    ref_after = worker.compute_ref_log_prob(batch)["ref_log_prob"]
    report("lora_update", lora_rank=args.lora, trained_parameters=trained, of=n_params, load_s=round(load_s, 1),
           seconds_per_update=[round(t, 3) for t in times], tokens_per_s=round(tokens / median),
           mfu=round(achieved / peak_tf, 3) if peak_tf else None,
           peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2) if on_gpu() else 0,
           reference_equals_policy_at_start_max_abs=start_equal,
           policy_moved=float((after - batch["old_log_probs"])[mask].abs().mean()),
           reference_unchanged_max_abs=float((ref_after - ref)[mask].abs().max()))

    engine = HFRolloutWorker(str(model_dir), device=DEVICE, dtype="bfloat16", max_model_len=args.seq)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(args.seq // 32, args.seq // 8, (8,), generator=gen)]
    sent, (_, sync_s) = {}, (None, 0.0)

    def sync() -> None:
        for bucket in iter_weight_buckets(worker.model, True, 256 * 2**20, torch.bfloat16):
            names, tensors = unpack_bucket(bucket.specs, bucket.flat)
            sent.update((n, t.clone()) for n, t in zip(names, tensors))

    _, sync_s = synced(sync)
    engine.update_weights(sent)
    _, sampled, engine_lp = sampled_rows(engine, prompts, args.gen_tokens)
    where = sampled["response_mask"].bool()
    actor_lp = worker.compute_log_prob(sampled)["old_log_probs"]
    report("lora_sync", tensors=len(sent), gib=round(sum(t.numel() * t.element_size() for t in sent.values()) / GIB, 2),
           gather_s=round(sync_s, 2), engine_vs_actor_mean_abs=float((actor_lp - engine_lp)[where].abs().mean()),
           engine_vs_actor_max_abs=float((actor_lp - engine_lp)[where].abs().max()))
    del worker, engine


def hf_rollout(model_dir: Path, worker, args) -> None:
    from agent_trainer.workers.actor import ActorWorker  # noqa: F401  (worker is one)
    from agent_trainer.workers.rollout import HFRolloutWorker, tokens_per_second

    engine = HFRolloutWorker(str(model_dir), device=DEVICE, dtype="bfloat16", max_model_len=args.seq,
                             enable_sleep_mode=on_gpu(), max_batch_size=args.gen_prompts)
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(args.seq // 32, args.seq // 8, (args.gen_prompts,), generator=gen)]

    def sample():
        return engine.generate(prompts, max_tokens=args.gen_tokens, temperature=1.0, seed=0)

    sample()  # warm-up
    outs, seconds = synced(sample)
    report("hf_generate", prompts=len(prompts), max_tokens=args.gen_tokens, seconds=round(seconds, 2),
           tokens=sum(len(o.token_ids) for o in outs), tokens_per_s=round(tokens_per_second(outs, seconds)))

    def engine_vs_actor(tag: str) -> None:
        outs, batch, engine_lp = sampled_rows(engine, prompts[:8], args.gen_tokens)
        width, where = batch["input_ids"].shape[1], batch["response_mask"].bool()
        actor_lp = worker.compute_log_prob(batch)["old_log_probs"]
        diff = (actor_lp - engine_lp)[where].abs()
        extra = {}
        if tag == "before_update":  # which side is off: both against a float32 forward of the same weights
            fp32 = HFRolloutWorker(str(model_dir), device=DEVICE, dtype="float32", max_model_len=args.seq)
            seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
            exact, scored = torch.zeros(len(outs), width), torch.zeros(len(outs), width)
            for b, (lp32, lp16) in enumerate(zip(fp32.prompt_logprobs(seqs), engine.prompt_logprobs(seqs))):
                exact[b, :len(lp32)], scored[b, :len(lp16)] = torch.tensor(lp32), torch.tensor(lp16)
            del fp32
            extra = {"actor_bf16_vs_fp32": float((actor_lp - exact)[where].abs().mean()),
                     "engine_sampled_bf16_vs_fp32": float((engine_lp - exact)[where].abs().mean()),
                     "engine_full_forward_bf16_vs_fp32": float((scored - exact)[where].abs().mean()),
                     "engine_sampled_vs_its_full_forward": float((engine_lp - scored)[where].abs().mean()),
                     "mean_logprob": float(exact[where].mean())}
        report(f"engine_vs_actor_{tag}", tokens=int(where.sum()), mean_abs=float(diff.mean()),
               max_abs=float(diff.max()), within_e2e_tolerance=bool(diff.mean() < 1e-2), **extra)

    engine_vs_actor("before_update")
    batch = rows(args.rows, args.seq // 4, args.seq // 16, vocab, seed=3)
    batch["old_log_probs"] = worker.compute_log_prob(batch)["old_log_probs"]
    for _ in range(3):  # move the actor away from the engine's weights, at a learning rate that shows
        for group in worker.optimizer.param_groups:
            group["lr"] = 1e-3
        worker.update_actor(batch)
    stale = engine.prompt_logprobs([prompts[0] + [1, 2, 3]])[0]
    state, sync_s = synced(worker.full_state_dict)
    update_s = engine.update_weights({k: v.to(torch.bfloat16) for k, v in state.items()})
    fresh = engine.prompt_logprobs([prompts[0] + [1, 2, 3]])[0]
    report("weight_sync", gather_s=round(sync_s, 2), update_weights_s=round(update_s, 2), tensors=len(state),
           engine_changed=bool(max(abs(a - b) for a, b in zip(stale, fresh)) > 1e-3))
    engine_vs_actor("after_sync")

    if not on_gpu():
        return
    awake = allocated()
    engine.sleep()
    asleep = allocated()
    engine.wake_up()
    woken = allocated()
    again = engine.generate(prompts[:2], max_tokens=8, temperature=0.0)
    report("engine_sleep", awake_gib=round(awake / GIB, 2), asleep_gib=round(asleep / GIB, 2),
           woken_gib=round(woken / GIB, 2), generates_after_wake=all(len(o.token_ids) for o in again))


def engine_alone(engine, firsts: list[list[int]], asked: list[tuple]) -> dict:
    """The engine without the gateway: the episodes' first prompts one by one and batched (64 new tokens), and
    the gateway's own first 16 engine calls again from this thread and from another one (where a call's time
    goes when the gateway's calls are slower than the engine's)."""
    import threading

    one_by_one, one_s = synced(lambda: [engine.generate([p], max_tokens=64, temperature=1.0)[0] for p in firsts])
    together, all_s = synced(lambda: engine.generate(firsts, max_tokens=64, temperature=1.0))
    replay = asked[:16]

    def replayed():
        return [engine.generate(p, **{**kw, "temperature": 1.0}) for p, kw in replay]

    _, main_s = synced(replayed)
    worker_thread = threading.Thread(target=replayed)
    _, thread_s = synced(lambda: (worker_thread.start(), worker_thread.join()))
    return {"replayed_s_per_call_main_thread": round(main_s / len(replay), 3),
            "replayed_s_per_call_other_thread": round(thread_s / len(replay), 3),
            "gateway_max_tokens": sorted({kw["max_tokens"] for _, kw in asked}),
            "engine_alone_one_by_one_tokens_per_s": round(sum(len(o.token_ids) for o in one_by_one) / one_s),
            "engine_alone_one_by_one_s_per_call": round(one_s / len(firsts), 3),
            "engine_alone_batched_tokens_per_s": round(sum(len(o.token_ids) for o in together) / all_s)}


def gateway_check(model_path: str, args) -> None:
    """Part 8: make train's warm start behind the gateway on the device, the example agent playing real episodes."""
    import asyncio

    import openai
    from envs.registry import load_env_tags, make_env
    from examples.gateway import frozenlake_openai
    from transformers import AutoConfig, AutoTokenizer

    from agent_trainer.gateway.app import Gateway, create_app
    from agent_trainer.gateway.server import GatewayServer, new_api_key
    from agent_trainer.gateway.sessions import SessionStore, build_rows
    from agent_trainer.gateway.task import Task
    from agent_trainer.workers.actor import ActorWorker
    from agent_trainer.workers.rollout import HFRolloutWorker

    dtype = "bfloat16" if on_gpu() else "float32"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tag = "FrozenLakeNoDeadEnds"
    tag_cfg = load_env_tags()[tag]
    # the model's whole context, and the tag's per-turn budget on every reply (as a run's rollout caps it): five
    # turns of sampled replies fit whatever the sampler draws
    context = AutoConfig.from_pretrained(model_path).max_position_embeddings
    engine = HFRolloutWorker(model_path, device=DEVICE, dtype=dtype, max_model_len=context, seed=0)
    returned: dict[str, list] = {}  # session -> (token ids, log-probs) of each call, as the client got them

    engine_s: list[float] = []  # each engine call inside the gateway: where a call's time goes
    asked: list[tuple] = []

    def generate(prompts, **sampling):
        out, seconds = synced(lambda: engine.generate(prompts, **{**sampling, "temperature": 1.0}))
        engine_s.append(seconds)
        asked.append((prompts, sampling))
        return out

    gateway = Gateway(tokenizer=tokenizer, generate=generate, store=SessionStore(), api_key=new_api_key(),
                      model="policy", max_model_len=context, response_length=tag_cfg.max_tokens)

    class Recording(openai.AsyncOpenAI):  # the agent is unchanged; what each call returned is kept
        def __init__(self, sid: str, **kw):
            super().__init__(**kw)
            create = self.chat.completions.create

            async def kept(**request):
                out = await create(**request, logprobs=True, extra_body={"return_token_ids": True})
                returned.setdefault(sid, []).append(
                    (out.choices[0].model_extra["token_ids"], [t.logprob for t in out.choices[0].logprobs.content]))
                return out
            self.chat.completions.create = kept

    async def episode(server, http, seed: int) -> str:
        env = make_env(tag)
        sid = gateway.store.open()
        instruction = (f"{tag_cfg.env_instruction.strip()}\nValid actions: {env.action_description()}\n"
                       "Give exactly one action per turn.")
        task = Task.local(env, seed=seed, instruction=instruction, tag=tag, model="policy", max_turns=5)
        client = Recording(sid, base_url=server.base_url(sid), api_key=gateway.api_key, max_retries=0,
                           http_client=http)
        await frozenlake_openai.run(task, client)
        return sid

    async def play(server):  # one HTTP client under the episodes' openai clients, as the gateway rollout's
        async with openai.DefaultAsyncHttpxClient() as http:
            return await asyncio.gather(*(episode(server, http, 1000 + i) for i in range(args.gateway_episodes)))

    with GatewayServer(create_app(gateway)) as server:
        sids, seconds = synced(lambda: asyncio.run(play(server)))
    calls = [c for sid in sids for c in returned.get(sid, [])]
    records = {sid: gateway.store.close(sid) for sid in sids}
    exact = all([(list(r.completion_ids), list(r.logprobs)) for r in records[sid]] ==
                [(list(ids), list(lps)) for ids, lps in returned.get(sid, [])] for sid in sids)
    rows = [row for sid in sids for row in build_rows(records[sid])[0]]
    tokens = sum(len(ids) for ids, _ in calls)
    alone = engine_alone(engine, [list(records[sid][0].prompt_ids) for sid in sids if records[sid]], asked)

    actor_cfg = ActorConfig(ppo_mini_batch_size=len(rows), ppo_micro_batch_size_per_gpu=8, optim=OptimConfig(lr=1e-6),
                            fsdp=FSDPConfig(world_size=1, mixed_precision="bf16" if on_gpu() else "none"))
    worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=model_path, dtype="float32"), actor=actor_cfg,
                         device=DEVICE)
    worker.init_model()
    width = max(len(r.input_ids) for r in rows)
    ids, attn, resp, engine_lp = (torch.zeros(len(rows), width, dtype=d) for d in
                                  (torch.long, torch.long, torch.long, torch.float32))
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        ids[b, :n], attn[b, :n] = torch.tensor(row.input_ids), 1
        resp[b, :n], engine_lp[b, :n] = torch.tensor(row.response_mask), torch.tensor(row.rollout_log_probs)
    batch = TensorBatch({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                         "position_ids": torch.arange(width).expand(len(rows), width).clone()})
    where = resp.bool()
    diff = (worker.compute_log_prob(batch)["old_log_probs"] - engine_lp)[where].abs()
    report("gateway", model=args.gateway, engine_dtype=dtype, episodes=len(sids), calls=len(calls),
           sampled_tokens=tokens, seconds=round(seconds, 2), tokens_per_s=round(tokens / seconds),
           client_got_what_sessions_recorded=exact, rows=len(rows), rows_per_episode=round(len(rows) / len(sids), 2),
           trained_tokens=int(where.sum()), trained_tokens_equal_sampled=int(where.sum()) == tokens,
           engine_s_per_call_in_gateway=round(sum(engine_s) / len(engine_s), 3), **alone,
           mean_logprob=float(engine_lp[where].mean()), engine_vs_actor_mean_abs=float(diff.mean()),
           engine_vs_actor_max_abs=float(diff.max()), within_e2e_tolerance=bool(diff.mean() < 1e-2))
    del worker, engine


def main(argv: list[str] | None = None) -> int:
    global DEVICE, SHAPES
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--rows", type=int, default=16, help="rows per update (one mini-batch)")
    parser.add_argument("--micro-rows", type=int, default=4, help="rows per micro-batch (gpu_qwen0.5b_1gpu: 4)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row (max_model_len of gpu_qwen0.5b_1gpu)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per row (response_mask 0)")
    parser.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up")
    parser.add_argument("--gen-prompts", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--shape", default=str(SHAPES), help="a model folder's config.json to build at random")
    parser.add_argument("--sweep", action="store_true", help="also time other micro-batch sizes / checkpointing")
    parser.add_argument("--lora", type=int, default=0, help="also the LoRA actor at this rank (docs/lora.md)")
    parser.add_argument("--skip-main", action="store_true", help="only the --sweep, --lora and --gateway parts")
    parser.add_argument("--gateway", default="", help="also part 8 with this trained model folder")
    parser.add_argument("--gateway-episodes", type=int, default=32)
    parser.add_argument("--cpu", action="store_true", help="run on CPU over gloo (to try the script here)")
    args = parser.parse_args(argv)
    DEVICE, SHAPES = ("cpu" if args.cpu else "cuda"), Path(args.shape).resolve()
    check_device()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen2.5-0.5b-shape-random"
        n_params, seconds = synced(lambda: write_random_model(model_dir))
        report("model", shape=SHAPES.name, parameters=n_params, write_s=round(seconds, 1))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if on_gpu():
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            if not args.skip_main:
                worker = actor_update(model_dir, n_params, args)
                hf_rollout(model_dir, worker, args)
                del worker
            if args.sweep:
                sweep_against_plain(model_dir, n_params, args)
            if args.lora:  # full fine-tuning of the same job beside it, in the same run
                update_speed(model_dir, n_params, args, args.micro_rows, True)
                lora_check(model_dir, n_params, args)
            if args.gateway:
                gateway_check(str(Path(args.gateway).resolve()), args)
        finally:
            dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(RECORD, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
