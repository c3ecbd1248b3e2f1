"""The environments' preflight (``agent_trainer.checks.preflight``): before Ray starts, the driver builds, resets
and steps every training and validation tag, and refuses a broken env in one line naming the tag, the call,
what came back and the fix.

Each broken env is a tiny class in this file, registered the way a user registers one: a tags file whose
``env_type`` is its import path, passed as ``envs_file``; the config goes through ``compose_and_prepare``, what
``python -m agent_trainer.main`` runs before ``ray.init``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import yaml

from agent_trainer.checks.prepare import compose_and_prepare
from envs import BaseEnv, make_info

HERE = "tests.agent_trainer.test_env_preflight"


class GoodEnv(BaseEnv):
    """A well-behaved two-action game; the broken ones below change one thing each."""

    def reset(self, seed=None, **kwargs):
        self.t = 0
        return self.render()

    def step(self, action):
        valid = action.strip() in ("Go", "Stay")
        self.t += int(valid)
        return self.render(), float(valid), self.t >= 2, self.info(valid)

    def info(self, valid):
        return make_info(self.t >= 2, valid, valid)

    def render(self):
        return f"t = {self.t}"

    def action_description(self):
        return "Go | Stay"


class NoSuccessEnv(GoodEnv):
    """Forgot make_info: no success key."""

    def info(self, valid):
        return {"action_is_valid": valid, "action_is_effective": valid}


class NoValidityEnv(GoodEnv):
    def info(self, valid):
        return {"success": self.t >= 2, "action_is_effective": valid}


class NoEffectiveEnv(GoodEnv):
    """Only a metric is missing: a warning, not a refusal."""

    def info(self, valid):
        return {"success": self.t >= 2, "action_is_valid": valid}


class ThreeTupleEnv(GoodEnv):
    """A valid action returns (obs, reward, done): the preflight's valid steps find it."""

    def step(self, action):
        obs, reward, done, _ = super().step(action)
        return (obs, reward, done) if action == "Go" else (obs, reward, done, self.info(False))


class StrRewardOnJunkEnv(GoodEnv):
    """Text it cannot parse earns the reward "0": only the junk steps find it."""

    def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs, reward if info["action_is_valid"] else "0", done, info


class IntObservationEnv(GoodEnv):
    def step(self, action):
        _, reward, done, info = super().step(action)
        return self.t, reward, done, info


class StrDoneEnv(GoodEnv):
    def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs, reward, "yes" if done else "no", info


class NoneInfoEnv(GoodEnv):
    def info(self, valid):
        return None


class DictResetEnv(GoodEnv):
    def reset(self, seed=None, **kwargs):
        super().reset(seed)
        return {"text": self.render()}


class RaisesOnJunkEnv(GoodEnv):
    def step(self, action):
        if action.strip() not in ("Go", "Stay"):
            raise KeyError(action)
        return super().step(action)


class BrokenInitEnv(GoodEnv):
    def __init__(self, config=None):
        raise RuntimeError("no licence server")


class HangsOnStepEnv(GoodEnv):
    def step(self, action):
        time.sleep(30)
        return super().step(action)


@pytest.fixture(autouse=True)
def _model(tiny_model_path):
    global MODEL
    MODEL = tiny_model_path


MODEL = ""
"""The tiny model's folder (set for each test)."""


def _prepare(tmp_path, env_class: str, *overrides: str):
    """compose_and_prepare on frozenlake with one tag, Mine (``env_class`` of this file), in both splits."""
    tags = {"custom_envs": {"Mine": {"env_type": f"{HERE}:{env_class}", "max_actions_per_traj": 4,
                                     "env_instruction": "Go or stay.", "max_tokens": 20}}}
    path = tmp_path / "my_envs.yaml"
    path.write_text(yaml.safe_dump(tags))
    return compose_and_prepare([f"model_path={MODEL}", f"envs_file={path}",
                                "es_manager.train.env_configs.tags=[Mine]",
                                "es_manager.val.env_configs.tags=[Mine]", *overrides])


