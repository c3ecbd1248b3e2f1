"""``python -m agent_trainer.export CHECKPOINT --out DIR --merge`` of a LoRA checkpoint, in-process without Ray: the
plain Hugging Face folder it writes (the base model with the adapter merged in) gives the trained actor's log-probs,
whether the checkpoint holds peft's adapter folder (trainer.save_hf_model=true) or its shards only; and the
refusals (an adapter without --merge, --merge of a full model, an unknown base)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from agent_trainer import export
from agent_trainer.training import model_export
from agent_trainer.common.batch import TensorBatch
from tests.workers.test_lora import TARGETS, _actor, _batch, _train


def _run_config(path: str) -> dict:
    """The part of a run's saved config.yaml the export reads."""
    return {"model_path": path, "actor_rollout_ref": {"model": {
        "path": path, "lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "target_modules": TARGETS}}}


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory):
    """A LoRA actor after two updates and its checkpoint saved twice: with peft's adapter folder and shards only,
    each as a global_step_2 folder with the run's config.yaml."""
    worker = _actor(tiny_model_path)
    for step in range(2):
        _train(worker, seed=step)
    root = tmp_path_factory.mktemp("lora_export")
    steps = {}
    for name, hf_model in (("peft", True), ("shards", False)):
        step = root / name / "global_step_2"
        worker.save_checkpoint(str(step / "actor"), hf_model=hf_model)
        (step / "config.yaml").write_text(yaml.safe_dump(_run_config(tiny_model_path)))
        steps[name] = step
    assert (steps["peft"] / "actor" / "adapter_config.json").is_file()
    assert not (steps["shards"] / "actor" / "adapter_config.json").exists()
    return worker, steps


def _log_probs(model, batch: TensorBatch) -> torch.Tensor:
    from agent_trainer.workers.fsdp_base import ModelInputs, target_logits

    with torch.no_grad():
        return target_logits(model.eval(), ModelInputs(batch["input_ids"], batch["attention_mask"],
                                                       batch["position_ids"]), batch["attention_mask"]).log_probs()


@pytest.mark.parametrize("saved, args", [
    ("peft", []),                      # the run's config.yaml names the base model
    ("shards", []),                    # saved with save_hf_model=false: the adapter folder is written first
    ("peft", ["--base", "BASE"]),      # the actor folder alone, the base model given
])
def test_merge_gives_the_actors_log_probs(trained, tiny_model_path, tmp_path, saved, args, capsys):
    from transformers import AutoModelForCausalLM

    worker, steps = trained
    src = steps[saved] if not args else steps[saved] / "actor"
    out = tmp_path / "merged"
    argv = [str(src), "--out", str(out), "--merge"] + [tiny_model_path if a == "BASE" else a for a in args]
    assert export.main(argv) == 0, capsys.readouterr().err
    assert "merged onto" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert not any(".lora_" in n or ".base_layer." in n for n in merged.state_dict())  # a plain model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])  # the adapter is in
    batch = _batch(7)
    mask = batch["attention_mask"].bool()
    actor = worker.compute_log_prob(TensorBatch({**batch.tensors, "response_mask": batch["attention_mask"]}))
    assert (_log_probs(merged, batch)[mask] - actor["old_log_probs"][mask]).abs().max() < 1e-5
    assert (_log_probs(base, batch)[mask] - actor["old_log_probs"][mask]).abs().max() > 1e-3  # the check can fail


def test_merge_casts_with_dtype(trained, tmp_path):
    from safetensors import safe_open

    _, steps = trained
    out = tmp_path / "bf16"
    model_export.export(steps["shards"], out, dtype="bfloat16", merge=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_an_adapter_checkpoint_without_merge_is_refused_naming_merge(trained, tmp_path, capsys):
    _, steps = trained
    capsys.readouterr()
    assert export.main([str(steps["peft"]), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "LoRA adapter" in err and "--merge" in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # nothing written


def test_merge_of_a_full_model_checkpoint_is_refused(tiny_model_path, tmp_path, capsys):
    worker = _actor(tiny_model_path, lora=False)
    worker.save_checkpoint(str(tmp_path / "global_step_1" / "actor"), hf_model=False)
    capsys.readouterr()  # the model's loading progress
    assert export.main([str(tmp_path / "global_step_1"), "--out", str(tmp_path / "out"), "--merge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no LoRA adapter to merge" in err and "drop --merge" in err and "\n" not in err
    assert export.main([str(tmp_path / "global_step_1"), "--out", str(tmp_path / "out")]) == 0  # as before


def test_an_unknown_base_model_is_refused_naming_base(trained, tmp_path):
    _, steps = trained
    moved = tmp_path / "global_step_2"
    shutil.copytree(steps["shards"], moved)
    (moved / "config.yaml").write_text(yaml.safe_dump(_run_config(str(tmp_path / "gone"))))
    with pytest.raises(ValueError, match=r"is not a model folder here: pass --base PATH"):
        model_export.export(moved, tmp_path / "out", merge=True)
    with pytest.raises(ValueError, match=r"config.yaml is missing.*pass --base PATH"):
        model_export.export(_alone(moved, tmp_path), tmp_path / "out", merge=True)
    with pytest.raises(ValueError, match=r"--base .* is not a Hugging Face model folder"):
        model_export.export(moved, tmp_path / "out", merge=True, base=tmp_path / "gone")
    # a Hub id is a base too (the SFT's trainer.merge_lora passes its model_path, which may be one)
    hub_id = Path("Qwen/Qwen2.5-0.5B-Instruct")
    assert model_export.base_model_path(moved, None, hub_id) == hub_id


def _alone(step: Path, tmp_path: Path) -> Path:
    """The actor folder of ``step`` copied without the config.yaml beside it."""
    alone = tmp_path / "alone" / "actor"
    shutil.copytree(step / "actor", alone)
    return alone


def test_shards_only_without_the_run_config_are_refused(trained, tiny_model_path, tmp_path):
    """Without peft's adapter_config.json the adapter's lora_alpha comes from the run's config.yaml."""
    _, steps = trained
    with pytest.raises(ValueError, match=r"has no adapter_config.json .* pass the global_step_N folder"):
        model_export.export(_alone(steps["shards"], tmp_path), tmp_path / "out", merge=True, base=Path(tiny_model_path))
