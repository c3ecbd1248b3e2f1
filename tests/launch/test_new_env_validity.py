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


NOT_YET = ("the tiny model does not yet answer an unseen env's listed actions: 0.000 valid at step 0 (the made-up "
           "environments of launch/generic_corpus.py did not teach it within a 3-minute build; docs/tiny_model.md)")


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


SHIPPED_FLOOR = {"FrozenLake": 0.8, "SimpleSokoban": 0.8, "Bandit": 0.2}
"""Least valid-action rate of the first reply on shipped discrete tags, sampled at temperature 1 over 64 episodes
(measured: 0.89-0.92, 0.89-0.91 and 0.34-0.75, docs/tiny_model.md; below those: a regression)."""


def test_user_tags_files_add_to_the_corpus(elevator_tags, tmp_path):
    from launch import build_tiny_model as btm

    corpus = btm.collect_corpus([REPO / "config" / "envs.yaml", tmp_path / "my_envs.yaml"], n_seeds=1, n_steps=1)
    assert "Elevator" in corpus.tags_used and "FrozenLake" in corpus.tags_used
    elevator = next(ep for ep in corpus.episodes if ep.tag == "Elevator")
    # The rollout's own instruction: the env's actions as a user env lists them.
    assert "Valid actions: Ascend | Descend | Unbolt Hatch | Chime" in elevator.instruction


def test_made_up_envs_list_their_actions_and_the_warm_up_answers_one_of_them():
    import random

    from agent_trainer import prompts
    from launch import build_tiny_model as btm
    from launch import generic_corpus

    corpus = btm.collect_corpus(REPO / "config" / "envs.yaml", n_seeds=1, n_steps=1, generic_tags=4, generic_seeds=8)
    assert len(corpus.generic_episodes) == 32
    made_up = " ".join(ep.instruction for ep in corpus.generic_episodes)
    assert all(text not in corpus.texts for text in made_up.split("\n") if "|" in text)  # not in the tokenizer corpus
    rng = random.Random(0)
    for ep in corpus.generic_episodes:
        listed = ep.instruction.split("Valid actions: ")[1].split("\n")[0].split(" | ")
        assert ep.choices[0] == (listed, True)
        chat = btm.make_transcript(ep, rng, answer_only_rate=0.5)
        think = "<think>" in chat[-1]["content"]
        assert prompts.parse_response(chat[-1]["content"], enable_think=think).actions[0] in ep.choices[-1][0]
    env = generic_corpus.SyntheticEnv(generic_corpus.SyntheticConfig(world=3))
    assert env.reset(seed=5) == generic_corpus.SyntheticEnv(generic_corpus.SyntheticConfig(world=3)).reset(seed=5)
    assert env.step("certainly not an action")[3]["action_is_valid"] is False
    assert env.step(env.actions[0])[3]["action_is_valid"] is True


def test_shipped_envs_keep_their_validity(tiny_model_path):
    from envs import load_env_tags

    _warmed_up(tiny_model_path)
    results = validity_probe.probe_model(tiny_model_path, load_env_tags(REPO / "config" / "envs.yaml"),
                                         list(SHIPPED_FLOOR), episodes=64)
    low = {r.tag: round(r.valid_rate, 3) for r in results if r.valid_rate < SHIPPED_FLOOR[r.tag]}
    assert not low, f"valid-action rates below {SHIPPED_FLOOR}: {low}"
