"""``python -m agent_trainer.plan``: print the per-GPU memory plan of a run (``agent_trainer.checks.memory_plan``).

    python -m agent_trainer.plan --config-name gpu_qwen7b_8gpu model_path=config/model_shapes/Qwen2.5-7B \\
        [key=value ...] [--gpu-memory-gib 80] [--gpus-per-node 8] [--nodes 1]

The config is composed and checked exactly as ``python -m agent_trainer.main`` does (the same
``--config-name`` and overrides); only the model's ``config.json`` is read, no weights. docs/cluster.md
shows the tables and what each line counts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.checks.memory_plan import build_plan, render


# -- command line ---------------------------------------------------------------------------

def load(argv: Sequence[str]) -> tuple[AgentTrainerConfig, argparse.Namespace]:
    """Compose and check the config as agent_trainer.main does (``agent_trainer.checks.prepare``); the plan's own
    flags apart."""
    from omegaconf import open_dict

    parser = argparse.ArgumentParser(prog="python -m agent_trainer.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", "-cn", default="frozenlake")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory of one GPU (default: trainer.gpu_memory_gib, else 80)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1)
    args, overrides = parser.parse_known_args(list(argv))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        parser.error(f"not a key=value override: {' '.join(bad)}")

    def plan_any_memory(raw) -> None:
        if args.gpu_memory_gib is None:
            args.gpu_memory_gib = raw.trainer.get("gpu_memory_gib", None)
        if "gpu_memory_gib" in raw.trainer:
            with open_dict(raw):
                raw.trainer.gpu_memory_gib = None  # the plan is printed even when it would be refused

    cfg, _ = compose_and_prepare(overrides, args.config_name, edit=plan_any_memory)
    return cfg, args


def cli(argv: Sequence[str] | None = None) -> int:
    """Print the plan; exit 0 when it fits, 1 when it does not."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg, args = load(sys.argv[1:] if argv is None else argv)
    plan = build_plan(cfg, args.gpu_memory_gib, args.gpus_per_node, args.nodes)
    print(render(plan))
    return 0 if plan.fits() else 1


if __name__ == "__main__":
    sys.exit(cli())
