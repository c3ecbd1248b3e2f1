"""The GPU path's device, precision and loading, proven on CPU where they can be (2 gloo ranks stand in for GPUs).

- A rank's CUDA device always carries an index, read from the GPUs Ray assigned it (``torch.cuda.set_device``
  refuses ``torch.device("cuda")``).
- Meta-device loading (build on ``meta``, shard, ``to_empty``, rank 0 reads and broadcasts) gives the very model
  ``from_pretrained`` gives, for the actor, the colocated reference and critic, and the reward model; only rank 0
  opens a weight file.
- ``fsdp.mixed_precision=bf16`` is FSDP2's ``MixedPrecisionPolicy``: bfloat16 all-gathers (gloo runs them) and
  compute, float32 gradients, master weights and AdamW states.
- ``offload_to_cpu`` / ``reload_to_device`` leave the training unchanged (on CPU the copies are the identity; only a
  GPU moves memory).

What only a GPU exercises: NCCL, the TF32 switch, ``CPUOffloadPolicy`` (``ref.fsdp.param_offload``) and the memory
freed by the offload.
"""

from __future__ import annotations

import pytest
import torch

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import ActorConfig, CriticConfig, FSDPConfig, ModelConfig, OptimConfig, RefConfig
from agent_trainer.workers.fsdp_base import pick_device


# -- the rank's device ------------------------------------------------------------------------------------------

def test_a_cuda_rank_device_has_an_index_torch_accepts():
    """Old code returned torch.device("cuda"), which torch.cuda.set_device refuses ("Expected a torch.device with a
    specified index"). The index is the assigned GPU's position among the visible ones (Ray restricts
    CUDA_VISIBLE_DEVICES to the actor's GPUs: 0), or the id itself when every GPU is visible."""
    from torch.cuda._utils import _get_device_index

    cases = [  # (device, Ray's GPU ids, CUDA_VISIBLE_DEVICES) -> index
        (("cuda", [], None), 0),  # outside Ray
        (("cuda", ["5"], "5"), 0),  # Ray gave GPU 5 and made it the only visible one
        (("cuda", [5, 6], "5,6"), 0),  # a rank with two GPUs: the first
        (("cuda", ["2"], "0,1,2,3"), 2),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all visible
        (("cuda", ["3"], None), 3),  # nothing restricts visibility
        (("cuda:1", ["3"], "3"), 1),  # an explicit index is kept
    ]
    for args, index in cases:
        device = pick_device(*args)
        assert device == torch.device("cuda", index), args
        assert _get_device_index(device) == index
    plain = pick_device("cuda")  # this process: no Ray, so device 0, with its index
    assert plain.index is not None and _get_device_index(plain) == plain.index
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        pick_device("cuda", ["7"], "0,1")


def test_offload_keys_are_refused_by_a_cpu_worker(tiny_model_path):
    """The config checks refuse them before Ray for trainer.device=cpu; a worker that resolved to CPU refuses too."""
    from agent_trainer.workers.actor import ActorWorker

    with pytest.raises(ValueError, match="fsdp.param_offload = True"):
        ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), device="cpu",
                    actor=ActorConfig(fsdp=FSDPConfig(param_offload=True)))


# -- two gloo ranks: loading, precision, offload -----------------------------------------------------------------

def _rows(seed: int, B: int = 4, T: int = 16) -> TensorBatch:
    gen = torch.Generator().manual_seed(seed)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, 12:] = 0
    attention[3, 10:] = 0
    mask = attention.clone()
    mask[:, :6] = 0
    return TensorBatch({"input_ids": torch.randint(3, 200, (B, T), generator=gen) * attention,
                        "attention_mask": attention, "position_ids": torch.arange(T).expand(B, T).clone(),
                        "response_mask": mask, "advantages": torch.randn(B, T, generator=gen) * mask})


def _actor_config(**fsdp) -> ActorConfig:
    return ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                       optim=OptimConfig(lr=1e-3), fsdp=FSDPConfig(world_size=2, **fsdp))


def _critic_config(path: str) -> CriticConfig:
    return CriticConfig(model=ModelConfig(path=path), ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2,
                        optim=OptimConfig(lr=1e-3), fsdp=FSDPConfig(world_size=2))


