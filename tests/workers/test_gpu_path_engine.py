"""The GPU path of the rollout engines, proven without a GPU: what the engine sends through vLLM's multiprocess
client, the engine arguments and placement for a device the caller names (never this process's CUDA visibility),
tensor parallelism, colocation and the sleep/wake order. Pure functions and fakes: no Ray, no engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from agent_trainer.training.colocation import ColocatedMemory
from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.workers import build
from agent_trainer.workers.build import (Demand, check_device, check_placement, engine_env_vars, engine_gpus,
                                         resolve_device, resource_demands, sleep_mode_on)
from agent_trainer.workers.rollout import CPU_ENGINE_ENV, HFRolloutWorker, VLLMRolloutWorker, engine_args
from agent_trainer.workers.worker_group import PlacementError, bundle_resources

ENGINE = dict(dtype="float32", max_model_len=512, seed=0, kv_cache_space_gib=0.125)


def cfg_of(model_path, *overrides: str):
    return compose_and_prepare([f"model_path={model_path}", *overrides])[0]


# --------------------------------------------------------------------------- calls through vLLM's encoder


class RecordingLLM:
    """Stands in for ``vllm.LLM``: records the engine calls the rollout worker makes."""

    def __init__(self):
        self.rpcs: list[tuple] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, timeout, args, kwargs))
        return [None]

    def generate(self, *args, **kwargs):
        return []

    def reset_prefix_cache(self):
        return True


def recording_worker() -> VLLMRolloutWorker:
    worker = object.__new__(VLLMRolloutWorker)  # no engine: only the calls matter
    worker.llm, worker.max_model_len, worker._weight_names, worker._tied = RecordingLLM(), 512, None, False
    return worker


def test_every_engine_call_survives_vllms_multiprocess_encoder():
    """The exact calls the worker makes, encoded as vLLM's core client encodes a utility call
    (``call_utility("collective_rpc", method, timeout, args, kwargs)`` -> ``(0, call_id, method, args)``
    through ``MsgpackEncoder``). Python functions (the old ``_seed_worker`` / ``_reload_worker_weights``) raise
    ``TypeError: Object of type <class 'function'> is not serializable``; method names go through."""
    from vllm.v1.serial_utils import MsgpackEncoder

    from agent_trainer.workers.vllm_ext import RolloutWorkerExtension

    worker = recording_worker()
    worker.generate([[1, 2, 3]], max_tokens=2, seed=7)
    worker.update_weights({"model.embed_tokens.weight": torch.randn(8, 4), "lm_head.weight": torch.randn(8, 4)})
    assert worker.llm.rpcs, "the worker made no engine call"
    encoder = MsgpackEncoder()
    for call_id, (method, timeout, args, kwargs) in enumerate(worker.llm.rpcs):
        assert isinstance(method, str) and callable(getattr(RolloutWorkerExtension, method)), method
        encoder.encode((0, call_id, "collective_rpc", (method, timeout, args, kwargs)))  # raises on a function
    assert [rpc[0] for rpc in worker.llm.rpcs][0] == "reseed"


def test_engines_are_created_with_the_extension_class():
    from agent_trainer.workers.vllm_ext import EXTENSION

    for device in ("cpu", "cuda"):
        assert engine_args("m", device=device, **ENGINE)["worker_extension_cls"] == EXTENSION


# --------------------------------------------------------------------------- the device is the caller's


def test_engine_args_follow_the_device_argument_not_cuda_visibility(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a driver or actor that happens to see a GPU
    cpu = engine_args("m", device="cpu", **ENGINE)
    assert cpu["kv_cache_memory_bytes"] == int(0.125 * 2**30) and cpu["enforce_eager"]
    assert "gpu_memory_utilization" not in cpu and "enable_sleep_mode" not in cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # an actor whose CUDA is not visible (yet)
    gpu = engine_args("m", device="cuda", enable_sleep_mode=True, **ENGINE)
    assert gpu["gpu_memory_utilization"] == 0.5 and gpu["enable_sleep_mode"] is True and not gpu["enforce_eager"]
    assert "kv_cache_memory_bytes" not in gpu and "distributed_executor_backend" not in gpu


def test_hf_engine_runs_on_the_device_it_is_given(tiny_model_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    worker = HFRolloutWorker(tiny_model_path, device="cpu", max_model_len=64)
    assert worker.device.type == "cpu" and next(worker.model.parameters()).device.type == "cpu"


def test_sleep_mode_and_unknown_devices_are_refused_on_cpu():
    with pytest.raises(ValueError, match="enable_sleep_mode needs a GPU"):
        engine_args("m", device="cpu", enable_sleep_mode=True, **ENGINE)
    with pytest.raises(ValueError, match="must be one of"):
        engine_args("m", device="auto", **ENGINE)


def test_importing_the_rollout_module_sets_no_engine_environment():
    """The CPU engine's environment comes with the engine group (env_vars), not from an import that checks
    whether this process sees CUDA."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_ENGINE_ENV}
    out = subprocess.run([sys.executable, "-c", "import os, agent_trainer.workers.rollout; "
                          "print(os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING'))"],
                         capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "None"


def test_cpu_engines_get_the_cpu_environment_and_gpu_engines_vllms_defaults(tiny_model_path, monkeypatch):
    cfg = cfg_of(tiny_model_path)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert engine_env_vars(cfg, "cpu") == {"OMP_NUM_THREADS": "1", **CPU_ENGINE_ENV}
    assert engine_env_vars(cfg, "cuda") == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the driver's choice wins (the multiprocess e2e)
    assert engine_env_vars(cfg, "cpu")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_auto_device_comes_from_the_cluster(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU-less head node
    assert resolve_device("auto", {"CPU": 16.0, "GPU": 8.0}) == "cuda"
    assert resolve_device("auto", {"CPU": 16.0}) == "cpu"
    assert resolve_device("cuda", {"CPU": 16.0}) == "cuda"


def test_cuda_is_not_refused_by_the_driver_but_by_a_cluster_without_gpus(tiny_model_path, monkeypatch):
    """`ray job submit` to a GPU cluster runs the entrypoint on a head node that may have no GPU: the config check
    must let trainer.device=cuda through, and the cluster check refuse it only when the cluster has no GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = cfg_of(tiny_model_path, "trainer.device=cuda")  # refused here before
    check_device(cfg, "cuda", {"CPU": 8.0, "GPU": 4.0})
    with pytest.raises(PlacementError, match=r"^trainer.device = 'cuda' but the Ray cluster has no GPUs") as err:
        check_device(cfg, "cuda", {"CPU": 8.0})
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_engines_run_vllms_mp_executor_in_one_bundle(tiny_model_path):
    args = engine_args("m", device="cuda", tensor_parallel_size=2, **ENGINE)
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "mp"
    with pytest.raises(ValueError, match="tensor_parallel_size = 2"):
        engine_args("m", device="cpu", tensor_parallel_size=2, **ENGINE)
    cfg = cfg_of(tiny_model_path, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                 "actor_rollout_ref.rollout.num_workers=2", "actor_rollout_ref.actor.fsdp.world_size=2")
    rollout = next(d for d in resource_demands(cfg, "cuda") if d.what == "rollout")
    assert (rollout.count, rollout.gpus) == (2, 2.0)  # one bundle of 2 GPUs per engine
    assert engine_gpus(cfg, "cuda", colocated=False) == 2.0
    check_placement(resource_demands(cfg, "cuda"), {"CPU": 16.0, "GPU": 6.0})  # 2 actor + 2 x 2 engine GPUs
    with pytest.raises(PlacementError, match="need 6 GPU"):
        check_placement(resource_demands(cfg, "cuda"), {"CPU": 16.0, "GPU": 4.0})


def test_tensor_parallel_is_refused_on_cpu_and_checked_against_the_cluster_otherwise(tiny_model_path):
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    with pytest.raises(SystemExit, match=r"tensor_model_parallel_size = 2 splits the engine over GPUs, and "
                                         r"trainer.device = 'cpu'"):
        cfg_of(tiny_model_path, tp, "trainer.device=cpu")
    cfg = cfg_of(tiny_model_path, tp)  # trainer.device=auto: accepted here, decided by the cluster
    with pytest.raises(PlacementError, match="tensor_model_parallel_size = 2 splits the engine over GPUs, and the "
                                             "Ray cluster has none"):
        check_device(cfg, resolve_device("auto", {"CPU": 8.0}), {"CPU": 8.0})
    check_device(cfg, resolve_device("auto", {"CPU": 8.0, "GPU": 3.0}), {"CPU": 8.0, "GPU": 3.0})


# --------------------------------------------------------------------------- colocation


def test_hybrid_engine_places_the_engines_in_the_actor_bundles(tiny_model_path):
    cfg = cfg_of(tiny_model_path, "actor_rollout_ref.hybrid_engine=true", "actor_rollout_ref.actor.fsdp.world_size=1",
                 "actor_rollout_ref.ref.colocate=true")
    demands = resource_demands(cfg, "cuda")
    assert [d.what for d in demands if not d.what.startswith("env_")] == ["actor+rollout"]
    assert demands[0] == Demand("actor+rollout", 1, 0.25 + 0.5, 1.0)
    check_placement(demands, {"CPU": 4.0, "GPU": 1.0})  # one GPU is enough
    assert engine_gpus(cfg, "cuda", colocated=True) == 0.5
    assert bundle_resources(0.25, 0.5, {"CPU": 0.5, "GPU": 0.5}) == {"CPU": 0.75, "GPU": 1.0}
    assert bundle_resources(0.25, 0.0, {"CPU": 0.5, "GPU": 0.0}) == {"CPU": 0.75}
    assert sleep_mode_on(cfg, "cuda") and not sleep_mode_on(cfg, "cpu")
    assert not sleep_mode_on(cfg_of(tiny_model_path), "cuda")  # separate engines keep their GPUs awake


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.hybrid_engine=true", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
      "trainer.device=cuda"], "tensor_model_parallel_size = 2; set it to 1"),
    (["actor_rollout_ref.hybrid_engine=true", "actor_rollout_ref.rollout.num_workers=3"],
     "num_workers = 3 is more than actor_rollout_ref.actor.fsdp.world_size = 2"),
    (["actor_rollout_ref.rollout.enable_sleep_mode=true", "trainer.device=cpu"],
     "enable_sleep_mode = true needs GPU engines"),
    (["actor_rollout_ref.rollout.enable_sleep_mode=true", "trainer.device=cuda", "trainer.max_off_policy_steps=1",
      "algorithm.rollout_correction.rollout_is=token"], "trainer.max_off_policy_steps = 1"),
    (["actor_rollout_ref.hybrid_engine=true", "trainer.device=cuda", "trainer.max_off_policy_steps=1",
      "algorithm.rollout_correction.rollout_is=token"], "cannot overlap"),
])
def test_colocation_and_sleep_mode_refusals_are_one_line(tiny_model_path, overrides, message):
    with pytest.raises(SystemExit, match=message) as err:  # the command line's one-line refusal
        cfg_of(tiny_model_path, *overrides)
    assert "\n" not in str(err.value)


def test_sleep_mode_on_a_cluster_without_gpus_is_refused_once_joined(tiny_model_path):
    cfg = cfg_of(tiny_model_path, "actor_rollout_ref.rollout.enable_sleep_mode=true")  # trainer.device=auto
    with pytest.raises(PlacementError, match="enable_sleep_mode = true needs GPU engines"):
        check_device(cfg, "cpu", {"CPU": 8.0})
    check_device(cfg, "cuda", {"CPU": 8.0, "GPU": 2.0})
    hybrid_overlap = cfg_of(tiny_model_path, "actor_rollout_ref.hybrid_engine=true", "trainer.max_off_policy_steps=1",
                            "algorithm.rollout_correction.rollout_is=token")
    check_device(hybrid_overlap, "cpu", {"CPU": 8.0})  # no sleep mode on CPU: nothing to refuse
    with pytest.raises(PlacementError, match="max_off_policy_steps = 1"):
        check_device(hybrid_overlap, "cuda", {"CPU": 8.0, "GPU": 2.0})


# --------------------------------------------------------------------------- the sleep/wake order


class Log:
    """Calls of fake engines and a fake actor group, in order."""

    def __init__(self):
        self.calls: list[str] = []


class FakeMethod:
    def __init__(self, log: Log, name: str):
        self.log, self.name = log, name

    def remote(self, *args):
        self.log.calls.append(f"{self.name}{list(args)}")
        return None


class FakeEngine:
    def __init__(self, log: Log, i: int):
        self.sleep = FakeMethod(log, f"engine{i}.sleep")
        self.wake_up = FakeMethod(log, f"engine{i}.wake_up")


class FakeActor:
    def __init__(self, log: Log):
        self.log = log

    def execute_all(self, method: str):
        self.log.calls.append(f"actor.{method}")


@pytest.fixture
def fake_ray_get(monkeypatch):
    import agent_trainer.training.colocation as colocation

    monkeypatch.setattr(colocation.ray, "get", lambda refs: refs)


def test_one_colocated_step_sleeps_wakes_and_offloads_in_order(fake_ray_get):
    log = Log()
    memory = ColocatedMemory([FakeEngine(log, 0), FakeEngine(log, 1)], FakeActor(log), sleep=True, offload=True)
    memory.to_rollout(lambda: log.calls.append("sync"))  # init: engines awake, first sync, actor offloaded
    assert log.calls == ["sync", "actor.offload_to_cpu"]
    log.calls.clear()
    memory.to_training()  # after the rollout
    memory.to_training()  # idempotent
    memory.to_rollout(lambda: log.calls.append("sync"))  # the step's sync
    assert log.calls == ["engine0.sleep[1]", "engine1.sleep[1]", "actor.reload_to_device",
                         "engine0.wake_up[['weights']]", "engine1.wake_up[['weights']]", "sync",
                         "actor.offload_to_cpu", "engine0.wake_up[['kv_cache']]", "engine1.wake_up[['kv_cache']]"]
    log.calls.clear()
    with memory.training():  # a checkpoint: the actor's state on its device, engines asleep, then back
        log.calls.append("save")
    assert log.calls == ["engine0.sleep[1]", "engine1.sleep[1]", "actor.reload_to_device", "save",
                         "engine0.wake_up[['weights']]", "engine1.wake_up[['weights']]", "actor.offload_to_cpu",
                         "engine0.wake_up[['kv_cache']]", "engine1.wake_up[['kv_cache']]"]
    log.calls.clear()
    memory.resync(lambda: log.calls.append("sync"))  # a restarted engine mid-rollout
    assert log.calls == ["actor.reload_to_device", "sync", "actor.offload_to_cpu"]


def test_without_sleep_or_offload_nothing_is_called(fake_ray_get):
    log = Log()
    memory = ColocatedMemory([FakeEngine(log, 0)], FakeActor(log), sleep=False, offload=False)
    assert not memory.active
    memory.to_training()
    assert memory.to_rollout(lambda: 1.5) == 1.5
    with memory.training():
        pass
    assert log.calls == []


def test_the_trainer_builds_colocation_from_the_resolved_device(tiny_model_path):
    """Offload follows actor.fsdp.*_offload only on GPUs (the keys are refused on a CPU run anyway)."""
    cfg = cfg_of(tiny_model_path)
    assert not build.actor_offloads(cfg)


def test_a_trainer_handed_sleep_mode_workers_sleeps_and_wakes_their_engines(tiny_model_path, tmp_path, fake_ray_get):
    """The call path of sleep mode: the builder's ``Workers.sleep_mode`` (hybrid_engine on GPUs) reaches the
    trainer, whose colocation puts the engines to sleep after a rollout and wakes them for the sync."""
    from transformers import AutoTokenizer

    from agent_trainer.training.trainer import AgentTrainer

    cfg, tags = compose_and_prepare([f"model_path={tiny_model_path}", f"trainer.default_local_dir={tmp_path}",
                                     "actor_rollout_ref.hybrid_engine=true", "trainer.device=cuda"])
    trainer = AgentTrainer(cfg, AutoTokenizer.from_pretrained(tiny_model_path), tags, build_workers=build.build_workers)
    assert not trainer.memory.active  # no worker yet
    log = Log()
    trainer.take_workers(build.Workers(actor=FakeActor(log), sync_plan=build.sync_plan(cfg),
                                       engines=[FakeEngine(log, 0)], device="cuda",
                                       sleep_mode=sleep_mode_on(cfg, "cuda"), actor_offload=build.actor_offloads(cfg)))
    assert trainer.memory.active and trainer.engines == trainer.memory.engines
    trainer.memory.to_training()  # train_step, after the rollout
    trainer.memory.to_rollout(lambda: log.calls.append("sync"))  # train_step's sync
    assert log.calls == ["engine0.sleep[1]", "engine0.wake_up[['weights']]", "sync", "engine0.wake_up[['kv_cache']]"]


def test_weight_sync_keys_are_refused_before_ray_starts(tiny_model_path):
    from agent_trainer.config.choices import WEIGHT_SYNC_TRANSPORTS
    from agent_trainer.workers.sync_transports import TRANSPORTS

    assert WEIGHT_SYNC_TRANSPORTS == TRANSPORTS  # the config layer's copy of the sync's choices
    with pytest.raises(SystemExit, match=r"actor_rollout_ref.rollout.weight_sync = 'nccl'"):
        cfg_of(tiny_model_path, "actor_rollout_ref.rollout.weight_sync=nccl")
    with pytest.raises(SystemExit, match=r"update_weights_bucket_megabytes = 0"):
        cfg_of(tiny_model_path, "actor_rollout_ref.rollout.update_weights_bucket_megabytes=0")
    with pytest.raises(SystemExit, match=r"weight_sync = 'cuda_ipc' reaches the one engine on the actor's rank-0 GPU"):
        cfg_of(tiny_model_path, "actor_rollout_ref.rollout.weight_sync=cuda_ipc", "trainer.device=cuda")
    accepted = cfg_of(tiny_model_path, "actor_rollout_ref.rollout.weight_sync=cuda_ipc", "trainer.device=cuda",
                      "actor_rollout_ref.hybrid_engine=true", "actor_rollout_ref.actor.fsdp.world_size=1")
    assert accepted.actor_rollout_ref.rollout.weight_sync == "cuda_ipc"
