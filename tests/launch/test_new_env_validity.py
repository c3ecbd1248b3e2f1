"""The tiny model answers an environment it has never seen with its listed actions, and keeps the shipped ones valid.

The new environment is written as a user would write it from docs/writing_an_environment.md: a package outside
this repository's ``envs/``, a tags file of its own naming the class by import path, action words that appear
nowhere in the repository's environments. The replies are sampled at the trainer's default temperature (1) and
judged by the env-state manager and the env's own ``action_is_valid`` (``launch.validity_probe``: the rollout's
prompt building and reply parsing, the HF rollout engine).

These tests need a model built with the format warm-up (``make model``; ``AGENT_TRAINER_TEST_MODEL``); on the
random-init model the ``tiny_model_path`` fixture builds without it they are skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from launch import validity_probe

REPO = Path(__file__).resolve().parents[2]
ELEVATOR_ACTIONS = ("Ascend", "Descend", "Unbolt Hatch", "Chime")

ELEVATOR_MODULE = '''
"""An elevator: carry the passenger to the lobby. Written against docs/writing_an_environment.md only."""

from dataclasses import dataclass

import numpy as np

from envs import BaseEnv, make_info


@dataclass
class ElevatorConfig:
    floors: int = 7

    def __post_init__(self):
        if self.floors < 2:
            raise ValueError(f"floors must be >= 2, got {self.floors}")


class ElevatorEnv(BaseEnv):
    config_cls = ElevatorConfig
    ACTIONS = ("Ascend", "Descend", "Unbolt Hatch", "Chime")

    def reset(self, seed=None, **kwargs):
        rng = np.random.default_rng(seed)
        self.car = int(rng.integers(1, self.config.floors + 1))
        self.passenger = int(rng.integers(1, self.config.floors + 1))
        self.carrying, self.done = False, False
        return self.render()

    def step(self, action):
        name = action.strip().lower() if isinstance(action, str) else ""
        known = {a.lower(): a for a in self.ACTIONS}
        if self.done or name not in known:
            return self.render(), 0.0, self.done, make_info(self.done, False, False)
        before = (self.car, self.carrying)
        if known[name] == "Ascend":
            self.car = min(self.config.floors, self.car + 1)
        elif known[name] == "Descend":
            self.car = max(1, self.car - 1)
        elif known[name] == "Unbolt Hatch" and self.car == self.passenger:
            self.carrying = True
        self.done = self.carrying and self.car == 1
        return self.render(), float(self.done), self.done, make_info(self.done, True, before != (self.car, self.carrying))

    def render(self):
        where = "in the car" if self.carrying else f"waiting on floor {self.passenger}"
        return f"The car is on floor {self.car} of {self.config.floors}. The passenger is {where}."

    def action_description(self):
        return " | ".join(self.ACTIONS)
'''

ELEVATOR_TAGS = """
custom_envs:
  Elevator:
    env_type: my_building.elevator:ElevatorEnv
    max_actions_per_traj: 10
    env_instruction: Bring the passenger down to floor 1.
    env_config: {floors: 7}
