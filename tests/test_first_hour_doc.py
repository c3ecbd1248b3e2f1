"""docs/writing_an_environment.md's walkthrough runs as written: its marked blocks, in order, in an empty folder.

A block is marked by the comment line above it: ``<!-- first-hour: run -->`` (a bash or python block, run),
``<!-- first-hour: run e2e -->`` (run by the e2e test only: training, evaluation, the viewer files),
``<!-- first-hour: file PATH -->`` (its text is written to PATH, relative to where the commands are) or
``<!-- first-hour: not run (reason) -->``. Every bash and python block of the page is marked, so a command
added to the page is run here or says why not. The e2e test trains 2 steps instead of 10 on fewer
validation and evaluation seeds (:data:`SHORTER`), on the shipped tiny model instead of the one the page's
step 4 builds (:data:`NOT_BUILT`: that build is ``tests/launch/test_new_env_validity.py``'s), and runs the recipe
(``make train-env``) at a small size (a short model build, a 24-episode warm start, 2 RL steps of 2 turns), nothing else
changed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from doc_blocks import ROOT, blocks, run_script, unmarked_blocks
from doc_blocks import script as page_script

DOC = ROOT / "docs" / "writing_an_environment.md"
MARKER = "first-hour"
SHORTER = {
    "trainer.total_training_steps=10": "trainer.total_training_steps=2",
    "es_manager.val.env_groups=16 es_manager.val.env_configs.n_groups=[16]":
        "es_manager.val.env_groups=4 es_manager.val.env_configs.n_groups=[4]",
    "eval.k=4": "eval.k=2",
    "es_manager.val.env_groups=128 es_manager.val.env_configs.n_groups=[128]":
        "es_manager.val.env_groups=4 es_manager.val.env_configs.n_groups=[4]",
    "TAG=MyGuess OUT=$PWD":
        "TAG=MyGuess OUT=$PWD ENVS_WARMUP=40 "
        "SFT_ARGS='data.num_episodes=24 train.total_epochs=1 eval.env_success=false' "
        "ARGS='trainer.total_training_steps=2 agent_proxy.max_turn=2 es_manager.val.env_groups=4 "
        "es_manager.val.env_configs.n_groups=[4]'",
}
"""What the e2e test shortens in the page's commands (each must be there)."""
NOT_BUILT = "model_path=$PWD/models/my_envs"
"""The model the page's step 4 builds (not run here): the training commands take the shipped tiny model instead."""


def script(e2e: bool) -> str:
    """The page's commands as one bash script (``doc_blocks.script``)."""
    return page_script(DOC, MARKER, e2e)


def test_every_command_block_is_marked():
    assert not unmarked_blocks(DOC, MARKER), unmarked_blocks(DOC, MARKER)
    whats = [what for what, _, _ in blocks(DOC, MARKER)]
    assert {"run", "run e2e"} <= set(whats) and any(w.startswith("file ") for w in whats)


def test_the_walkthrough_up_to_training_runs_as_written(tmp_path):
    """Project, env file, tags file, check_env, the env by hand: no Ray, no model."""
    proc = run_script(script(e2e=False), tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "8 of 8 checks passed (1 tag)" in proc.stdout, proc.stdout
    project = tmp_path / "my_project"
    assert (project / "my_games" / "guess.py").read_text() == (ROOT / "envs/examples/guess_number.py").read_text()


@pytest.mark.e2e
def test_the_first_hour_runs_as_written(tmp_path, tiny_model_path):
    """Check, train PPO (2 steps), evaluate its checkpoint, find the viewers: one pass."""
    text = script(e2e=True)
    for long, short in SHORTER.items():
        assert long in text, f"the page no longer has {long!r}; update SHORTER"
        text = text.replace(long, short)
    assert text.count(NOT_BUILT) == 1, f"the page's PPO command no longer trains {NOT_BUILT!r}; update NOT_BUILT"
    text = text.replace(NOT_BUILT, f"model_path={Path(tiny_model_path).resolve()}")
    proc = run_script(text, tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = tmp_path / "my_project" / "runs"
    # The recipe (make train-env): its model, warm start and RL run in the project, the table and its summary.
    recipe = tmp_path / "my_project" / "outputs" / "agent_trainer" / "env_MyGuess_seed0"
    assert (tmp_path / "my_project" / "models" / "tiny-qwen2-my_envs-seed0" / "train_env_step.json").is_file()
    assert "[5/5] the held-out table" in proc.stdout
    assert "Held-out greedy success on 4 validation seeds (MyGuess, 2 turns):" in proc.stdout
    summary = json.loads((recipe / "learning_summary.json").read_text())
    assert summary["task"] == "MyGuess" and summary["held_out_episodes"] == 4
    assert {b["name"] for b in summary["baselines"]} == {"best fixed sequence [MyGuess]", "expert [MyGuess]"}
    assert (recipe / "global_step_2" / "actor" / "model.safetensors").is_file()
    for name, critic in (("guess_ppo", True),):
        records = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "actor/pg_loss" in r] == [1, 2]
        assert ("critic/vf_loss" in records[-1]) == critic and "env/MyGuess/num_actions" in records[-1]
        assert (runs / name / "global_step_2" / "actor" / "model.safetensors").is_file()
    report = json.loads((runs / "guess_ppo" / "global_step_2" / "eval" / "eval_report.json").read_text())
    assert report["seeds"] == 4 and report["greedy"]["episodes"] == 4 and report["sampled"]["episodes"] == 8
    written = runs / "guess_ppo" / "global_step_2" / "eval" / "trajectories" / "val_sampled_step_0.jsonl"
    assert len(written.read_text().splitlines()) == 8  # every episode evaluated (trainer.log_trajectories_per_tag: 4)
    assert re.search(r"step 2/2  succ \d\.\d{3}  rew [+-]\d\.\d{3}  valid \d\.\d\d .*  ppo_kl ", proc.stdout), proc.stdout
    assert set(report["greedy"]["per_tag"]) == {"MyGuess"}
    assert "'episodes': 4" in proc.stdout  # the page's last command printed the greedy pass
    for viewer in (runs / "guess_ppo" / "trajectories", runs / "guess_ppo" / "global_step_2" / "eval" / "trajectories"):
        assert (viewer / "viewer.html").stat().st_size > 1000
        records = [json.loads(line) for f in viewer.glob("*.jsonl") for line in f.read_text().splitlines()]
        assert records and {r["tag"] for r in records} == {"MyGuess"}
