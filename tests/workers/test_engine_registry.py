"""The rollout-engine registry (``agent_trainer.checks.engines``): an engine class defined in this file, registered
by name (and by import path), refused or accepted by the start-up checks before ``ray.init``, built by
``agent_trainer.workers.build.build_engines`` and played through the real multi-turn rollout; an unknown name is refused in one
line listing the registered names."""

from __future__ import annotations

import sys

import pytest
import ray
from hydra import compose, initialize_config_dir

from agent_trainer.checks import engines as registry
from agent_trainer.checks.engines import engine_class, engine_names, register_engine
from agent_trainer.checks.load import load_config
from agent_trainer.checks.prepare import CONFIG_DIR
from agent_trainer.workers.engines.base import GenerationOutput, RolloutEngine
from agent_trainer.workers.engines.hf import HFEngine

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the engine class travels to its Ray actor


class CountingEngine(HFEngine):
    """transformers ``generate`` that counts its calls, with a start-up rule and a constructor argument of its own."""

    name = "counting"

    def __init__(self, *args, max_batch_size: int = 64, **kwargs):
        super().__init__(*args, max_batch_size=max_batch_size, **kwargs)
        self.generate_calls = 0

    @classmethod
    def check(cls, cfg) -> None:
        temperature = cfg.actor_rollout_ref.rollout.temperature
        if temperature > 1.5:
            raise ValueError(f"actor_rollout_ref.rollout.temperature = {temperature} is above what the counting "
                             "engine samples at; set it to at most 1.5")

    @classmethod
    def init_kwargs(cls, cfg, *, device: str, enable_sleep_mode: bool) -> dict:
        return {**super().init_kwargs(cfg, device=device, enable_sleep_mode=enable_sleep_mode), "max_batch_size": 3}

    def generate(self, prompts, **kwargs) -> list[GenerationOutput]:
        self.generate_calls += 1
        return super().generate(prompts, **kwargs)

    def stats(self) -> dict:
        return {"generate_calls": self.generate_calls, "max_batch_size": self.max_batch_size}


@pytest.fixture()
def counting_registered():
    register_engine(CountingEngine.name, CountingEngine)
    yield CountingEngine.name
    registry._ENGINES.pop(CountingEngine.name, None)


R = "actor_rollout_ref.rollout."


def _config(tiny_model_path: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose("frozenlake", overrides=[
            f"model_path={tiny_model_path}", "es_manager.train.env_groups=2", "es_manager.train.group_size=2",
            "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]", "es_manager.train.env_configs.n_groups=[1,1]",
            "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=1", "agent_proxy.max_turn=2",
            f"{R}response_length=16", "trainer.device=cpu", *overrides]))


def test_an_unknown_engine_is_refused_before_ray_in_one_line_listing_the_registered_names(tiny_model_path,
                                                                                         counting_registered):
    assert not ray.is_initialized()
    with pytest.raises(ValueError) as err:
        _config(tiny_model_path, f"{R}name=sglang")
    message = str(err.value)
    assert "\n" not in message, message
    assert "actor_rollout_ref.rollout.name = 'sglang'" in message and "['vllm', 'hf', 'counting']" in message
    assert "package.module:ClassName" in message
    with pytest.raises(ValueError, match="did you mean 'counting'"):
        _config(tiny_model_path, f"{R}name=countin")
    with pytest.raises(ValueError, match="not a subclass of agent_trainer.workers.engines.base.RolloutEngine"):
        _config(tiny_model_path, f"{R}name={__name__}:_config")
    assert not ray.is_initialized()


def test_a_registered_engine_declares_its_checks_and_keys(tiny_model_path, counting_registered):
    assert engine_names()[:2] == ["vllm", "hf"] and engine_class("counting") is CountingEngine
    assert issubclass(engine_class("hf"), RolloutEngine) and engine_class("vllm").name == "vllm"
    cfg = _config(tiny_model_path, f"{R}name=counting")
    assert cfg.actor_rollout_ref.rollout.name == "counting"
    assert _config(tiny_model_path, f"{R}name={__name__}:CountingEngine")  # an import path needs no registration
    with pytest.raises(ValueError, match="temperature = 2.0 is above what the counting engine samples at"):
        _config(tiny_model_path, f"{R}name=counting", f"{R}temperature=2.0")  # the engine's own check
    with pytest.raises(ValueError, match="kv_cache_space_gib = 1.0 is read by the vllm engine only, and "
                                         "actor_rollout_ref.rollout.name = 'counting' ignores it"):
        _config(tiny_model_path, f"{R}name=counting", f"{R}kv_cache_space_gib=1.0")
    with pytest.raises(ValueError, match="mode = async needs rollout.name=vllm \\(got 'counting'\\)"):
        _config(tiny_model_path, f"{R}name=counting", f"{R}mode=async")
    with pytest.raises(ValueError, match="register_engine"):
        register_engine("bad:name", CountingEngine)
    with pytest.raises(ValueError, match="not a subclass"):
        register_engine("plain", dict)


@pytest.mark.e2e
def test_a_registered_engine_runs_the_real_rollout(ray_cluster, tiny_model_path, counting_registered):
    """build_engines finds the class by name and builds it with its own kwargs; the rollout plays through it and the
    weight sync's session loads into it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_trainer.rollout import SyncMultiTurnRollout
    from envs import load_env_tags
    from agent_trainer.workers.build import build_engines, env_actor_class

    cfg = _config(tiny_model_path, f"{R}name=counting")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    group = build_engines(cfg, "cpu")
    try:
        engines = group.workers
        rollout = SyncMultiTurnRollout(cfg, tokenizer, engines, env_actor_class(cfg), load_env_tags(), split="train",
                                       num_env_actors=1)
        result = rollout.rollout(step=1)
        assert result.batch["input_ids"].shape[0] == 4 and int(result.batch["response_mask"].sum()) > 0
        stats = ray_cluster.get(engines[0].stats.remote())
        assert stats["generate_calls"] >= 1 and stats["max_batch_size"] == 3  # its own init_kwargs
        info = ray_cluster.get(engines[0].weight_sync_info.remote())
        assert info == {"dtype": "float32", "device": "cpu", "workers": 1, "weight_group": None}
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        seconds = ray_cluster.get(engines[0].update_weights.remote(model.state_dict()))
        assert seconds >= 0
        seq = result.batch["input_ids"][0][result.batch["attention_mask"][0].bool()].tolist()[:32]
        engine_lp = ray_cluster.get(engines[0].prompt_logprobs.remote([seq]))[0]
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits.float()
        want = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(torch.tensor(engine_lp[1:]), want, atol=1e-4)  # the engine holds the sent weights
    finally:
        group.shutdown()
