"""The LoRA keys (actor_rollout_ref.model.lora_rank, lora_alpha, target_modules, lora_dropout) are refused before
Ray starts, in one line naming the key, the value and the fix, when they cannot work."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer.checks.load import load_config
from agent_trainer.main import CONFIG_DIR, compose_and_prepare

M = "actor_rollout_ref.model"


def _prepare(model_path: str, *overrides: str):
    """What the command line does before ray.init (a refusal exits with its one line)."""
    return compose_and_prepare([f"model_path={model_path}", *overrides])


def test_the_defaults_leave_lora_off_and_a_good_config_passes(tiny_model_path):
    cfg = load_config(compose_default(tiny_model_path))
    assert cfg.actor_rollout_ref.model.lora_rank == 0 and cfg.actor_rollout_ref.model.target_modules == ["all-linear"]
    cfg, _ = _prepare(tiny_model_path, f"{M}.lora_rank=8", f"{M}.lora_alpha=16", f"{M}.target_modules=[q_proj,v_proj]",
                      "actor_rollout_ref.actor.use_kl_loss=true")
    assert cfg.actor_rollout_ref.model.lora_rank == 8 and cfg.actor_rollout_ref.model.target_modules == ["q_proj",
                                                                                                       "v_proj"]


def compose_default(model_path: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("frozenlake", overrides=[f"model_path={model_path}"])


@pytest.mark.parametrize("overrides, words", [
    ([f"{M}.lora_rank=-1"], [f"{M}.lora_rank = -1 must be >= 0", f"{M}.lora_rank=8"]),
    ([f"{M}.lora_rank=eight"], [f"{M}.lora_rank", "eight"]),
    ([f"{M}.lora_rank=8", f"{M}.lora_alpha=0"], [f"{M}.lora_alpha = 0", "must be > 0"]),
    ([f"{M}.lora_rank=8", f"{M}.lora_dropout=1.0"], [f"{M}.lora_dropout = 1.0", "[0, 1)"]),
    ([f"{M}.lora_rank=8", f"{M}.target_modules=[q_proj,qkv]"],
     [f"{M}.target_modules = ['q_proj', 'qkv']", "['qkv'] matches no linear module of Qwen2ForCausalLM",
      "'down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'"]),
    ([f"{M}.lora_rank=8", f"{M}.target_modules=[lm_head]"], ["['lm_head'] matches no linear module"]),
    (["critic.model.lora_rank=4"], ["critic.model.lora_rank = 4", "critic.model.lora_rank=0"]),
    ([f"{M}.lora_alpha=32"], [f"{M}.lora_alpha = 32.0 does nothing with {M}.lora_rank = 0", f"{M}.lora_rank"]),
    ([f"{M}.target_modules=[q_proj]"], [f"{M}.target_modules = ['q_proj'] does nothing"]),
    ([f"{M}.lora_dropout=0.1"], [f"{M}.lora_dropout = 0.1 does nothing"]),
    (["critic.model.lora_alpha=8"], ["critic.model.lora_alpha = 8.0 does nothing"]),
    ([f"{M}.lora_rank=8", "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.dtype=bfloat16"],
     ["actor_rollout_ref.ref.dtype = 'bfloat16'", "actor_rollout_ref.ref.dtype=null"]),
])
def test_a_lora_value_that_cannot_work_is_refused_in_one_line(tiny_model_path, overrides, words):
    with pytest.raises(SystemExit) as err:
        _prepare(tiny_model_path, *overrides)
    message = str(err.value.code)
    assert "\n" not in message and all(w in message for w in words), message


def test_a_separate_reference_with_lora_is_the_base_model(tiny_model_path):
    """ref.colocate=false with LoRA is allowed: the reference group loads model_path without the adapter."""
    cfg, _ = _prepare(tiny_model_path, f"{M}.lora_rank=4", "actor_rollout_ref.actor.use_kl_loss=true",
                      "actor_rollout_ref.ref.colocate=false", "actor_rollout_ref.ref.dtype=bfloat16")
    assert not cfg.actor_rollout_ref.ref.colocate