def _loading_rank(rank: int, world: int, init_file: str, path: str, rm_path: str) -> dict:
    """Meta-loaded workers against the same models loaded with from_pretrained and sharded the old way."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    import agent_trainer.workers.fsdp_base as fsdp_base
    from agent_trainer.config.rewards import RewardModelConfig, RewardModelModelConfig
    from agent_trainer.workers.actor import ActorWorker, frozen, load_causal_lm
    from agent_trainer.workers.reward_model import RewardModelWorker, load_reward_model

    out = {}
    batch = _rows(seed=rank)
    worker = ActorWorker(rank=rank, world_size=world, model=ModelConfig(path=path), actor=_actor_config(),
                         device="cpu", ref=RefConfig(log_prob_micro_batch_size_per_gpu=2), critic=_critic_config(path))
    worker.init_model()
    rm = RewardModelWorker(rank=rank, world_size=world, device="cpu", reward_model=RewardModelConfig(
        enable=True, model=RewardModelModelConfig(path=rm_path), world_size=world))
    rm.init_model()
    out["files_read"] = fsdp_base.WEIGHT_FILES_READ
    out["tied"] = worker.model.lm_head.weight is worker.model.model.embed_tokens.weight
    meta = (worker.compute_log_prob(batch)["old_log_probs"], worker.compute_ref_log_prob(batch)["ref_log_prob"],
            worker.compute_values(batch)["values"], rm.compute_rm_score(batch)["rm_scores"])
    inv_freq = worker.model.model.rotary_emb.inv_freq.clone()

    # the old way: every rank from_pretrained (the whole model), then fully_shard
    old = ActorWorker(rank=rank, world_size=world, model=ModelConfig(path=path), actor=_actor_config(),
                      device="cpu", ref=RefConfig(log_prob_micro_batch_size_per_gpu=2), critic=_critic_config(path))
    old.model = old.shard_model(load_causal_lm(old.model_config))
    old.ref_model = frozen(old.shard_model(load_causal_lm(old.model_config)))
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    critic = AutoModelForTokenClassification.from_pretrained(path, config=config)
    torch.nn.init.zeros_(critic.score.weight)
    critic.config.use_cache = False
    old.critic.model = old.critic.shard_model(critic)
    old_rm = RewardModelWorker(rank=rank, world_size=world, device="cpu", reward_model=rm.config)
    old_rm.model = old_rm.shard_model(load_reward_model(rm_path))
    expected = (old.compute_log_prob(batch)["old_log_probs"], old.compute_ref_log_prob(batch)["ref_log_prob"],
                old.compute_values(batch)["values"], old_rm.compute_rm_score(batch)["rm_scores"])
    out["equal"] = [torch.equal(a, b) for a, b in zip(meta, expected)]
    out["max_diff"] = [float((a - b).abs().max()) for a, b in zip(meta, expected)]
    out["inv_freq_equal"] = torch.equal(inv_freq, old.model.model.rotary_emb.inv_freq)
    for model in (worker.model, old.model, worker.critic.model, old.critic.model):
        model.reshard()  # the root stays unsharded after a forward without backward
    out["weights_equal"] = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in
                               zip(worker.model.parameters(), old.model.parameters()))
    out["critic_weights_equal"] = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in  # values are 0 at first
                                      zip(worker.critic.model.parameters(), old.critic.model.parameters()))
    out["critic_head_zero"] = not worker.critic.model.score.weight.full_tensor().any()
    return out


def _precision_rank(rank: int, world: int, init_file: str, path: str, rm_path: str) -> dict:
    """bf16 through FSDP2's policy over gloo, a bfloat16 reference, and an offload round trip."""
    from agent_trainer.workers.actor import ActorWorker

    out = {}
    batch = _rows(seed=rank)
    fp32 = ActorWorker(rank=rank, world_size=world, model=ModelConfig(path=path), actor=_actor_config(), device="cpu",
                       ref=RefConfig(log_prob_micro_batch_size_per_gpu=2, dtype="bfloat16"))
    fp32.init_model()
    bf16 = ActorWorker(rank=rank, world_size=world, model=ModelConfig(path=path),
                       actor=_actor_config(mixed_precision="bf16"), device="cpu")
    bf16.init_model()
    seen: list[torch.dtype] = []
    layer = bf16.model.model.layers[0].mlp.down_proj
    hook = layer.register_forward_pre_hook(lambda module, args: seen.extend([module.weight.dtype, args[0].dtype]))
    out["precision_context_is_off"] = type(bf16.precision()).__name__ == "nullcontext"
    reference, mixed = fp32.compute_log_prob(batch)["old_log_probs"], bf16.compute_log_prob(batch)["old_log_probs"]
    hook.remove()
    out["compute_dtypes"] = sorted({str(d) for d in seen})
    mask = batch["response_mask"].bool()
    out["bf16_diff"] = float((mixed - reference)[mask].abs().max())
    out["ref_bf16_diff"] = float((fp32.compute_ref_log_prob(batch)["ref_log_prob"] - reference)[mask].abs().max())
    out["ref_param_dtypes"] = sorted({str(p.dtype) for p in fp32.ref_model.parameters()})
    bf16.update_actor(batch.update(TensorBatch({"old_log_probs": mixed})))
    out["master_dtypes"] = sorted({str(p.dtype) for p in bf16.model.parameters()})
    out["state_dtypes"] = sorted({str(s.dtype) for state in bf16.optimizer.state.values() for k, s in state.items()
                                  if torch.is_tensor(s) and k != "step"})

    # offload round trip between two updates: the same weights as without it
    twin = ActorWorker(rank=rank, world_size=world, model=ModelConfig(path=path),
                       actor=_actor_config(mixed_precision="bf16"), device="cpu")
    twin.init_model()
    twin.update_actor(batch.update(TensorBatch({"old_log_probs": mixed})))
    params_before = [p for p in bf16.model.parameters()]
    bf16.fsdp_config.param_offload = bf16.fsdp_config.optimizer_offload = True  # a CPU worker refuses them at init
    bf16.offload_to_cpu()
    bf16.reload_to_device()
    out["same_parameter_objects"] = all(a is b for a, b in zip(params_before, bf16.model.parameters()))
    second = _rows(seed=10 + rank)
    for worker in (bf16, twin):
        worker.update_actor(second.update(worker.compute_log_prob(second)))
    out["offload_round_trip_equal"] = all(torch.equal(a.to_local(), b.to_local())
                                          for a, b in zip(bf16.model.parameters(), twin.model.parameters()))
    return out


