"""Checkpoint files without workers: discovery, atomic commit, resume modes, pruning, RNG and optimizer state."""

import json
import random

import numpy as np
import pytest
import torch

from agent_trainer.common import checkpoint
from agent_trainer.common.checkpoint import TrainerState
from agent_trainer.observe.tracking import Tracking


def _fake_save(run_dir, step, parts=("actor",)):
    """What AgentTrainer.save_checkpoint writes, with a config.json standing in for each model part."""
    def write(tmp):
        for part in parts:
            (tmp / part).mkdir()
            (tmp / part / "config.json").write_text("{}")

    return checkpoint.save_step(run_dir, step, write,
                                lambda: TrainerState(global_step=step, env_resets={"train": step}, parts=list(parts)))


def test_commit_renames_and_points_latest_last(tmp_path):
    _fake_save(tmp_path, 2)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step_2"
    assert not list(tmp_path.glob(".tmp_*"))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_resumable(tmp_path):
    _fake_save(tmp_path, 2)
    partial = checkpoint.begin_save(tmp_path, 4)  # killed here: actor half-written, no state file, no rename
    (partial / "actor").mkdir()
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step_2"
    assert checkpoint.prepare_run_dir(tmp_path, "auto", None, ["actor"]) == tmp_path / "global_step_2"
    assert not partial.exists()  # the partial save is cleaned up at the next start


def test_latest_pointer_to_a_missing_folder_falls_back_to_a_scan(tmp_path):
    _fake_save(tmp_path, 1)
    _fake_save(tmp_path, 3)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step_3"


def test_disable_archives_the_earlier_run_instead_of_overwriting_it(tmp_path):
    _fake_save(tmp_path, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert checkpoint.prepare_run_dir(tmp_path, "disable", None, ["actor"]) is None
    assert not (tmp_path / "global_step_2").exists() and not (tmp_path / "metrics.jsonl").exists()
    (archived,) = (tmp_path / "archive").iterdir()
    assert (archived / "global_step_2" / "trainer_state.json").exists()
    assert (archived / "metrics.jsonl").read_text().count("step") == 2


def test_auto_without_a_checkpoint_archives_old_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert checkpoint.prepare_run_dir(tmp_path, "auto", None, ["actor"]) is None
    assert not (tmp_path / "metrics.jsonl").exists() and (tmp_path / "archive").is_dir()


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="trainer.resume_from_path"):
        checkpoint.prepare_run_dir(tmp_path / "run", "resume_path", str(tmp_path / "nowhere"), ["actor"])
    saved = _fake_save(tmp_path / "old", 5)
    assert checkpoint.prepare_run_dir(tmp_path / "run", "resume_path", str(saved), ["actor"]) == saved


def test_a_checkpoint_without_a_needed_part_is_refused_not_skipped(tmp_path):
    _fake_save(tmp_path, 2, parts=("actor",))
    with pytest.raises(ValueError, match=r"no \['critic'\]"):
        checkpoint.prepare_run_dir(tmp_path, "auto", None, ["actor", "critic"])
    assert (tmp_path / "global_step_2").exists()


def test_prune_keeps_the_newest_per_part(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_save(tmp_path, step, parts=("actor", "critic"))
    checkpoint.prune(tmp_path, "actor", 2)
    checkpoint.prune(tmp_path, "critic", 3)
    assert [s for s, f in checkpoint.list_checkpoints(tmp_path) if (f / "actor").exists()] == [3, 4]
    assert [s for s, f in checkpoint.list_checkpoints(tmp_path) if (f / "critic").exists()] == [2, 3, 4]
    assert not (tmp_path / "global_step_1").exists()  # nothing left in it: removed whole
    checkpoint.prune(tmp_path, "actor", None)
    assert len(checkpoint.list_checkpoints(tmp_path)) == 3


def test_resumed_tracking_drops_steps_after_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)))
    tracking = Tracking(tmp_path, ["jsonl"], resume_step=2)
    tracking.ensure_logged({"x": 2.0}, step=2)  # already there: not logged twice
    tracking.log({"x": 3.5}, step=3)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["x"] == 3.5


def test_rng_state_round_trips_through_json():
    checkpoint.seed_everything(3)
    state = json.loads(json.dumps(checkpoint.rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.seed_everything(99)
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    from safetensors.torch import load_file, save_file

    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    named = {"state": {name: optim.state[p] for name, p in model.named_parameters()},
             "param_groups": [{**{k: v for k, v in optim.param_groups[0].items() if k != "params"},
                               "params": [n for n, _ in model.named_parameters()]}]}
    tensors, meta = checkpoint.flatten_optimizer_state(named)
    save_file(tensors, str(tmp_path / "o.safetensors"))
    checkpoint.write_json(tmp_path / "o.json", meta)
    back = checkpoint.unflatten_optimizer_state(load_file(str(tmp_path / "o.safetensors")),
                                                checkpoint.read_json(tmp_path / "o.json"))
    assert back["param_groups"][0]["betas"] == (0.8, 0.9)
    for name, entries in named["state"].items():
        for key, value in entries.items():
            assert torch.equal(back["state"][name][key], value)


def test_export_refuses_a_folder_without_shards(tmp_path, capsys):
    """``python -m agent_trainer.export`` names what it needs: a global_step_N folder or a part with shards/."""
    from agent_trainer.export import main

    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "neither a global_step_N checkpoint folder" in capsys.readouterr().err
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "model.safetensors").write_bytes(b"")  # an unsharded checkpoint: already an HF folder
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "already is a Hugging Face model folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
