"""The run's other outputs: wandb (offline, resumed into the same run), the refusal without wandb, PNG curves."""

from __future__ import annotations

import importlib.util
import json

import pytest

from agent_trainer.checks.load import load_config
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.observe.tracking import WANDB_RUN_FILE, Tracking
from agent_trainer.observe.viewer.plots import write_curves


def test_wandb_offline_logs_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = AgentTrainerConfig()
    first = Tracking(tmp_path, ["jsonl", "wandb"], cfg=cfg)
    first.log({"rollout/success_rate": 0.5}, step=1)
    first.log({"rollout/success_rate": 0.75}, step=2)
    run_id = first._wandb.id
    first.close()
    assert json.loads((tmp_path / WANDB_RUN_FILE).read_text()) == {"id": run_id}
    offline = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline and list(offline[0].glob("*.wandb"))
    again = Tracking(tmp_path, ["jsonl", "wandb"], resume_step=2, cfg=cfg)
    assert again._wandb.id == run_id
    again.log({"rollout/success_rate": 1.0}, step=3)
    again.close()


def test_wandb_without_the_package_is_refused_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"trainer.logger = \['console', 'wandb'\] names 'wandb', which is not "
                                         r"installed; pip install -e '\.\[wandb\]'"):
        load_config({"trainer": {"logger": ["console", "wandb"]}})


def test_learning_curves_are_pngs_of_the_logged_metrics(tmp_path):
    tracking = Tracking(tmp_path, ["jsonl"], cfg=AgentTrainerConfig())
    for step in (1, 2, 3):
        tracking.log({"rollout/success_rate": step / 4, "rollout/episode_reward_mean": -1 + step / 2,
                      "actor/pg_loss": 0.1 / step, "timing_s/rollout": 2.0, "timing_s/update_actor": 1.0,
                      "timing_s/step": 3.2}, step=step)
    tracking.log({"val/success_rate": 0.5}, step=3)  # a repeated step: the last line wins
    tracking.close()
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["losses.png", "reward.png", "success.png", "timing.png"]
    for name in pngs:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000
    assert write_curves(tmp_path / "metrics.jsonl", tmp_path / "again")[0].name == "success.png"
