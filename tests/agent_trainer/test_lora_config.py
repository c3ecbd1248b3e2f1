"""The LoRA keys (actor_rollout_ref.model.lora_rank, lora_alpha, target_modules, lora_dropout) are refused before
Ray starts, in one line naming the key, the value and the fix, when they cannot work."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer.checks.load import load_config
from agent_trainer.checks.prepare import CONFIG_DIR, compose_and_prepare

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


def _peft_folder(model_path: str, folder, **lora) -> str:
    """A peft adapter folder (PeftModel.save_pretrained) for the tiny model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora}
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), LoraConfig(**lora)).save_pretrained(str(folder))
    return str(folder)


def test_an_adapter_folder_matching_the_run_passes(tiny_model_path, tmp_path):
    folder = _peft_folder(tiny_model_path, tmp_path / "a")
    cfg, _ = _prepare(tiny_model_path, f"{M}.lora_rank=4", f"{M}.lora_alpha=8", f"{M}.target_modules=[v_proj,q_proj]",
                      f"{M}.lora_adapter_path={folder}")
    assert cfg.actor_rollout_ref.model.lora_adapter_path == folder
    every = _peft_folder(tiny_model_path, tmp_path / "b", target_modules="all-linear")
    _prepare(tiny_model_path, f"{M}.lora_rank=4", f"{M}.lora_alpha=8", f"{M}.lora_adapter_path={every}",
             f"{M}.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")


@pytest.mark.parametrize("overrides, words", [
    ([f"{M}.lora_rank=4", f"{M}.lora_alpha=16"], ["lora_alpha = 8 but actor_rollout_ref.model.lora_alpha = 16.0"]),
    ([f"{M}.lora_rank=8", f"{M}.lora_alpha=8"], ["r = 4 but actor_rollout_ref.model.lora_rank = 8"]),
    ([f"{M}.lora_rank=4", f"{M}.lora_alpha=8", f"{M}.target_modules=[q_proj]"],
     ["target_modules = ['q_proj', 'v_proj'] but actor_rollout_ref.model.target_modules = ['q_proj']"]),
    ([f"{M}.lora_rank=4", f"{M}.lora_alpha=8"], ["target_modules", "['all-linear']"]),  # all-linear vs 2 modules
    ([], [f"{M}.lora_adapter_path = ", f"with {M}.lora_rank = 0", f"{M}.lora_rank"]),
])
def test_an_adapter_folder_that_does_not_fit_is_refused_in_one_line(tiny_model_path, tmp_path, overrides, words):
    folder = _peft_folder(tiny_model_path, tmp_path / "a")
    with pytest.raises(SystemExit) as err:
        _prepare(tiny_model_path, *overrides, f"{M}.lora_adapter_path={folder}")
    message = str(err.value.code)
    assert "\n" not in message and f"{M}.lora_adapter_path" in message and all(w in message for w in words), message


def test_an_adapter_folder_without_adapter_files_is_refused(tiny_model_path, tmp_path):
    with pytest.raises(SystemExit) as err:
        _prepare(tiny_model_path, f"{M}.lora_rank=4", f"{M}.lora_adapter_path={tmp_path}")
    message = str(err.value.code)
    assert "\n" not in message and "lacks ['adapter_config.json', 'adapter_model.safetensors']" in message, message


def test_an_adapter_folder_as_model_path_is_refused_naming_lora_adapter_path(tiny_model_path, tmp_path):
    """An SFT-with-LoRA final/ holds no model weights: as model_path it is refused, pointing at the right keys."""
    folder = _peft_folder(tiny_model_path, tmp_path / "a")
    with pytest.raises(SystemExit) as err:
        _prepare(folder)
    message = str(err.value.code)
    assert "\n" not in message and f".path = {folder!r} is a LoRA adapter folder" in message, message
    assert f"{M}.lora_adapter_path" in message
