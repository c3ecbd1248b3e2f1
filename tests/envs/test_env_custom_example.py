"""The "Writing your own environment" example: short, in sync with the docs, trainable by config."""

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from agent_trainer.episode.es_manager import EnvInput, EnvStateManager, EpisodeSpec
from envs.countdown import parse_expression
from envs.metamathqa import answers_match

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "envs" / "examples" / "guess_number.py"


def test_example_is_short_and_matches_the_docs():
    code = EXAMPLE.read_text()
    assert len(code.splitlines()) < 60
    doc = (ROOT / "docs" / "writing_an_environment.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.DOTALL)
    assert code in blocks


def test_example_registered_by_config_and_run_by_the_env_manager(garbage_actions, fuzz):
    tags = envs.load_env_tags()
    assert tags["GuessNumber"].env_type == "envs.examples.guess_number:GuessNumberEnv"
    mgr = EnvStateManager(tags, [EpisodeSpec(0, 0, "GuessNumber"), EpisodeSpec(1, 0, "GuessNumber")])
    first = mgr.reset({0: 7})
    assert "whole number from 1 to 100" in first[0].instruction
    expert = mgr.episodes[0].env
    while not mgr.step([EnvInput(0, "", [expert.expert_action()])])[0].done:
        pass
    states = mgr.get_rollout_states()
    assert states[0].metrics["success"] == 1.0 and states[0].metrics["num_actions"] <= 7
    fuzz(envs.make_env("GuessNumber"), garbage_actions)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_free_text_parsers_never_raise(text):
    parse_expression(text)
    answers_match(text, "\\frac{1}{2}")
    env = envs.make_env("frozen_lake")
    env.reset(seed=0)
    assert env.step(text)[3]["action_is_valid"] == (envs.parse_choice(text, ["Left", "Down", "Right", "Up"]) is not None)
