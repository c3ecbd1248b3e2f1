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


def planned(seed: int) -> dict[str, list[str]]:
    """The arguments of each python command ``make train SEED=seed`` runs, by module (or script)."""
    out = subprocess.run(["make", "-n", "-B", "train", f"SEED={seed}"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    commands: dict[str, list[str]] = {}
    for line in out.replace("\\\n", " ").splitlines():
        words = shlex.split(line.replace('"$(cat .venv/.train-started)"', "0"))
        if not words or not words[0].endswith("python"):
            continue
        name = words[2] if words[1] == "-m" else words[1]
        commands[name] = words[3:] if words[1] == "-m" else words[2:]
    return commands


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
