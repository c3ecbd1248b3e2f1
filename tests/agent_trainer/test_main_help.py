"""``python -m agent_trainer.main``: ``--help`` names the ``--config-name`` choices first, and hydra's own output
folder goes in the run folder, never in an ``outputs/<date>/<time>/`` folder of the working directory; a run refused
before it starts leaves no folder. No Ray starts."""

import os
import re
import subprocess
import sys
from pathlib import Path

from agent_trainer.cli_args import config_choices

REPO = Path(__file__).resolve().parents[2]
DATED = re.compile(r"\d{4}-\d{2}-\d{2}")


def run_main(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "agent_trainer.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def dated_hydra_folders(cwd: Path) -> list[Path]:
    """hydra's default run folders, outputs/<date>/ and multirun/<date>/, under ``cwd``."""
    return [p for top in ("outputs", "multirun") if (cwd / top).is_dir()
            for p in (cwd / top).iterdir() if DATED.fullmatch(p.name)]


def first_comment(name: str) -> str:
    return (REPO / "config" / f"{name}.yaml").read_text().splitlines()[0].lstrip("#").strip()


def test_config_choices_are_the_config_files_with_their_first_comment_line():
    choices = dict(config_choices(REPO / "config"))
    assert "envs" not in choices  # the env tags file is no --config-name
    assert choices["frozenlake"] == first_comment("frozenlake")
    assert set(choices) == {p.stem for p in (REPO / "config").glob("*.yaml")} - {"envs"}


def test_main_help_names_the_config_choices_and_leaves_no_hydra_folder(tmp_path):
    run = run_main(tmp_path, "--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("== --config-name choices")  # the names first, before hydra's config dump
    choices, hydra_help = run.stdout.split("main is powered by Hydra.")
    lines = choices.splitlines()
    for name in ("frozenlake", "frozenlake_nodeadends"):
        [line] = [line for line in lines if line.split()[:1] == [name]]
        assert line.split(None, 1)[1] == first_comment(name)
    assert "sft_frozenlake" in choices.strip().splitlines()[-1]  # named as agent_trainer.sft's
    assert "== Config ==" in hydra_help
    assert not dated_hydra_folders(tmp_path) and not (tmp_path / "outputs").exists()


def test_hydra_record_of_a_run_goes_in_the_run_folder():
    """hydra's run folder (its .hydra record) is <trainer.default_local_dir>/hydra/<date>_<time>/."""
    from hydra import compose, initialize_config_dir

    from agent_trainer.checks.prepare import CONFIG_DIR  # registers the schema the configs build on

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("frozenlake", overrides=["trainer.default_local_dir=run"], return_hydra_config=True)
    assert cfg.hydra.run.dir.startswith("run/hydra/") and DATED.match(cfg.hydra.run.dir.split("/")[-1])


def test_a_run_refused_before_it_starts_leaves_no_folder(tmp_path):
    """Refused before Ray starts (no model at model_path): no hydra record, no run folder, no outputs/<date>/;
    a run folder that holds something else keeps it, and only hydra's record goes."""
    run = run_main(tmp_path, "model_path=./no_such_model", "trainer.default_local_dir=runs/mine")
    assert run.returncode == 1 and "./no_such_model" in run.stderr, run.stderr[-2000:]
    assert not dated_hydra_folders(tmp_path) and not (tmp_path / "outputs").exists()
    assert not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))
    (tmp_path / "kept" / "hydra" / "old").mkdir(parents=True)
    run = run_main(tmp_path, "model_path=./no_such_model", "trainer.default_local_dir=kept")
    assert run.returncode == 1
    assert [p.name for p in (tmp_path / "kept" / "hydra").iterdir()] == ["old"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")  # hydra.run.dir set to a folder of the user's
    run = run_main(tmp_path, "model_path=./no_such_model", "hydra.run.dir=mine")
    assert run.returncode == 1
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]  # hydra's record gone, nothing else
