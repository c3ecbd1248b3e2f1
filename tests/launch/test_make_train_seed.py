"""``make train SEED=s``: the pipeline seed reaches the model build, the SFT warm start and the RL run, and each
seed writes its own folders (read from ``make -n``, the commands make would run, then composed as they would be)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.sft import compose_sft

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def python_commands(target: str, seed: int) -> list[tuple[str, list[str]]]:
    """(module or script, arguments) of each python command ``make <target> SEED=seed`` runs, in order (the command
    after ``||`` of a ``test ... || command`` line included)."""
    out = subprocess.run(["make", "-n", "-B", target, f"SEED={seed}"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    commands = []
    for line in out.replace("\\\n", " ").splitlines():
        words = shlex.split(line.replace('"$(cat .venv/.train-started)"', "0").split(" || ")[-1])
        if not words or not words[0].endswith("python"):
            continue
        name = words[2] if words[1] == "-m" else words[1]
        commands.append((name, words[3:] if words[1] == "-m" else words[2:]))
    return commands


def planned(seed: int) -> dict[str, list[str]]:
    """The arguments of each python command ``make train SEED=seed`` runs, by module (or script)."""
    return dict(python_commands("train", seed))


def _value(args: list[str], key: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(key + "=")]
    return value


def test_seed_reaches_the_model_build_the_sft_and_the_rl(tiny_model_path):
    seed = 7
    cmd = planned(seed)
    build, sft, rl = cmd["launch.build_tiny_model"], cmd["agent_trainer.sft"], cmd["agent_trainer.main"]
    assert build[build.index("--seed") + 1] == "7"
    assert build[build.index("--out") + 1] == "models/tiny-qwen2-train-seed7"
    assert float(build[build.index("--noted-weight") + 1]) > 1  # the copy of the note is taught on most transcripts
    assert _value(sft, "model_path") == "models/tiny-qwen2-train-seed7"
    sft_dir = _value(sft, "trainer.default_local_dir")
    assert _value(rl, "model_path") == f"{sft_dir}/final"
    # The SFT composes with those arguments: its demonstrations, batch order and validation seeds follow the seed.
    sft_args = [a for a in sft if not a.startswith(("--config-name", "sft_"))]
    sft_args = [a for a in sft_args if not a.startswith("model_path=")] + [f"model_path={tiny_model_path}",
                                                                           "data.num_episodes=10"]
    run = compose_sft(sft[sft.index("--config-name") + 1], sft_args)
    assert run.cfg.data.seed == 7000 and run.cfg.trainer.seed == 7 and run.rl.trainer.seed == 7
    assert {d.seed for part in run.data.demos.values() for d in part} == set(range(7000, 7010))
    # The RL run and the report: the run's seed (the engine, the env seeds, the held-out seeds) is the pipeline's.
    rl_args = [a for a in rl if not a.startswith(("--config-name", "frozenlake", "model_path="))]
    cfg, _ = compose_and_prepare([*rl_args, f"model_path={tiny_model_path}"],
                                 config_name=rl[rl.index("--config-name") + 1])
    assert cfg.trainer.seed == 7 and cfg.es_manager.seed == 7
    assert _value(cmd["launch.warm_start_report"], "trainer.seed") == "7"
    assert _value(cmd["bench/baselines.py"], "trainer.seed") == "7"
    # the table composes without make test's model: a fresh clone's make train builds only its own
    assert _value(cmd["bench/baselines.py"], "model_path") == f"{sft_dir}/final"
    assert cmd["bench/baselines.py"][cmd["bench/baselines.py"].index("--rl-dir") + 1] == cfg.trainer.default_local_dir


def test_seeds_never_share_a_folder():
    zero, three = planned(0), planned(3)
    assert _value(zero["agent_trainer.sft"], "model_path") == "models/tiny-qwen2-train-seed0"
    for key, module in (("trainer.default_local_dir", "agent_trainer.sft"),
                        ("trainer.default_local_dir", "agent_trainer.main"), ("model_path", "agent_trainer.sft")):
        assert _value(zero[module], key) != _value(three[module], key)


def test_make_distill_wires_the_teacher_the_student_the_rl_run_and_the_table(tiny_model_path):
    """make distill SEED=s: the teacher is an SFT of the noting reader on make train's model, checked before it
    teaches; the student is make train's warm start; RL is make train's own run; the table reads all three."""
    cmd = python_commands("distill", 5)
    sfts = {_value(args, "trainer.default_local_dir"): args for name, args in cmd if name == "agent_trainer.sft"}
    [(student_dir, student), (teacher_dir, teacher)] = sorted(sfts.items(), key=lambda kv: "reader" in kv[0])
    assert student[student.index("--config-name") + 1] == "sft_frozenlake_nodeadends"
    assert teacher[teacher.index("--config-name") + 1] == "sft_frozenlake_reader"
    for args in (student, teacher):
        assert _value(args, "model_path") == "models/tiny-qwen2-train-seed5" and _value(args, "trainer.seed") == "5"
    assert student_dir == _value(planned(5)["agent_trainer.sft"], "trainer.default_local_dir")  # make train's start
    runs = [args for name, args in cmd if name == "agent_trainer.main"]
    [distill] = [a for a in runs if a[a.index("--config-name") + 1] == "frozenlake_distill"]
    [rl] = [a for a in runs if a is not distill]
    assert rl == planned(5)["agent_trainer.main"]  # make train's RL run, the same command
    assert _value(distill, "model_path") == _value(rl, "model_path") == f"{student_dir}/final"
    assert _value(distill, "algorithm.distill.teacher_path") == f"{teacher_dir}/final"
    reports = [args for name, args in cmd if name == "bench/baselines.py"]
    assert reports[0][reports[0].index("--check-teacher") + 1] == teacher_dir  # checked before the distillation run
    assert [name for name, _ in cmd].index("bench/baselines.py") < [a for _, a in cmd].index(distill)
    table = reports[-1]
    assert table[table.index("--distill-dir") + 1] == _value(distill, "trainer.default_local_dir")
    assert table[table.index("--teacher-dir") + 1] == teacher_dir
    assert table[table.index("--rl-dir") + 1] == _value(rl, "trainer.default_local_dir")
    # The distillation run composes with those arguments, on the pipeline's seed (the held-out maps of the table).
    args = [a for a in distill if not a.startswith(("--config-name", "frozenlake", "model_path=", "algorithm.distill"))]
    cfg, _ = compose_and_prepare([*args, f"model_path={tiny_model_path}",
                                  f"algorithm.distill.teacher_path={tiny_model_path}"], config_name="frozenlake_distill")
    assert cfg.algorithm.distill.enable and cfg.algorithm.distill.mode == "advantage"
    assert cfg.trainer.seed == cfg.es_manager.seed == 5
    rl_cfg, _ = compose_and_prepare([a for a in rl if not a.startswith(("--config-name", "frozenlake", "model_path="))]
                                    + [f"model_path={tiny_model_path}"], config_name="frozenlake_nodeadends")
    assert cfg.es_manager.val == rl_cfg.es_manager.val and cfg.es_manager.train == rl_cfg.es_manager.train
