"""A checkpoint's policy (or critic) as a Hugging Face folder, from its shards, on CPU; a LoRA checkpoint's adapter
merged onto its base model. The command line is ``python -m agent_trainer.export`` (its docstring says what a
checkpoint holds and how each case exports); ``agent_trainer.sft`` merges a LoRA run's last step here too.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from agent_trainer.workers import sharded_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MODEL_FILES = ("config.json", "generation_config.json")


def model_folder(path: Path, part: str = "actor") -> Path:
    """The model part folder holding ``shards/``: ``path`` itself, or ``path/<part>`` for a ``global_step_N``."""
    path = Path(path)
    for folder in (path, path / part):
        if sharded_checkpoint.has_shards(folder):
            return folder
    if (path / "model.safetensors").is_file() or (path / part / "model.safetensors").is_file():
        raise ValueError(f"{path} has no shards/ (a checkpoint saved before sharded checkpoints): its "
                         f"{'' if (path / 'model.safetensors').is_file() else part + '/ '}folder already is a "
                         "Hugging Face model folder")
    raise ValueError(f"{path} is neither a global_step_N checkpoint folder nor a model part of one "
                     f"(no {sharded_checkpoint.SHARDS_DIR}/{sharded_checkpoint.INDEX_FILE} in it or in {part}/)")


def is_adapter_checkpoint(src: Path) -> bool:
    """Whether the model part folder ``src`` holds a LoRA adapter only (``index.json``'s ``adapter_only``)."""
    index = sharded_checkpoint.read_index(src / sharded_checkpoint.SHARDS_DIR)
    return bool(index.get(sharded_checkpoint.ADAPTER_KEY))


def export(path: Path, out: Path, part: str = "actor", dtype: str | None = None, merge: bool = False,
           base: Path | None = None) -> Path:
    """Write the HF folder of ``path`` (a ``global_step_N`` folder or its ``actor``/``critic``) into ``out``;
    ``merge``: of a LoRA checkpoint, the base model (``base``, else the run's) with the adapter merged in."""
    src = model_folder(path, part)
    out = Path(out)
    if out.resolve() == src.resolve():
        raise ValueError("--out must be another folder than the checkpoint's")
    if out.exists() and any(out.glob("*.safetensors")):
        raise ValueError(f"{out} already holds weights; choose an empty --out")
    adapter = is_adapter_checkpoint(src)
    if adapter and not merge:
        raise ValueError(f"{src} holds a LoRA adapter only, not the model's weights: add --merge to write the base "
                         "model with the adapter merged in")
    if merge and not adapter:
        raise ValueError(f"{src} holds a full model, there is no LoRA adapter to merge: drop --merge")
    if base is not None and not merge:
        raise ValueError("--base is the base model of a LoRA checkpoint's --merge: add --merge or drop --base")
    if adapter:
        return export_merged(src, out, dtype=dtype, base=base)
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if not (out / "config.json").is_file():
        raise ValueError(f"{src} has no config.json")
    # the tokenizer is saved with the actor; a critic's export takes the actor's
    for folder in (src, src.parent / "actor"):
        if (folder / "tokenizer_config.json").is_file():
            for name in TOKENIZER_FILES:
                if (folder / name).is_file():
                    shutil.copy2(folder / name, out / name)
            break
    torch_dtype = sharded_checkpoint.dtype_of(dtype) if dtype else None
    files = sharded_checkpoint.write_hf_weights(src / sharded_checkpoint.SHARDS_DIR, out, dtype=torch_dtype)
    if dtype:
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"exported {src} -> {out} ({len(files)} weight file{'s' if len(files) > 1 else ''}"
          f"{', ' + dtype if dtype else ''})")
    return out


def run_model_config(src: Path) -> dict | None:
    """``actor_rollout_ref.model`` of the run's saved ``config.yaml`` next to the part folder ``src`` (in the
    ``global_step_N`` folder above it); None when there is none (only the actor folder was kept)."""
    import yaml

    saved = src.parent / "config.yaml"
    if not saved.is_file():
        return None
    raw = yaml.safe_load(saved.read_text()) or {}
    model = (raw.get("actor_rollout_ref") or {}).get("model")
    return model if isinstance(model, dict) else None


