"""``python -m agent_trainer.check_env``: a user's own environment, outside the repository, checked against the env
contract and the preflight (docs/writing_an_environment.md, "Check it"); and the class-path errors of its tags."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent_trainer.check_env import check_tags

REPO = Path(__file__).resolve().parents[2]

USER_ENV = textwrap.dedent('''
    from dataclasses import dataclass

    from envs import BaseEnv, make_info


    @dataclass
    class CounterConfig:
        target: int = 3


    class CounterEnv(BaseEnv):
        """Say 'up' until the counter reaches the target."""

        config_cls = CounterConfig

        def reset(self, seed=None, **kwargs):
            self.count, self.done = 0, False
            return self.render()

        def step(self, action):
            valid = isinstance(action, str) and action.strip() == "up"
            if valid and not self.done:
                self.count += 1
                self.done = self.count >= self.config.target
            return self.render(), float(self.done and valid), self.done, make_info(self.done, valid, valid)

        def render(self):
            return f"count {self.count} of {self.config.target}"

        def action_description(self):
            return "up"

        def expert_action(self):
            return "up"


    class NoSuccessEnv(CounterEnv):
        """Forgets success in info."""

        def step(self, action):
            obs, reward, done, info = super().step(action)
            return obs, reward, done, {"action_is_valid": info["action_is_valid"]}


    class HangsEnv(CounterEnv):
        """Never returns from a step on an empty string."""

        def step(self, action):
            if action == "":
                import time
                time.sleep(3600)
            return super().step(action)
''')

TAGS = textwrap.dedent('''
    custom_envs:
      Counter:
        env_type: mygames.counter:CounterEnv
        env_config: {target: 3}
      NoSuccess:
        env_type: mygames.counter:NoSuccessEnv
      Typo:
        env_type: mygames.countr:CounterEnv
      NoClass:
        env_type: mygames.counter:CountEnv
      Dotted:
        env_type: mygames.counter.CounterEnv
      Hangs:
        env_type: mygames.counter:HangsEnv
''')


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    """A user's project outside the repository: a package with an env module and its own tags file."""
    (tmp_path / "mygames").mkdir()
    (tmp_path / "mygames" / "__init__.py").write_text("")
    (tmp_path / "mygames" / "counter.py").write_text(USER_ENV)
    (tmp_path / "my_envs.yaml").write_text(TAGS)
    return tmp_path


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "agent_trainer.check_env", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_help_works(tmp_path):
    run = run_cli(tmp_path, "--help")
    assert run.returncode == 0, run.stderr
    assert "--envs-file" in run.stdout and "--tag" in run.stdout


def test_good_user_env_passes_and_a_broken_one_is_refused_naming_tag_and_fix(user_project):
    good = run_cli(user_project, "--envs-file", "my_envs.yaml", "--tag", "Counter", "--junk", "200")
    assert good.returncode == 0, good.stdout + good.stderr
    lines = good.stdout.splitlines()
    assert lines[-1].startswith("8 of 8 checks passed")
    assert all(line.startswith("PASS  Counter: ") for line in lines[:-1])
    assert any("reset is deterministic" in line for line in lines)
    assert any("preflight" in line for line in lines)

    bad = run_cli(user_project, "--envs-file", "my_envs.yaml", "--tag", "Counter", "--tag", "NoSuccess",
                  "--junk", "200")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    failures = [line for line in bad.stdout.splitlines() if line.startswith("FAIL")]
    assert failures and all(line.startswith("FAIL  NoSuccess: ") for line in failures)
    assert any("info without 'success'" in line and "envs.make_info(" in line for line in failures)
    assert "failing tags: NoSuccess" in bad.stdout.splitlines()[-1]


def test_a_step_that_hangs_is_refused_by_the_preflight_deadline_and_checked_no_further(user_project):
    run = run_cli(user_project, "--envs-file", "my_envs.yaml", "--tag", "Hangs", "--timeout-s", "2")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("2 of 3 checks passed")  # load, build, preflight
    assert lines[2].startswith("FAIL  Hangs: preflight") and "step('') did not return within 2 s" in lines[2]


def test_a_tag_not_in_the_file_is_one_failure_with_close_names(user_project):
    run = run_cli(user_project, "--envs-file", "my_envs.yaml", "--tag", "Countr")
    assert run.returncode == 1
    assert "FAIL  Countr: tag in the envs file: my_envs.yaml has no tag 'Countr'; did you mean 'Counter'" in run.stdout


