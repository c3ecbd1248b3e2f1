"""The bucketed weight sync (agent_trainer/workers/weight_sync.py, agent_trainer/workers/vllm_ext.py).

Without Ray: buckets (size limit, every weight exactly once, the engine's dtype) on a plain and an FSDP2 model,
the transport choice, and the engine calls through vLLM's msgpack encoder (what its multiprocess client sends).
With Ray and vLLM (e2e): a 2-rank FSDP2 actor and a vLLM CPU engine started from other weights; after a sync by
each transport CPU can run (object_store, collective over gloo) the engine's log-probs equal the actor's, no
transfer is larger than a bucket, and an engine killed between syncs is restarted and rejoins a fresh group.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

from agent_trainer.workers.sync_transports import resolve_transport
from agent_trainer.workers.weight_buckets import ALIGN, bucket_nbytes, unpack_bucket
from agent_trainer.workers.weight_sync import SyncPlan, iter_weight_buckets, sync_tensor_names


def _model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _collect(model, keep: bool, limit: int, dtype=None) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Every bucket's size and a copy of its tensors (the generator reuses its buffer)."""
    out = []
    for bucket in iter_weight_buckets(model, keep, limit, dtype):
        names, tensors = unpack_bucket(bucket.specs, bucket.flat)
        out.append((bucket.nbytes, {n: t.clone() for n, t in zip(names, tensors)}))
    return out


def _check_buckets(model, buckets, limit: int, dtype: torch.dtype) -> None:
    reference = model.state_dict()
    seen: list[str] = []
    for nbytes, tensors in buckets:
        assert nbytes <= limit or len(tensors) == 1  # one tensor larger than the limit goes alone
        seen += list(tensors)
        for name, tensor in tensors.items():
            assert tensor.dtype == dtype
            assert torch.equal(tensor, reference[name].to(dtype))
    assert sorted(seen) == sorted(set(seen))  # exactly once
    assert sorted(seen) == sorted(sync_tensor_names(model))  # every weight (FSDP2: in unit order)
    assert "lm_head.weight" not in seen  # tied to the embeddings: the engine ties it itself
    assert "model.embed_tokens.weight" in seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buckets_respect_the_limit_and_cover_every_weight_once_in_the_engine_dtype(tiny_model_path, dtype):
    model = _model(tiny_model_path)
    assert model.config.tie_word_embeddings
    limit = 96 * 1024
    buckets = _collect(model, keep=True, limit=limit, dtype=dtype)
    assert len(buckets) > 3
    _check_buckets(model, buckets, limit, dtype)
    # the embeddings (1789 x 128 fp32 = 916 KB) are larger than the limit: alone in their bucket
    big = [t for n, t in buckets if "model.embed_tokens.weight" in t]
    assert len(big[0]) == 1
    total = sum(_aligned(t.numel() * dtype.itemsize) for _, ts in buckets for t in ts.values())
    assert sum(n for n, _ in buckets) <= total  # nothing but the tensors (and their alignment) travels


def _aligned(n: int) -> int:
    return math.ceil(n / ALIGN) * ALIGN


def test_one_bucket_when_the_limit_holds_the_model(tiny_model_path):
    model = _model(tiny_model_path)
    buckets = _collect(model, keep=True, limit=256 * 2**20)
    assert len(buckets) == 1
    _check_buckets(model, buckets, 256 * 2**20, torch.float32)
    assert buckets[0][0] < 1.01 * sum(p.numel() * 4 for p in model.parameters())  # sized to the model, not the limit


