"""Export a checkpoint's policy (or critic) as a Hugging Face folder, from its shards, on CPU.

    python -m agent_trainer.export outputs/<project>/<experiment>/global_step_40 --out exported/
    python -m agent_trainer.export outputs/.../global_step_40/actor --out exported/ --dtype bfloat16

A checkpoint always holds each rank's shards (``actor/shards/``, ``workers/sharded_checkpoint.py``);
the HF weights next to them are written only with ``trainer.save_hf_model=true``. This entry
builds the HF folder from the shards alone: no Ray, no GPU, no process group, one full tensor in
memory at a time. The model config comes from the checkpoint (``config.json``); the tokenizer
files (saved with the actor) are copied. The result loads with ``from_pretrained``, starts a run
as ``model_path`` and serves with ``vllm serve``. See docs/checkpointing.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from agent_trainer.worker_registry import worker_api

sharded_checkpoint = worker_api("sharded_checkpoint")

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


def export(path: Path, out: Path, part: str = "actor", dtype: str | None = None) -> Path:
    """Write the HF folder of ``path`` (a ``global_step_N`` folder or its ``actor``/``critic``) into ``out``."""
    src = model_folder(path, part)
    out = Path(out)
    if out.resolve() == src.resolve():
        raise ValueError("--out must be another folder than the checkpoint's")
    if out.exists() and any(out.glob("*.safetensors")):
        raise ValueError(f"{out} already holds weights; choose an empty --out")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent_trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a global_step_N folder, or its actor/ or critic/ folder")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (new or empty)")
    parser.add_argument("--part", default="actor", choices=("actor", "critic"),
                        help="which model of a global_step_N folder (default: actor)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the floating weights (default: as saved, the training dtype)")
    args = parser.parse_args(argv)
    try:
        export(Path(args.checkpoint), Path(args.out), part=args.part, dtype=args.dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