def test_a_missing_envs_file_is_a_usage_error(tmp_path):
    run = run_cli(tmp_path, "--envs-file", "nope.yaml")
    assert run.returncode == 2 and "--envs-file 'nope.yaml' is not a file" in run.stderr


@pytest.mark.parametrize("tag, expected", [
    ("Typo", ["env tag 'Typo'", "cannot import module 'mygames.countr'", "did you mean module 'mygames.counter'?"]),
    ("NoClass", ["env tag 'NoClass'", "module 'mygames.counter' has no attribute 'CountEnv'",
                 "did you mean 'mygames.counter:CounterEnv'", "'NoSuccessEnv'"]),
    ("Dotted", ["env tag 'Dotted'", "unknown env_type 'mygames.counter.CounterEnv'", "did you mean 'mygames.counter:CounterEnv'?",
                "'package.module:ClassName'"]),
])
def test_wrong_class_paths_are_refused_in_one_line_with_close_names(user_project, monkeypatch, tag, expected):
    monkeypatch.chdir(user_project)
    monkeypatch.syspath_prepend(str(user_project))
    [result] = check_tags("my_envs.yaml", [tag])
    assert not result.ok and "\n" not in result.detail
    for text in expected:
        assert text in result.detail, result.detail


@pytest.mark.parametrize("path, expected", [
    ("envs.frozen_lak:FrozenLakeEnv", "did you mean module 'envs.frozen_lake'?"),
    ("envz.frozen_lake:FrozenLakeEnv", "'envs'"),
    ("envs.frozen_lake:FrozenLakEnv", "did you mean 'envs.frozen_lake:FrozenLakeEnv'?"),
    ("envs.frozen_lake.FrozenLakeEnv", "did you mean 'envs.frozen_lake:FrozenLakeEnv'?"),
])
def test_plugin_class_paths_suggest_close_names(path, expected):
    from agent_trainer.common.plugins import PluginRegistry
    from envs import BaseEnv

    registry = PluginRegistry(BaseEnv, "some.key")
    with pytest.raises(ValueError) as err:
        registry.get(path)
    message = str(err.value)
    assert expected in message and "\n" not in message and message.startswith(f"some.key = {path!r}")


def test_the_tags_files_folder_is_on_the_import_path_from_any_directory(user_project, tmp_path_factory):
    """As ``make model ENVS=`` does: started from another folder, the tag's module imports from beside the file."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    run = run_cli(elsewhere, "--envs-file", str(user_project / "my_envs.yaml"), "--tag", "Counter", "--junk", "50")
    assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith("8 of 8 checks passed"), \
        run.stdout + run.stderr


def test_a_module_found_nowhere_is_named_with_where_it_was_looked_for_and_no_unrelated_module(tmp_path):
    """A package that is in no folder of the import path: the message names it, the file and folder looked for and
    the folders searched (the tags file's among them), and suggests no standard library module ('termios')."""
    (tmp_path / "my_envs.yaml").write_text("custom_envs:\n  MyGuess:\n    env_type: my_games.guess:GuessNumberEnv\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = run_cli(elsewhere, "--envs-file", str(tmp_path / "my_envs.yaml"))
    [line] = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert "cannot import module 'my_games.guess' (no file my_games.py and no folder my_games/ in the folders " \
           "searched: [" in line and repr(str(tmp_path.resolve())) in line and repr(str(elsewhere.resolve())) in line
    assert "termios" not in line and "did you mean" not in line, line


def test_a_training_run_imports_the_tags_module_from_beside_its_file(user_project, tmp_path_factory, monkeypatch,
                                                                      tiny_model_path):
    """``agent_trainer.main``'s checks (tags loaded, preflight) from another folder: the tags file's folder is on the
    driver's import path, and on the workers' PYTHONPATH."""
    from agent_trainer.checks.prepare import compose_and_prepare
    from agent_trainer.ray_cluster import worker_pythonpath

    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "mygames", raising=False)
    monkeypatch.delitem(sys.modules, "mygames.counter", raising=False)
    tags_file = str(user_project / "counter_envs.yaml")  # the fixture's file holds broken tags: a run loads them all
    Path(tags_file).write_text("custom_envs:\n  Counter:\n    env_type: mygames.counter:CounterEnv\n")
    _, env_tags = compose_and_prepare([f"model_path={tiny_model_path}", f"envs_file={tags_file}",
                                       "es_manager.train.env_configs.tags=[Counter]",
                                       "es_manager.val.env_configs.tags=[Counter]"])
    assert env_tags["Counter"].env_type == "mygames.counter:CounterEnv"
    assert str(user_project.resolve()) in worker_pythonpath(tags_file).split(os.pathsep)
