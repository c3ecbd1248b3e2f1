"""The per-GPU memory plan (agent_trainer/checks/memory_plan.py; its command line agent_trainer/plan.py;
docs/cluster.md): shard bytes from a real FSDP2 sharding on the meta device, the shipped recipes fit their GPUs with a
10% margin, an oversized run is refused before Ray starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from agent_trainer.checks import memory_plan as plan
from agent_trainer import plan as plan_cli

REPO = Path(__file__).resolve().parents[2]
SHAPES = REPO / "config" / "model_shapes"
QWEN_05B, QWEN_7B = str(SHAPES / "Qwen2.5-0.5B"), str(SHAPES / "Qwen2.5-7B")
GIB = 1024 ** 3


def local_shard_numel(path: str, role: str, world_size: int, rank: int) -> int:
    """Rank ``rank``'s local elements after fully_shard (each layer, then the root) under a fake process group."""
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig

    model = plan.build_meta_model(AutoConfig.from_pretrained(path), role)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert all(p.device.type == "meta" for p in model.parameters())
        return sum(p.to_local().numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path,role,world", [(QWEN_05B, "causal", 1), (QWEN_05B, "causal", 3),
                                             (QWEN_05B, "value", 8), (QWEN_7B, "causal", 8)])
def test_shard_bytes_equal_a_meta_device_sharding_and_a_hand_count(path, role, world):
    count = plan.shard_count(path, role, world)
    assert count.method == "meta fully_shard"
    # every rank's local shard, sharded again here: rank 0 holds the largest (FSDP2 pads the others to it)
    ranks = {0, world - 1}
    local = {r: local_shard_numel(path, role, world, r) for r in ranks}
    assert count.per_rank == local[0] == max(local.values())
    # by hand: parameters / world size, plus at most one padding row per parameter
    from transformers import AutoConfig

    model = plan.build_meta_model(AutoConfig.from_pretrained(path), role)
    rows = sum(p.numel() // p.shape[0] for p in model.parameters())
    assert count.total == sum(p.numel() for p in model.parameters())
    assert count.total / world <= count.per_rank <= count.total / world + rows
    assert count.per_rank == plan.hand_count(model, world)
    if world == 1:
        assert count.per_rank == count.total


def test_known_parameter_counts():
    assert plan.shard_count(QWEN_05B, "causal", 1).total == 494_032_768  # Qwen2.5-0.5B: 0.49B, tied embeddings
    assert plan.shard_count(QWEN_7B, "causal", 1).total == 7_615_616_512  # Qwen2.5-7B: 7.61B


def load(config_name: str, *overrides: str, memory: float = 80, nodes: int = 1, gpus_per_node: int = 8):
    cfg, args = plan_cli.load(["--config-name", config_name, *overrides, "--gpu-memory-gib", str(memory)])
    return cfg, plan.build_plan(cfg, args.gpu_memory_gib, gpus_per_node, nodes)


def test_plan_rows_are_the_shard_times_the_dtype_bytes():
    cfg, p = load("gpu_qwen7b_2node", f"model_path={QWEN_7B}", nodes=2)
    actor = p.kinds[0]
    rows = {line.what: line.bytes.get("train", 0) for line in actor.lines}
    shard = plan.shard_count(QWEN_7B, "causal", 8).per_rank
    assert rows["actor parameters (master)"] == shard * 4  # float32 master weights
    assert rows["actor gradients"] == shard * 4
    assert rows["actor optimizer (AdamW m, v)"] == 2 * shard * 4
    critic = plan.shard_count(QWEN_7B, "value", 8).per_rank
    assert rows["critic parameters + gradients"] == 2 * critic * 4
    engine = p.kinds[1]
    assert engine.count == 8 and engine.lines[0].bytes["rollout"] == 7_615_616_512 * 2 // 2  # bf16 / TP 2


# margin: every GPU's peak at most 90% of its memory (plan.MARGIN), the rest for fragmentation and what the plan
# does not count
@pytest.mark.parametrize("config_name,model,extra,nodes,gpus", [
    ("gpu_qwen0.5b_1gpu", QWEN_05B, (), 1, 1),
    ("gpu_qwen0.5b_1gpu", QWEN_05B, ("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"), 1, 1),
    ("gpu_qwen7b_8gpu", QWEN_7B, (), 1, 8),
    ("gpu_qwen7b_2node", QWEN_7B, (), 2, 8),
])
def test_recipes_fit_with_margin(config_name, model, extra, nodes, gpus):
    cfg, p = load(config_name, f"model_path={model}", *extra, nodes=nodes, gpus_per_node=gpus)
    assert p.fits(), plan.render(p)
    kind, phase, peak = p.worst()
    assert peak <= 0.9 * 80 * GIB
    assert p.gpus_needed <= nodes * gpus
    if "grpo" in " ".join(extra):
        assert any(line.what == "reference parameters" for line in kind.lines)
        assert not any(line.what.startswith("critic") for line in kind.lines)


def test_hybrid_peak_is_the_largest_phase_and_offload_empties_the_rollout_phase():
    _, on = load("gpu_qwen7b_8gpu", f"model_path={QWEN_7B}")
    _, off = load("gpu_qwen7b_8gpu", f"model_path={QWEN_7B}", "actor_rollout_ref.actor.fsdp.param_offload=false",
                  "actor_rollout_ref.actor.fsdp.optimizer_offload=false")
    gpu_on, gpu_off = on.kinds[0], off.kinds[0]
    assert gpu_on.phases == ["rollout", "sync", "train"]
    assert gpu_on.peak()[1] == max(gpu_on.total(ph) for ph in gpu_on.phases)
    assert gpu_off.total("rollout") > gpu_on.total("rollout")
    assert gpu_off.total("train") == gpu_on.total("train")  # offload only moves state out while the engine generates


def test_gradient_checkpointing_and_micro_batch_shrink_activations():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(QWEN_7B)
    full = plan.activation_bytes(config, 4096, 2, False, "causal")
    ckpt = plan.activation_bytes(config, 4096, 2, True, "causal")
    h, i, kv, layers = 3584, 18944, 4 * 128, 28
    per_layer = 2 * (8 * h + 4 * kv + 4 * i) + 8 * h
    assert full["layers"] == layers * per_layer * 4096
    assert ckpt["layers"] == (layers * 2 * h + per_layer) * 4096
    chunk = 2 ** 26 // 152064  # 441 positions: the chunked output head holds one chunk of logits
    assert full["logits"] == ckpt["logits"] == chunk * 152064 * 14
    assert plan.activation_bytes(config, 100, 2, True, "causal")["logits"] == 100 * 152064 * 14  # under one chunk
    capped = AutoConfig.from_pretrained(QWEN_7B)
    capped.final_logit_softcapping = 30.0  # as Gemma's: logits changed after the head, kept whole
    assert plan.activation_bytes(capped, 4096, 2, True, "causal")["logits"] == 4096 * 152064 * 14
    assert plan.activation_bytes(config, 2048, 2, True, "causal")["layers"] * 2 == ckpt["layers"]
    assert "logits" not in plan.activation_bytes(config, 4096, 2, True, "value")
    assert plan.kv_bytes_per_token(config, 2) == 2 * 28 * 4 * 128 * 2


def test_oversized_plan_is_refused_in_one_line_naming_a_knob():
    from agent_trainer.checks.prepare import compose_and_prepare

    with pytest.raises(SystemExit) as err:  # Qwen2.5-7B on one 24 GB GPU
        compose_and_prepare([f"model_path={QWEN_7B}", "actor_rollout_ref.actor.fsdp.world_size=1",
                             "trainer.gpu_memory_gib=24"], "frozenlake")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("agent-trainer: trainer.gpu_memory_gib = 24:")
    assert "enable_gradient_checkpointing=true" in message and "fsdp.world_size" in message


def test_a_plan_over_memory_names_offload_for_the_rollout_phase():
    from agent_trainer.checks.prepare import compose_and_prepare

    with pytest.raises(SystemExit) as err:  # the 8-GPU recipe without offload, engines at 70% of 48 GB
        compose_and_prepare([f"model_path={QWEN_7B}", "trainer.gpu_memory_gib=48",
                             "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
                             "actor_rollout_ref.actor.fsdp.param_offload=false",
                             "actor_rollout_ref.actor.fsdp.optimizer_offload=false"], "gpu_qwen7b_8gpu")
    assert "rollout phase" in str(err.value) and "optimizer_offload=true" in str(err.value)


def test_gpu_memory_gib_unset_or_fitting_passes_and_is_refused_on_cpu():
    from agent_trainer.checks.prepare import compose_and_prepare

    cfg, _ = compose_and_prepare([f"model_path={QWEN_05B}"], "gpu_qwen0.5b_1gpu")
    assert cfg.trainer.gpu_memory_gib == 80
    cfg, _ = compose_and_prepare([f"model_path={QWEN_7B}", "actor_rollout_ref.actor.fsdp.world_size=1"], "frozenlake")
    assert cfg.trainer.gpu_memory_gib is None  # no plan, no refusal
    with pytest.raises(SystemExit, match="trainer.device = 'cpu'"):
        compose_and_prepare([f"model_path={QWEN_05B}", "trainer.device=cpu"], "gpu_qwen0.5b_1gpu")


def test_cli_prints_the_table_and_exits_by_the_verdict(capsys):
    assert plan_cli.cli(["--config-name", "gpu_qwen0.5b_1gpu", f"model_path={QWEN_05B}", "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "actor parameters (master)" in out and "engine (awake: weights + KV cache)" in out
    assert "verdict: FITS" in out
    # the config's own gpu_memory_gib would refuse 24 GB; the plan still prints, and exits 1
    assert plan_cli.cli(["--config-name", "frozenlake", f"model_path={QWEN_7B}",
                     "actor_rollout_ref.actor.fsdp.world_size=1", "trainer.gpu_memory_gib=24"]) == 1
    assert "verdict: DOES NOT FIT" in capsys.readouterr().out
    assert not dist.is_initialized()  # the fake process group is gone again
    assert math.isclose(plan.MARGIN, 0.10)


def test_hand_count_when_a_process_group_exists(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    plan.shard_count.cache_clear()
    try:
        count = plan.shard_count(QWEN_05B, "causal", 3)
    finally:
        plan.shard_count.cache_clear()
        monkeypatch.undo()
    assert count.method == "hand count"
    assert count.per_rank == local_shard_numel(QWEN_05B, "causal", 3, 0)
    assert torch.distributed.is_available()


@pytest.mark.parametrize("config_name,overrides,knob", [
    # the engine never sleeps under hybrid_engine: it holds its share through the update
    ("gpu_qwen0.5b_1gpu", ["actor_rollout_ref.rollout.enable_sleep_mode=false", "trainer.gpu_memory_gib=40",
                           "actor_rollout_ref.rollout.gpu_memory_utilization=0.7"], "enable_sleep_mode=null"),
    # checkpointing is on already: the micro-batch is what is left to turn
    ("gpu_qwen0.5b_1gpu", ["micro_batch_size_per_gpu=16", "trainer.gpu_memory_gib=60"],
     "lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (now 16)"),
])
def test_the_refusal_names_the_knob_for_what_dominates(config_name, overrides, knob):
    from agent_trainer.checks.prepare import compose_and_prepare

    model = QWEN_05B if "0.5b" in config_name else QWEN_7B
    with pytest.raises(SystemExit) as err:
        compose_and_prepare([f"model_path={model}", *overrides], config_name)
    assert knob in str(err.value) and "\n" not in str(err.value)