def _run_rank(rank: int, world: int, init_file: str, path: str, rm_path: str, body: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results[rank] = globals()[body](rank, world, init_file, path, rm_path)
    finally:
        dist.destroy_process_group()


def _ranks(body: str, path: str, rm_path: str, tmp_path, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_run_rank, args=(r, world, str(tmp_path / "pg"), path, rm_path, body, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [results[r] for r in range(world)]


@pytest.fixture(scope="module")
def rm_path(tiny_model_path, tmp_path_factory) -> str:
    from launch.build_tiny_model import build_reward_model

    return str(build_reward_model(tiny_model_path, tmp_path_factory.mktemp("rm") / "rm"))


@pytest.mark.parametrize("world", [2, 1])
def test_meta_device_loading_gives_the_from_pretrained_model_and_only_rank_0_reads(tiny_model_path, rm_path,
                                                                                    tmp_path, world):
    """Actor, colocated reference and critic, and the reward model built on the meta device and filled from rank 0's
    read give bit for bit the log-probs, values and scores of from_pretrained models sharded the old way; the rotary
    inv_freq (in no checkpoint) is recomputed, the tied head stays tied, and rank 1 opens no weight file. One rank
    (a one-GPU run still has a process group) too."""
    results = _ranks("_loading_rank", tiny_model_path, rm_path, tmp_path, world)
    # rank 0 read the policy's file three times (actor, reference, critic) and the reward model's once
    assert [r["files_read"] for r in results] == [4, 0][:world]
    for r in results:
        assert r["equal"] == [True, True, True, True], r["max_diff"]
        assert r["inv_freq_equal"] and r["tied"] and r["weights_equal"]
        assert r["critic_weights_equal"] and r["critic_head_zero"]


def test_bf16_is_fsdp2_mixed_precision_with_float32_master_weights(tiny_model_path, rm_path, tmp_path):
    """fsdp.mixed_precision=bf16 under a process group: the units all-gather bfloat16 parameters over gloo and compute
    in bfloat16 (no autocast), log-probs move by bf16 rounding only, while master weights and AdamW states stay
    float32; a bfloat16 reference (ref.dtype) keeps bfloat16 shards; an offload round trip changes nothing."""
    for r in _ranks("_precision_rank", tiny_model_path, rm_path, tmp_path):
        assert r["precision_context_is_off"]
        assert r["compute_dtypes"] == ["torch.bfloat16"]
        assert 0 < r["bf16_diff"] < 0.1 and 0 < r["ref_bf16_diff"] < 0.1
        assert r["ref_param_dtypes"] == ["torch.bfloat16"]
        assert r["master_dtypes"] == ["torch.float32"] and r["state_dtypes"] == ["torch.float32"]
        assert r["same_parameter_objects"] and r["offload_round_trip_equal"]


# -- the config's precision and offload rules (before Ray) ----------------------------------------------------

REFUSED = [  # overrides, what the one line must name
    (["actor_rollout_ref.model.dtype=bfloat16"], "actor_rollout_ref.actor.allow_low_precision_master=true"),
    (["actor_rollout_ref.model.dtype=float16", "actor_rollout_ref.actor.allow_low_precision_master=true"],
     "actor_rollout_ref.model.dtype = 'float16'"),
    (["critic.model.dtype=bfloat16"], "critic.allow_low_precision_master=true"),
    (["critic.model.dtype=float16"], "critic.model.dtype = 'float16'"),
    (["actor_rollout_ref.actor.fsdp.param_offload=true", "trainer.device=cpu"],
     "actor_rollout_ref.actor.fsdp.param_offload = True"),
    (["actor_rollout_ref.actor.fsdp.optimizer_offload=true", "trainer.device=cpu"],
     "actor_rollout_ref.actor.fsdp.optimizer_offload = True"),
    (["actor_rollout_ref.ref.fsdp.param_offload=true", "trainer.device=cpu"],
     "actor_rollout_ref.ref.fsdp.param_offload = True"),
    (["actor_rollout_ref.ref.fsdp.optimizer_offload=true"], "the reference has no optimizer"),
    (["actor_rollout_ref.ref.dtype=bf16"], "actor_rollout_ref.ref.dtype = 'bf16'"),
    (["critic.fsdp.param_offload=true"], "critic.colocate=false"),  # a colocated critic follows the actor's keys
]


@pytest.mark.parametrize("overrides, named", REFUSED, ids=[o[0].split("=")[0] + f"-{i}" for i, (o, _) in
                                                            enumerate(REFUSED)])
def test_precision_and_offload_mistakes_are_refused_in_one_line(overrides, named, tiny_model_path):
    """bfloat16 master weights with an optimizer (old code trained them silently), float16 training, offload keys
    with nothing to offload to: each refused before Ray in one line that names the key and the fix."""
    from agent_trainer.checks.prepare import compose_and_prepare

    with pytest.raises(SystemExit) as refused:
        compose_and_prepare([*overrides, f"model_path={tiny_model_path}"])
    line = refused.value.code
    assert isinstance(line, str) and "\n" not in line and named in line, line


def test_low_precision_master_weights_and_gpu_offload_pass_when_asked_for(tiny_model_path):
    from agent_trainer.checks.prepare import compose_and_prepare

    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "actor_rollout_ref.model.dtype=bfloat16",
                                  "actor_rollout_ref.actor.allow_low_precision_master=true",
                                  "critic.model.dtype=bfloat16", "critic.allow_low_precision_master=true",
                                  "actor_rollout_ref.ref.dtype=bfloat16", "actor_rollout_ref.actor.use_kl_loss=true",
                                  "actor_rollout_ref.ref.fsdp.param_offload=true",  # colocated: its own key
                                  "actor_rollout_ref.actor.fsdp.param_offload=true",
                                  "actor_rollout_ref.actor.fsdp.optimizer_offload=true", "trainer.device=cuda"])
    assert cfg.actor_rollout_ref.ref.fsdp.param_offload and cfg.actor_rollout_ref.ref.colocate