def _refusal(tmp_path, env_class: str, *overrides: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        _prepare(tmp_path, env_class, *overrides)
    line = str(exit_.value.code)
    assert "\n" not in line and line.startswith("agent-trainer: env tag 'Mine' (") and env_class in line
    return line


def test_a_good_env_passes_and_the_shipped_config_reports_its_seconds(tmp_path, tiny_model_path):
    cfg, _ = _prepare(tmp_path, "GoodEnv")
    assert cfg.es_manager.train.env_configs.tags == ["Mine"]
    from agent_trainer.checks.preflight import preflight_envs

    cfg, tags = compose_and_prepare([f"model_path={tiny_model_path}"])  # config/frozenlake.yaml: FrozenLakeDescribed in both splits
    seconds = preflight_envs(cfg, tags)
    # each tag's seconds are reported (their size is measured in the docs, not bounded here: load stretches it)
    assert list(seconds) == ["FrozenLakeDescribed"] and seconds["FrozenLakeDescribed"] > 0


def test_info_without_success_is_refused(tmp_path):
    line = _refusal(tmp_path, "NoSuccessEnv")
    assert "step('Go') returned info without 'success'" in line
    assert "['action_is_effective', 'action_is_valid']" in line and "envs.make_info(" in line


def test_info_without_action_is_valid_is_refused(tmp_path):
    line = _refusal(tmp_path, "NoValidityEnv")
    assert "returned info without 'action_is_valid'" in line and "envs.make_info(" in line


def test_info_without_action_is_effective_is_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="agent_trainer.checks.preflight"):
        _prepare(tmp_path, "NoEffectiveEnv")
    warnings = [r.getMessage() for r in caplog.records if "action_is_effective" in r.getMessage()]
    assert len(warnings) == 1 and "env tag 'Mine'" in warnings[0] and "reads 0" in warnings[0]


def test_a_step_returning_three_items_is_refused(tmp_path):
    line = _refusal(tmp_path, "ThreeTupleEnv")
    assert "step('Go') returned a tuple of 3 items: ('t = 1', 1.0, False)" in line
    assert "step must return (observation: str, reward: float, done: bool, info: dict)" in line


def test_a_str_reward_is_refused(tmp_path):
    line = _refusal(tmp_path, "StrRewardOnJunkEnv")
    assert "step('') returned a reward of type str ('0')" in line and "must be a number" in line


def test_a_non_str_observation_is_refused(tmp_path):
    line = _refusal(tmp_path, "IntObservationEnv")
    assert "step('Go') returned an observation of type int (1)" in line


def test_a_done_that_is_no_bool_is_refused(tmp_path):
    line = _refusal(tmp_path, "StrDoneEnv")
    assert "step('Go') returned done of type str ('no'); done must be a bool" in line


def test_an_info_that_is_no_dict_is_refused(tmp_path):
    line = _refusal(tmp_path, "NoneInfoEnv")
    assert "step('Go') returned info of type NoneType (None)" in line and "envs.make_info(" in line


def test_a_reset_that_returns_no_str_is_refused(tmp_path):
    line = _refusal(tmp_path, "DictResetEnv")
    assert "reset(seed=0) returned {'text': 't = 0'}, not the first observation as a str" in line


def test_an_exception_on_junk_text_is_refused(tmp_path):
    line = _refusal(tmp_path, "RaisesOnJunkEnv")
    assert "step('') raised KeyError: ''" in line and "step must take any str" in line


def test_an_exception_in_the_constructor_is_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        _prepare(tmp_path, "BrokenInitEnv")
    line = str(exit_.value.code)
    assert line == ("agent-trainer: env tag 'Mine': the constructor (envs.make_env) raised RuntimeError: no licence "
                    "server; fix the env's __init__ or the tag's env_config")


def test_a_step_that_hangs_is_refused_at_the_step_deadline(tmp_path):
    start = time.monotonic()
    line = _refusal(tmp_path, "HangsOnStepEnv", "es_manager.env_step_timeout_s=1")
    assert "step('Go') did not return within 1 s" in line and time.monotonic() - start < 20


def test_preflight_false_skips_it(tmp_path):
    cfg, _ = _prepare(tmp_path, "NoSuccessEnv", "es_manager.preflight=false")
    assert cfg.es_manager.preflight is False


def test_the_command_line_exits_with_the_one_line_before_ray_starts(tmp_path, tiny_model_path):
    tags = {"custom_envs": {"Mine": {"env_type": f"{HERE}:NoSuccessEnv", "max_actions_per_traj": 4,
                                     "env_instruction": "Go or stay.", "max_tokens": 20}}}
    (tmp_path / "my_envs.yaml").write_text(yaml.safe_dump(tags))
    out = subprocess.run([sys.executable, "-m", "agent_trainer.main", f"model_path={tiny_model_path}",
                          f"envs_file={tmp_path / 'my_envs.yaml'}",
                          "es_manager.train.env_configs.tags=[Mine]", "es_manager.val.env_configs.tags=[Mine]",
                          f"trainer.default_local_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("agent-trainer: env tag 'Mine'") and "without 'success'" in last
    assert "Ray dashboard" not in out.stderr + out.stdout  # refused before ray.init
