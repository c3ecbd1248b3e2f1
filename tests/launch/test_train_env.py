"""``make train-env ENVS=<tags file> TAG=<tag>`` (launch/train_env.py): make train's recipe on a user's own env.

The steps' commands compose as they would run (the SFT with its demonstrations of the tag, the RL run and the
table on the tag's held-out seeds with the tag's turn limit); mistakes are refused in one line; a step is reused
only when made by the same command from the same tags file and env module. The recipe itself runs end to end in
tests/test_first_hour_doc.py (the guide's command at a small size).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.sft import compose_sft
from launch import train_env

REPO = Path(__file__).resolve().parents[2]
THERMOSTAT = REPO / "examples" / "thermostat"
ENVS = THERMOSTAT / "thermostat_envs.yaml"


def _value(args: list[str], key: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(key + "=")]
    return value


def steps(tmp_path: Path, seed: int = 3, **kwargs) -> dict[str, tuple[list[str], Path | None]]:
    return {name: (argv, folder) for name, argv, folder in
            train_env.commands(ENVS, "Thermostat", seed, out_dir=tmp_path, **kwargs)}


def test_the_steps_compose_on_the_tag_with_the_pipeline_seed(tmp_path, tiny_model_path):
    cmd = steps(tmp_path, noise=0.5, rl_overrides=["trainer.total_training_steps=5"])
    build, _ = cmd["the model that knows the env"]
    assert build[build.index("--seed") + 1] == "3" and build[build.index("--add-envs-config") + 1] == str(ENVS)
    model = build[build.index("--out") + 1]
    assert model == str(tmp_path / "models" / "tiny-qwen2-thermostat_envs-seed3")
    sft, sft_dir = cmd["the warm start"]
    assert _value(sft, "model_path") == model and _value(sft, "trainer.default_local_dir") == str(sft_dir)
    # The SFT composes: expert demonstrations of the tag, 25% -> 50% random moves, the tag's turn limit.
    args = [a for a in sft[sft.index("--config-name") + 2:] if not a.startswith("model_path=")]
    run = compose_sft("sft_env_recipe", [*args, f"model_path={tiny_model_path}", "data.num_episodes=8"])
    assert run.cfg.data.demonstrator == "expert" and run.cfg.data.noise == 0.5 and run.cfg.data.seed == 3000
    assert run.rl.es_manager.train.tags == ["Thermostat"] and run.rl.agent_proxy.max_turn == 4
    assert {d.seed for part in run.data.demos.values() for d in part} == set(range(3000, 3008))
    # RL: from the warm start, on the tag's held-out seeds, the pipeline's seed, the user's overrides last.
    rl, _ = cmd["RL"]
    assert _value(rl, "model_path") == f"{sft_dir}/final"
    args = [a for a in rl[rl.index("--config-name") + 2:] if not a.startswith("model_path=")]
    cfg, env_tags = compose_and_prepare([*args, f"model_path={tiny_model_path}"], config_name="env_recipe")
    assert cfg.es_manager.train.tags == cfg.es_manager.val.tags == ["Thermostat"] and "Thermostat" in env_tags
    assert cfg.trainer.seed == 3 and cfg.trainer.total_training_steps == 5 and cfg.es_manager.val.env_groups == 128
    assert cfg.algorithm.adv_estimator == "gigpo" and cfg.trainer.val_before_train
    table, _ = cmd["the held-out table"]
    assert table[table.index("--rl-dir") + 1] == cfg.trainer.default_local_dir
    assert table[table.index("--sft-dir") + 1] == str(sft_dir)


def test_mistakes_are_refused_in_one_line(tmp_path, capsys):
    assert train_env.main(["--envs-file", str(ENVS), "--tag", "Thermo", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "TAG='Thermo' is not a tag of" in err and "['Thermostat']" in err and len(err.splitlines()) == 1
    assert train_env.main(["--envs-file", str(tmp_path / "none.yaml"), "--tag", "Thermostat"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert train_env.main(["--envs-file", str(ENVS), "--tag", "Thermostat", "--noise", "1.5"]) == 2
    assert "NOISE=1.5" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_train_env_without_envs_or_tag_says_what_to_set():
    proc = subprocess.run(["make", "-o", "install", "-o", "train-clock", "train-env", "TAG=Thermostat"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "make train-env needs ENVS=<your tags file> TAG=<its tag>" in proc.stdout + proc.stderr


def test_a_step_is_reused_only_from_the_same_command_and_inputs(tmp_path):
    project = tmp_path / "thermostat"
    shutil.copytree(THERMOSTAT, project, ignore=shutil.ignore_patterns("__pycache__"))
    envs = project / "thermostat_envs.yaml"
    digest = train_env.inputs_digest(envs, "Thermostat")
    folder = tmp_path / "made"
    folder.mkdir()
    stamp = {"argv": ["-m", "launch.build_tiny_model", "--seed", "0"], "inputs": digest}
    assert not train_env.reusable(folder, stamp)  # no stamp: a step that did not finish
    (folder / train_env.STAMP).write_text(__import__("json").dumps(stamp))
    assert train_env.reusable(folder, stamp)
    assert not train_env.reusable(folder, {**stamp, "argv": ["-m", "launch.build_tiny_model", "--seed", "1"]})
    module = project / "my_rooms" / "thermostat.py"
    module.write_text(module.read_text().replace('"The room is too hot."', '"The room is far too hot."'))
    assert train_env.inputs_digest(envs, "Thermostat") != digest  # the env's code changed: made again


def test_a_remade_model_remakes_the_warm_start_and_a_finished_recipe_reruns_only_rl(tmp_path, monkeypatch):
    """The steps' order of reuse (the commands themselves run in tests/test_first_hour_doc.py): here each command
    only records itself and makes its folder."""
    ran: list[str] = []

    def call(argv, cwd, env):
        ran.append(argv[2] if argv[1] == "-m" else Path(argv[1]).name)
        made = [argv[argv.index("--out") + 1]] if "--out" in argv else []
        made += [a.split("=", 1)[1] for a in argv if a.startswith("trainer.default_local_dir=")]
        for folder in made:
            Path(folder).mkdir(parents=True, exist_ok=True)
        return 0

    monkeypatch.setattr(train_env.subprocess, "call", call)
    args = ["--envs-file", str(ENVS), "--tag", "Thermostat", "--out-dir", str(tmp_path)]
    folders = train_env.paths(ENVS, "Thermostat", 0, tmp_path)
    for key in ("model", "sft"):
        folders[key].mkdir(parents=True)
    assert train_env.main(args) == 0
    everything = ["launch.build_tiny_model", "agent_trainer.sft", "launch.warm_start_report", "agent_trainer.main",
                  "baselines.py"]
    assert ran == everything  # folders without stamps: made again
    ran.clear()
    assert train_env.main(args) == 0
    assert ran == everything[2:]  # both stamped: reused
    ran.clear()
    stamp = folders["model"] / train_env.STAMP
    stamp.write_text(stamp.read_text().replace('"--seed"', '"--seed "'))  # made by another command
    assert train_env.main(args) == 0
    assert ran == everything  # the model remade, so the warm start too