def test_fsdp2_buckets_equal_the_plain_model_and_other_ranks_get_none(tiny_model_path):
    """One FSDP2 rank (gloo, in this process): the per-unit unshard/reshard walk yields the same tensors."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from agent_trainer.workers.fsdp_base import decoder_layers as _decoder_layers

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        plain = _model(tiny_model_path)
        model = _model(tiny_model_path)
        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        limit = 64 * 1024
        buckets = _collect(model, keep=True, limit=limit, dtype=torch.bfloat16)
        _check_buckets(plain, buckets, limit, torch.bfloat16)
        assert _collect(model, keep=False, limit=limit) == []  # a non-zero rank walks the units, sends nothing
    finally:
        dist.destroy_process_group()


def test_transport_choice():
    assert resolve_transport("auto", "cpu", colocated=False) == "object_store"
    assert resolve_transport("auto", "cpu", colocated=True) == "object_store"
    assert resolve_transport("auto", "cuda", colocated=False) == "collective"
    assert resolve_transport("auto", "cuda", colocated=True) == "cuda_ipc"
    assert resolve_transport("collective", "cpu", colocated=False) == "collective"
    with pytest.raises(ValueError, match="2 engines colocated"):
        resolve_transport("auto", "cuda", colocated=True, engines=2)
    with pytest.raises(ValueError, match="cuda_ipc needs GPU engines"):
        resolve_transport("cuda_ipc", "cpu", colocated=False)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_transport("nccl", "cuda", colocated=False)


class _EncodingLLM:
    """Stands in for ``vllm.LLM``: encodes each collective_rpc as vLLM's multiprocess client does, decodes it as
    the engine core does (untyped), and records what the worker would receive."""

    def __init__(self):
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.encoder, self.decoder, self.calls = MsgpackEncoder(), MsgpackDecoder(), []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        frames = self.encoder.encode((0, 1, "collective_rpc", (method, timeout, args, kwargs)))
        _, _, _, (name, _, decoded, _) = self.decoder.decode(frames)
        self.calls.append((name, decoded))
        return [None]

    def reset_prefix_cache(self):
        pass


def test_engine_calls_encode_with_vllms_msgpack_encoder(tiny_model_path):
    """Every call the engine side makes goes by name with msgpack-safe arguments: the bucket arrives as the same
    bytes (a tensor would arrive as a list), and every name is a method of the worker extension that vLLM's
    ``Worker`` does not already have."""
    import numpy as np
    from vllm.v1.worker.gpu_worker import Worker

    from agent_trainer.workers.engines.vllm import VLLMEngine
    from agent_trainer.workers.vllm_ext import RolloutWorkerExtension

    model = _model(tiny_model_path)
    bucket = next(iter_weight_buckets(model, True, 2**30))
    engine = VLLMEngine.__new__(VLLMEngine)  # the engine's weight-sync calls without starting vLLM
    engine.llm = _EncodingLLM()
    engine._weight_names = set(bucket.names) | {"lm_head.weight"}
    engine.begin_weight_sync()
    engine.load_weight_bucket((bucket.specs, bucket.flat.numpy()))
    engine.init_weight_group("127.0.0.1", 1234, 1, 2, "gloo", "weights/1", 60.0)
    engine.receive_weight_bucket(bucket.specs)
    engine.load_weight_ipc(bucket.specs, b"handle")
    engine.finish_weight_sync()
    names = [name for name, _ in engine.llm.calls]
    assert names == ["begin_bucketed_load", "load_packed_bucket", "init_weight_group", "receive_weight_bucket",
                     "load_ipc_weight_bucket", "end_bucketed_load"]
    for name in names + ["reseed", "close_weight_group"]:
        assert callable(getattr(RolloutWorkerExtension, name))
        assert not hasattr(Worker, name), name  # a mixed-in method must not shadow vLLM's own
    specs, data = engine.llm.calls[1][1]
    assert isinstance(data, bytes) and data == bucket.flat.numpy().tobytes()
    received_names, tensors = unpack_bucket(specs, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert received_names == bucket.names and torch.equal(tensors[0], model.state_dict()[received_names[0]])
    assert bucket_nbytes(engine.llm.calls[3][1][0]) == bucket.nbytes


def test_the_trainers_share_one_sync(monkeypatch):
    """RL and SFT call their workers' sync (``Workers.sync_weights``), the one
    ``agent_trainer.workers.weight_sync.sync_weights`` with the plan the builder made of the run's config (no copy of
    the sync in either trainer)."""
    import agent_trainer.workers.weight_sync as weight_sync
    from agent_trainer.config import AgentTrainerConfig
    from agent_trainer.rollout.overlap import PolicyVersions
    from agent_trainer.sft import SFTTrainer
    from agent_trainer.training.trainer import AgentTrainer
    from agent_trainer.workers.build import Workers

    calls = []
    monkeypatch.setattr(weight_sync, "sync_weights",
                        lambda group, engines, plan, on_stats=None: calls.append((group, engines, plan)) or 1.5)
    cfg = AgentTrainerConfig()
    cfg.actor_rollout_ref.rollout.weight_sync = "collective"
    cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes = 8
    workers = Workers(actor="actor", sync_plan=weight_sync.sync_plan(cfg), engines=["engine"])
    rl = AgentTrainer.__new__(AgentTrainer)
    rl.cfg, rl.workers, rl.versions = cfg, workers, PolicyVersions(actor=3)
    rl.versions.engines = 2
    sft = SFTTrainer.__new__(SFTTrainer)
    sft.workers = workers
    assert rl.sync_weights() == 1.5 and sft.sync_weights() == 1.5
    assert rl.versions.engines == 3  # the RL sync bumps the engines' policy version to the actor's
    expected = ("actor", ["engine"], SyncPlan("collective", 8.0, False, cfg.trainer.collective_timeout_s))
    assert calls == [expected, expected]


# --------------------------------------------------------------------------- e2e: Ray, FSDP2, vLLM


def _perturbed_copy(src: str, dst) -> str:
    """The tiny model with every weight moved (the engine starts from it, so only a sync makes it equal)."""
    import shutil
    from pathlib import Path

    model = _model(src)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src_file := Path(src, name)).exists():
            shutil.copy(src_file, dst)
    return str(dst)


SEQS = [[5, 17, 300, 42, 7, 99, 1000, 3, 12, 8], [11, 12, 13, 14, 15, 16, 17, 18]]


def _engine_vs_actor(actor_wg, engine) -> float:
    """Largest |engine - actor| log-prob over fixed sequences (the check behind
    ``actor/rollout_vs_actor_logprob_diff``)."""
    import ray

    from agent_trainer.common.batch import TensorBatch

    engine_lp = ray.get(engine.prompt_logprobs.remote(SEQS))
    ids = torch.zeros(len(SEQS), max(map(len, SEQS)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(SEQS):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    batch = TensorBatch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                         "response_mask": mask})
    actor_lp = actor_wg.dp_compute("compute_log_prob", batch)["old_log_probs"]
    return max((torch.tensor(engine_lp[i][1:]) - actor_lp[i, 1: len(s)]).abs().max().item()
               for i, s in enumerate(SEQS))


@pytest.fixture(scope="module")
def stack(tiny_model_path, tmp_path_factory, ray_cluster):
    """A 2-rank FSDP2 actor on the tiny model and one vLLM CPU engine started from perturbed weights."""
    import ray

    from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig
    from agent_trainer.workers.actor import ActorWorker
    from agent_trainer.workers.rollout import VLLMRolloutWorker
    from agent_trainer.workers.worker_group import WorkerGroup

    perturbed = _perturbed_copy(tiny_model_path, tmp_path_factory.mktemp("perturbed") / "tiny")
    actor = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                        fsdp=FSDPConfig(world_size=2, num_cpus_per_rank=0.25))
    actor_wg = WorkerGroup(ActorWorker, name="ws_actor", world_size=2, num_cpus_per_rank=0.25, num_gpus_per_rank=0.0,
                           distributed=True, placement_timeout_s=120, collective_timeout_s=120,
                           init_kwargs={"model": ModelConfig(path=tiny_model_path), "actor": actor, "device": "cpu",
                                        "seed": 0})
    actor_wg.execute_all("init_model")
    engine_cls = ray.remote(num_cpus=0.25, max_restarts=2)(VLLMRolloutWorker)
    engine = engine_cls.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(
        perturbed, device="cpu", max_model_len=64, kv_cache_space_gib=0.02, seed=0)
    ray.get(engine.prompt_logprobs.remote(SEQS))
    disk = {k: v.clone() for k, v in _model(perturbed).state_dict().items()}
    yield actor_wg, engine, disk
    actor_wg.shutdown()
    ray.kill(engine)


def _reset_engine(engine, disk) -> None:
    import ray

    ray.get(engine.load_full_weights.remote(disk))


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_after_a_sync_the_engines_logprobs_equal_the_actors(stack, transport):
    from agent_trainer.workers.weight_sync import sync_weights

    actor_wg, engine, disk = stack
    _reset_engine(engine, disk)
    assert _engine_vs_actor(actor_wg, engine) > 1e-2  # the engine holds other weights
    limit_mb = 0.25
    seen: list[dict] = []
    seconds = sync_weights(actor_wg, [engine], SyncPlan(transport, limit_mb, False, 120.0), on_stats=seen.append)
    assert seconds > 0
    assert _engine_vs_actor(actor_wg, engine) < 1e-4  # float32 engine and actor agree
    stats = seen[0]
    assert stats["transport"] == transport and stats["error"] is None
    assert stats["buckets"] > 1
    assert stats["max_transfer_bytes"] <= max(limit_mb * 2**20, 1789 * 128 * 4 + ALIGN)  # a bucket, or the embedding
    model_bytes = sum(t.numel() * 4 for n, t in disk.items() if n != "lm_head.weight")
    assert model_bytes <= stats["bytes"] < model_bytes * 1.01


@pytest.mark.e2e
def test_the_collective_group_is_reused_and_a_restarted_engine_rejoins_a_fresh_one(stack):
    import ray

    from agent_trainer.workers.weight_sync import sync_weights

    actor_wg, engine, disk = stack
    plan = SyncPlan("collective", 0.25, False, 120.0)
    seen: list[dict] = []
    sync_weights(actor_wg, [engine], plan, on_stats=seen.append)
    sync_weights(actor_wg, [engine], plan, on_stats=seen.append)
    assert seen[-1]["group_setup_s"] == 0.0  # the second sync reused the group
    ray.kill(engine, no_restart=False)  # Ray restarts it from the weights on disk, without a group
    sync_weights(actor_wg, [engine], plan, on_stats=seen.append)  # found dead: waits for the restart, sends again
    assert seen[-1]["group_setup_s"] > 0.0  # a fresh group with the restarted engine
    assert _engine_vs_actor(actor_wg, engine) < 1e-4


@pytest.mark.e2e
def test_both_transports_through_vllms_multiprocess_client(stack, tiny_model_path, tmp_path_factory):
    """``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (the GPU default): every call crosses vLLM's msgpack encoder into the
    engine-core process, whose worker joins the gloo group itself."""
    import ray

    from agent_trainer.workers.rollout import VLLMRolloutWorker
    from agent_trainer.workers.weight_sync import sync_weights

    actor_wg, _, disk = stack
    perturbed = _perturbed_copy(tiny_model_path, tmp_path_factory.mktemp("perturbed_mp") / "tiny")
    engine = ray.remote(num_cpus=0.25)(VLLMRolloutWorker).options(runtime_env={"env_vars": {
        "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}).remote(
        perturbed, device="cpu", max_model_len=64, kv_cache_space_gib=0.02, seed=0)
    try:
        for transport in ("object_store", "collective"):
            _reset_engine(engine, disk)
            assert _engine_vs_actor(actor_wg, engine) > 1e-2
            sync_weights(actor_wg, [engine], SyncPlan(transport, 0.25, False, 120.0))
            assert _engine_vs_actor(actor_wg, engine) < 1e-4, transport
    finally:
        ray.kill(engine)


@pytest.fixture(scope="module")
def lora_actor(tiny_model_path, stack):
    """A 2-rank FSDP2 actor training a LoRA adapter (two updates, so the adapter is not zero), beside ``stack``."""
    from agent_trainer.common.batch import TensorBatch
    from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig
    from agent_trainer.workers.actor import ActorWorker
    from agent_trainer.workers.worker_group import WorkerGroup

    actor = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=5e-2),
                        grad_clip=1e9, fsdp=FSDPConfig(world_size=2, num_cpus_per_rank=0.25))
    model = ModelConfig(path=tiny_model_path, lora_rank=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj",
                                                                                            "down_proj"])
    group = WorkerGroup(ActorWorker, name="ws_lora_actor", world_size=2, num_cpus_per_rank=0.25, num_gpus_per_rank=0.0,
                        distributed=True, placement_timeout_s=120, collective_timeout_s=120,
                        init_kwargs={"model": model, "actor": actor, "device": "cpu", "seed": 0})
    group.execute_all("init_model")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (4, 12), generator=gen)
    response = torch.zeros(4, 12, dtype=torch.long)
    response[:, 4:] = 1
    batch = TensorBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                         "position_ids": torch.arange(12).expand(4, 12).clone(), "response_mask": response,
                         "advantages": torch.randn(4, 12, generator=gen) * response})
    group.dp_execute("update_actor", batch)
    yield group
    group.shutdown()


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_after_a_lora_sync_the_engines_logprobs_equal_the_lora_actors(stack, lora_actor, transport):
    """Merge-on-sync: the engine gets W + (alpha/r) B A under the plain names, the same tensors in number and size
    as a full sync, and then scores as the LoRA actor does (as closely as after a full sync)."""
    from agent_trainer.workers.weight_sync import sync_weights

    base_actor, engine, disk = stack
    _reset_engine(engine, disk)
    assert _engine_vs_actor(lora_actor, engine) > 1e-2
    seen: list[dict] = []
    sync_weights(lora_actor, [engine], SyncPlan(transport, 0.25, False, 120.0), on_stats=seen.append)
    assert seen[0]["error"] is None
    assert _engine_vs_actor(lora_actor, engine) < 1e-4
    assert _engine_vs_actor(base_actor, engine) > 1e-3  # the adapter is in what the engine got
    model_bytes = sum(t.numel() * 4 for n, t in disk.items() if n != "lm_head.weight")
    assert model_bytes <= seen[0]["bytes"] < model_bytes * 1.01  # the full model's tensors, no adapter's
