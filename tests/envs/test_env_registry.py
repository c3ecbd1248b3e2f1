"""Registry, config validation and env tags."""

import subprocess
import sys
from dataclasses import dataclass

import pytest

import envs
from envs import BaseEnv, EnvTagConfig, load_env_tags, make_env, make_info, parse_env_tags, register_env


@dataclass
class EchoConfig:
    """Config of a tiny test env."""

    word: str = "hi"
    repeat: int = 1

    def __post_init__(self):
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")


class EchoEnv(BaseEnv):
    """Succeeds when the action equals the configured word."""

    config_cls = EchoConfig

    def reset(self, seed=None, **kwargs):
        self.done = False
        return self.render()

    def step(self, action):
        ok = action == self.config.word
        self.done = self.done or ok
        return self.render(), float(ok), self.done, make_info(ok, ok, ok)

    def render(self):
        return f"say {self.config.word}" * self.config.repeat

    def action_description(self):
        return self.config.word


def test_register_and_make_custom_env():
    register_env("echo_test", EchoEnv)
    assert "echo_test" in envs.list_envs()
    env = make_env("echo_test", word="yo", repeat=2)
    assert env.reset(seed=0) == "say yosay yo"
    assert env.step("yo")[1:3] == (1.0, True)


def test_unknown_name_lists_registered_envs():
    with pytest.raises(ValueError, match="registered environments: .*frozen_lake"):
        make_env("no_such_env", tags={})


def test_unknown_and_bad_fields_are_named():
    register_env("echo_test", EchoEnv)
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['wrd'\]; allowed fields: \['repeat', 'word'\]"):
        make_env("echo_test", wrd="x")
    with pytest.raises(ValueError, match=r"repeat = 'two' has type str; expected int"):
        make_env("echo_test", repeat="two")
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        make_env("echo_test", repeat=0)


def test_tags_from_mappings_and_yaml(tmp_path):
    register_env("echo_test", EchoEnv)
    tags = {"Echo": {"env_type": "echo_test", "max_actions_per_traj": 3, "env_config": {"word": "ok"}}}
    env = make_env("Echo", tags=tags)
    assert env.config.word == "ok"
    assert make_env("Echo", tags=tags, word="over").config.word == "over"
    path = tmp_path / "envs.yaml"
    path.write_text("custom_envs:\n  Echo:\n    env_type: echo_test\n    env_config: null\n")
    loaded = load_env_tags(path)
    assert loaded["Echo"] == EnvTagConfig(env_type="echo_test")


@pytest.mark.parametrize("tag, match", [
    ({"env_type": "nope"}, "unknown env_type 'nope'; registered environments"),
    ({"env_type": "echo_test", "max_turns": 3}, r"unknown field\(s\) \['max_turns'\]"),
    ({"env_type": "echo_test", "env_config": {"x": 1}}, r"unknown config field\(s\) \['x'\]"),
    ({"env_type": "echo_test", "max_actions_per_traj": 0}, "max_actions_per_traj must be a positive int"),
    ({"max_tokens": 5}, "has no env_type"),
])
def test_bad_tags_raise_with_names(tag, match):
    register_env("echo_test", EchoEnv)
    with pytest.raises(ValueError, match=match):
        EnvTagConfig.from_dict("Bad", tag)


def test_shipped_tags_are_valid_and_make_envs():
    tags = load_env_tags()
    assert "FrozenLake" in tags
    for name, tag in tags.items():
        assert tag.env_type in envs.list_envs(), name


def test_import_envs_is_lazy_and_missing_dependency_fails_only_when_made(tmp_path, monkeypatch):
    code = "import sys, envs; print('gymnasium' in sys.modules, 'ray' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
    (tmp_path / "env_with_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_env("needs_missing_dep", "env_with_missing_dep:Env")
    with pytest.raises(ImportError, match="needs_missing_dep.*missing dependency"):
        make_env("needs_missing_dep")


def test_a_module_that_is_not_on_the_path_names_the_path_fix():
    register_env("not_on_path", "no_such_module_xyz:Env")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module_xyz'.*PYTHONPATH"):
        make_env("not_on_path")


def test_an_env_class_with_abstract_methods_left_is_refused_naming_them(tmp_path, monkeypatch):
    (tmp_path / "half_env.py").write_text(
        "from envs import BaseEnv\n"
        "class HalfEnv(BaseEnv):\n"
        "    def reset(self, seed=None, **kw): return ''\n"
        "    def step(self, action): return '', 0.0, True, {}\n"
        "    def render(self): return ''\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"class HalfEnv does not implement action_description; define "
                                         r"action_description\(\)"):
        parse_env_tags({"Half": {"env_type": "half_env:HalfEnv"}})


def test_a_misspelt_env_type_or_tag_names_the_close_names():
    with pytest.raises(ValueError, match=r"unknown env_type 'frozen_lak'; did you mean 'frozen_lake'"):
        parse_env_tags({"T": {"env_type": "frozen_lak"}})
    with pytest.raises(ValueError, match=r"unknown environment or tag 'FrozenLak'; did you mean 'FrozenLake'"):
        make_env("FrozenLak")
    with pytest.raises(ValueError, match=r"env tag 'T': unknown env_type 'envs.frozen_lake.FrozenLakeEnv'; did you "
                                         r"mean 'envs.frozen_lake:FrozenLakeEnv'\? \(an import path is written"):
        parse_env_tags({"T": {"env_type": "envs.frozen_lake.FrozenLakeEnv"}})
