"""Export a checkpoint's policy (or critic) as a Hugging Face folder, from its shards, on CPU.

    python -m agent_trainer.export outputs/<project>/<experiment>/global_step_40 --out exported/
    python -m agent_trainer.export outputs/.../global_step_40/actor --out exported/ --dtype bfloat16
    python -m agent_trainer.export outputs/.../global_step_40 --out exported/ --merge   # a LoRA checkpoint

A checkpoint always holds each rank's shards (``actor/shards/``, ``agent_trainer/workers/sharded_checkpoint.py``);
the HF weights next to them are written only with ``trainer.save_hf_model=true``. This entry
builds the HF folder from the shards alone: no Ray, no GPU, no process group, one full tensor in
memory at a time. The model config comes from the checkpoint (``config.json``); the tokenizer
files (saved with the actor) are copied. The result loads with ``from_pretrained``, starts a run
as ``model_path`` and serves with ``vllm serve``. See docs/checkpointing.md.

A LoRA checkpoint (``actor_rollout_ref.model.lora_rank`` > 0: its shards hold the adapter only) exports with
``--merge``: the base model (the run's ``actor_rollout_ref.model.path`` from ``global_step_N/config.yaml``, or
``--base``) with the adapter merged in, ``W + (alpha / r) B A``, as a plain Hugging Face folder (peft's
``merge_and_unload``; the adapter folder is peft's ``adapter_config.json`` + ``adapter_model.safetensors``, written
from the shards first when the checkpoint was saved without them). ``--merge`` on a full-model checkpoint is
refused: there is nothing to merge. See docs/lora.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent_trainer.training.model_export import export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent_trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a global_step_N folder, or its actor/ or critic/ folder")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (new or empty)")
    parser.add_argument("--part", default="actor", choices=("actor", "critic"),
                        help="which model of a global_step_N folder (default: actor)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the floating weights (default: as saved, the training dtype)")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint: write the base model with the adapter merged in (docs/lora.md)")
    parser.add_argument("--base", default=None,
                        help="with --merge: the base model folder (default: the run's actor_rollout_ref.model.path "
                             "from the checkpoint's config.yaml)")
    args = parser.parse_args(argv)
    try:
        export(Path(args.checkpoint), Path(args.out), part=args.part, dtype=args.dtype, merge=args.merge,
               base=Path(args.base) if args.base else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
