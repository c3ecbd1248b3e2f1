"""One command-line convention for the three entry points: --config-name NAME and key=value overrides, --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent_trainer.cli_args import Args, parse_args

REPO = Path(__file__).resolve().parents[2]


def test_config_name_spellings_overrides_and_help():
    assert parse_args(["--config-name", "sokoban", "eval.k=2"], "frozenlake") == Args("sokoban", ["eval.k=2"])
    assert parse_args(["--config-name=sokoban", "a=1", "b=2"], "frozenlake") == Args("sokoban", ["a=1", "b=2"])
    assert parse_args(["-cn", "sft_frozenlake", "+x=1"], "frozenlake") == Args("sft_frozenlake", ["+x=1"])
    assert parse_args([], "sft_frozenlake") == Args("sft_frozenlake", [])
    assert parse_args(["a=1", "-h"], "frozenlake") == Args("frozenlake", ["a=1"], help=True)


@pytest.mark.parametrize("argv, message", [
    (["--cfg", "job"], "--cfg is not an option here; give --config-name NAME and key=value overrides"),
    (["--config-name"], "--config-name needs a config name, e.g. --config-name frozenlake"),
    (["-cn", "a=1"], "-cn needs a config name"),
])
def test_other_options_are_refused_in_one_line(argv, message):
    with pytest.raises(ValueError) as err:
        parse_args(argv, "frozenlake")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("entry, config_key", [("eval", "eval:"), ("sft", "rl_config: frozenlake"),
                                               ("main", "actor_rollout_ref:")])
def test_help_exits_0_with_the_usage_and_the_composed_config(entry, config_key):
    run = subprocess.run([sys.executable, "-m", f"agent_trainer.{entry}", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    head = "== --config-name choices" if entry == "main" else f"usage: python -m agent_trainer.{entry} [--config-name"
    assert run.stdout.startswith(head) and config_key in run.stdout


def test_a_wrong_option_exits_non_zero_with_one_line():
    run = subprocess.run([sys.executable, "-m", "agent_trainer.eval", "--cfg", "job"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        "agent-trainer eval: --cfg is not an option here; give --config-name NAME and key=value overrides "
        "(--help shows them and the config they compose to)"]
