"""In-process training runs for the e2e tests (marked ``shared_cluster``): the first run starts a local
Ray cluster (``init_ray``, as the command line does) and later runs join it; each run starts and kills
its own workers. A cluster costs a start and a teardown per run on the command line; here one for all
of them (tests/e2e/conftest.py orders the marked tests first and ends the cluster after them)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from transformers import AutoTokenizer

from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.ray_cluster import init_ray
from agent_trainer.training.trainer import AgentTrainer
from agent_trainer.workers.build import build_workers


@contextmanager
def started(config_name: str, model_path: str, run_dir, *overrides: str, trainer_cls=AgentTrainer):
    """Compose ``config_name`` with ``overrides`` as the command line would and start the workers in this
    process; yields the trainer. Its workers are killed on exit, the cluster stays."""
    cfg, tags = compose_and_prepare([f"model_path={model_path}", f"trainer.default_local_dir={run_dir}", *overrides],
                                    config_name)
    init_ray(cfg)
    trainer = trainer_cls(cfg, AutoTokenizer.from_pretrained(model_path), tags, build_workers=build_workers)
    trainer.init_workers(build_workers(cfg))  # as the command line does: built here, handed to the trainer
    try:
        yield trainer
    finally:
        trainer.shutdown()


def train_here(config_name: str, model_path: str, run_dir, *overrides: str, trainer_cls=AgentTrainer):
    """:func:`started`, then train; returns (trainer, every step's metrics). The workers are gone afterwards."""
    with started(config_name, model_path, run_dir, *overrides, trainer_cls=trainer_cls) as trainer:
        return trainer, trainer.fit()


def metrics_records(run_dir) -> list[dict]:
    """Every line of ``<run_dir>/metrics.jsonl``, in file order (a repeated step stays visible)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