"""


def _warmed_up(model_path: str) -> dict:
    info = json.loads((Path(model_path) / "build_info.json").read_text())
    if not info.get("warmup_steps"):
        pytest.skip("the model was built without the format warm-up (set AGENT_TRAINER_TEST_MODEL to make model's)")
    return info


@pytest.fixture
def elevator_tags(tmp_path, monkeypatch):
    """The user's project: a package ``my_building`` and a tags file, outside the repository."""
    from envs import load_env_tags

    package = tmp_path / "my_building"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "elevator.py").write_text(textwrap.dedent(ELEVATOR_MODULE))
    (tmp_path / "my_envs.yaml").write_text(ELEVATOR_TAGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return load_env_tags(tmp_path / "my_envs.yaml")


def test_the_elevator_words_are_new_to_the_repository():
    shipped = " ".join(p.read_text() for p in [*REPO.glob("envs/**/*.py"), REPO / "config" / "envs.yaml"])
    for word in ("Ascend", "Descend", "Hatch", "Chime", "Elevator"):
        assert not re.search(rf"\b{word}", shipped, re.IGNORECASE), word


NOT_YET = ("the shipped tiny model does not yet answer an unseen env's listed actions (0.000 valid at step 0; the "
           "made-up environments tried in its corpus reached at most 9%: docs/tiny_model.md)")


@pytest.mark.xfail(strict=True, reason=NOT_YET)
@pytest.mark.parametrize("enable_think", [True, False])
def test_a_new_env_gets_valid_roughly_uniform_actions_at_step_zero(tiny_model_path, elevator_tags, enable_think):
    _warmed_up(tiny_model_path)
    [result] = validity_probe.probe_model(tiny_model_path, elevator_tags, ["Elevator"], episodes=64,
                                          enable_think=enable_think)
    top = result.answers.most_common(6)
    assert result.valid_rate >= 0.9, f"valid {result.valid_rate:.3f} over {result.turns} turns; answers {top}"
    # No task policy: every listed action is chosen, none by (almost) all episodes.
    chosen = {a.lower(): n for a, n in result.answers.items()}
    assert all(chosen.get(a.lower(), 0) >= 3 for a in ELEVATOR_ACTIONS), top
    assert max(chosen.values()) <= 0.6 * result.turns, top


SHIPPED_FLOOR = {"FrozenLake": 0.8, "SimpleSokoban": 0.8, "Bandit": 0.05}
"""Least valid-action rate of the first reply on shipped discrete tags, sampled at temperature 1 over 64 episodes.
make model's build differs between CPUs, and so do these rates: 0.922, 0.906, 0.344 on one machine's build, 0.953,
0.875, 0.141 on another's. The floors sit below every build measured; a build that lost the format (near 0) or a
reply parser that broke falls under them."""


def test_shipped_envs_keep_their_validity(tiny_model_path):
    from envs import load_env_tags

    _warmed_up(tiny_model_path)
    results = validity_probe.probe_model(tiny_model_path, load_env_tags(REPO / "config" / "envs.yaml"),
                                         list(SHIPPED_FLOOR), episodes=64)
    low = {r.tag: round(r.valid_rate, 3) for r in results if r.valid_rate < SHIPPED_FLOOR[r.tag]}
    assert not low, f"valid-action rates below {SHIPPED_FLOOR}: {low}"


def test_a_users_tags_file_adds_to_the_corpus_and_a_clash_is_refused(elevator_tags, tmp_path):
    """``--add-envs-config`` (``make model ENVS=...``): the user's tags join the shipped ones, never replace them."""
    from launch import build_tiny_model as btm

    shipped = REPO / "config" / "envs.yaml"
    corpus = btm.collect_corpus(shipped, n_seeds=1, n_steps=1, add_envs_configs=(tmp_path / "my_envs.yaml",))
    assert "Elevator" in corpus.tags_used and {"FrozenLake", "SimpleSokoban"} <= set(corpus.tags_used)
    assert any("Unbolt Hatch" in text for text in corpus.texts)  # the new words reach the tokenizer's corpus
    assert any(ep.tag == "Elevator" for ep in corpus.episodes)  # and the format warm-up's episodes
    (tmp_path / "clash.yaml").write_text("custom_envs:\n  FrozenLake:\n    env_type: my_building.elevator:ElevatorEnv\n")
    with pytest.raises(ValueError, match=r"--add-envs-config .*clash.yaml: tags \['FrozenLake'\] are already in"):
        btm.collect_corpus(shipped, n_seeds=1, n_steps=1, add_envs_configs=(tmp_path / "clash.yaml",))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_model_envs_names_its_model_after_the_tags_file():
    """A second tags file builds beside the first, not over it; ``ENVS_MODEL`` names the folder (``make -n``: the
    commands make would run)."""
    import subprocess

    keep = ["-o", "models/tiny-qwen2/build_info.json", "-o", "models/tiny-qwen2-rm/config.json"]

    def build_command(*args: str) -> str:
        proc = subprocess.run(["make", "-n", "--no-print-directory", *keep, "model", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "--out models/tiny-qwen2-thermostat_envs --add-envs-config /p/thermostat_envs.yaml" in \
        build_command("ENVS=/p/thermostat_envs.yaml")
    assert "--out models/tiny-qwen2-elevator --add-envs-config /q/elevator.yaml" in build_command("ENVS=/q/elevator.yaml")
    assert "--out /p/models/mine --add-envs-config" in build_command("ENVS=/p/thermostat_envs.yaml",
                                                                      "ENVS_MODEL=/p/models/mine")


@pytest.mark.e2e
def test_make_model_envs_builds_a_model_that_knows_the_users_env(tiny_model_path, elevator_tags, tmp_path):
    """``make model ENVS=...`` as the walkthrough runs it (the tags file's folder on PYTHONPATH by make, not by the
    test): a second model whose corpus holds the shipped tags and the user's, answering the new env's actions
    where the shipped model answers none. 600 warm-up steps keep it to about a minute (the Makefile's default,
    1,200, measured 0.875 valid; 600 measured 0.609; 300 measured 0.297 on one build and 0.141 on another's). The
    floor asked here, 8 valid of 64 (0.125), sits far under what 600 steps gave, so a build of another machine
    clears it too; the shipped model, which never saw the words, answers none."""
    import os
    import subprocess

    _warmed_up(tiny_model_path)
    out = tmp_path / "with-envs"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    keep = ["-o", "models/tiny-qwen2/build_info.json", "-o", "models/tiny-qwen2-rm/config.json"]  # only the new one
    proc = subprocess.run(["make", "--no-print-directory", *keep, "model", f"ENVS={tmp_path / 'my_envs.yaml'}",
                           f"ENVS_MODEL={out}", "ENVS_WARMUP=600"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"train with model_path={out}" in proc.stdout
    info = json.loads((out / "build_info.json").read_text())
    assert "Elevator" in info["corpus"]["tags_used"] and "FrozenLake" in info["corpus"]["tags_used"]
    [shipped] = validity_probe.probe_model(tiny_model_path, elevator_tags, ["Elevator"], episodes=64)
    [added] = validity_probe.probe_model(out, elevator_tags, ["Elevator"], episodes=64)
    assert shipped.valid == 0 and added.valid >= 8, (shipped.answers, added.answers)