def is_hub_id(path: str) -> bool:
    """``org/name`` that is not a local path: a Hugging Face Hub id, which ``from_pretrained`` resolves."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).exists()


def base_model_path(src: Path, model: dict | None, base: Path | None) -> Path:
    """The base model a LoRA checkpoint's adapter merges onto: ``base``, else the run's ``model.path`` (a local
    folder, or a Hub id such as ``Qwen/Qwen2.5-0.5B-Instruct``, which ``from_pretrained`` resolves)."""
    if base is not None:
        if not (is_hub_id(str(base)) or (Path(base) / "config.json").is_file()):
            raise ValueError(f"--base {base} is not a Hugging Face model folder (no config.json) or Hub id; pass the "
                             "model the LoRA run trained on")
        return Path(base)
    if model is None:
        raise ValueError(f"{src.parent / 'config.yaml'} is missing, so the LoRA run's base model is unknown: pass "
                         "--base PATH (the run's actor_rollout_ref.model.path)")
    path = str(model.get("path") or "")
    if not path or "${" in path or not (is_hub_id(path) or (Path(path) / "config.json").is_file()):
        raise ValueError(f"the run's base model {path or '(none)'} (actor_rollout_ref.model.path in "
                         f"{src.parent / 'config.yaml'}) is not a model folder here: pass --base PATH")
    return Path(path)


def adapter_folder(src: Path, model: dict | None, base: Path, tmp: Path) -> Path:
    """peft's adapter folder of the part folder ``src``: ``src`` itself when the run saved it
    (``trainer.save_hf_model``), else written from the shards into ``tmp`` with the run's lora keys."""
    from agent_trainer.workers import lora  # peft's adapter format
    if (src / lora.ADAPTER_CONFIG).is_file() and (src / lora.ADAPTER_WEIGHTS).is_file():
        return src
    if model is None:
        raise ValueError(f"{src} has no {lora.ADAPTER_CONFIG} (saved with trainer.save_hf_model=false) and "
                         f"{src.parent / 'config.yaml'} is missing, so the adapter's lora_alpha and target_modules "
                         "are unknown: pass the global_step_N folder that holds the run's config.yaml")
    from agent_trainer.config import ModelConfig

    keys = {k: model[k] for k in ("lora_rank", "lora_alpha", "lora_dropout", "target_modules") if k in model}
    lora.write_adapter(src / sharded_checkpoint.SHARDS_DIR, tmp, ModelConfig(path=str(base), **keys))
    return tmp


def export_merged(src: Path, out: Path, dtype: str | None = None, base: Path | None = None) -> Path:
    """Write the plain HF folder of the LoRA checkpoint part ``src``: the base model with its adapter merged in
    (computed in float32, saved in ``dtype``, by default the adapter's training dtype), its config and the
    tokenizer (the checkpoint's, else the base model's)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = run_model_config(src)
    base = base_model_path(src, model, base)
    index = sharded_checkpoint.read_index(src / sharded_checkpoint.SHARDS_DIR)
    saved = {entry["dtype"] for entry in index["tensors"].values()}
    target = sharded_checkpoint.dtype_of(dtype) if dtype else (
        sharded_checkpoint.dtype_of(saved.pop()) if len(saved) == 1 else torch.float32)
    with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
        folder = adapter_folder(src, model, base, Path(tmp))
        plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        merged = PeftModel.from_pretrained(plain, str(folder)).merge_and_unload()
    merged = merged.to(target)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    for folder in (src, src.parent / "actor", base):
        if (folder / "tokenizer_config.json").is_file():
            for name in TOKENIZER_FILES:
                if (folder / name).is_file():
                    shutil.copy2(folder / name, out / name)
            break
    files = list(out.glob("*.safetensors"))
    print(f"exported {src} merged onto {base} -> {out} ({len(files)} weight file{'s' if len(files) > 1 else ''}, "
          f"{str(target).removeprefix('torch.')})")
    return out
