"""Every shell script in the repository parses (``bash -n``) and passes shellcheck.

shellcheck is a distribution package: ``make test`` installs it with apt-get when it is missing
and the user is root; without it the shellcheck half is skipped, saying so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", "models", "outputs", "runs", "node_modules", "__pycache__", ".hypothesis"}
"""Not the project's scripts; nor is any virtualenv (.venv, bench/.venv-trl) or bench/results."""
SHELL_SHEBANG = re.compile(rb"^#!\s*(?:\S*/)?(?:env\s+)?(?:ba|da|k)?sh\b")
# The submit script as it was: the apostrophe in "cluster's" opens a quote that never closes.
BROKEN = '#!/usr/bin/env bash\n: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster\'s dashboard address}"\necho ok\n'


def shell_scripts() -> list[Path]:
    """Files ending in .sh, and files whose first line is a sh/bash/dash/ksh shebang."""
    found = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".venv")
                       and Path(dirpath, d) != REPO / "bench" / "results"]
        for name in filenames:
            path = Path(dirpath, name)
            if path.suffix == ".sh" or _has_shell_shebang(path):
                found.append(path)
    return sorted(found)


def _has_shell_shebang(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return SHELL_SHEBANG.match(fh.readline(200)) is not None
    except OSError:
        return False


SCRIPTS = shell_scripts()
needs_shellcheck = pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck is not installed (`make test` installs it with apt-get when run as root; "
           "else: apt-get install shellcheck)")


def test_finds_the_scripts():
    rel = {str(p.relative_to(REPO)) for p in SCRIPTS}
    assert {"launch/submit_job.sh", ".ci/run"} <= rel, rel


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_bash_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@needs_shellcheck
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck(script):
    proc = subprocess.run(["shellcheck", "--external-sources", str(script)], capture_output=True, text=True,
                          cwd=script.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bash_rejects_the_old_submit_script(tmp_path):
    script = tmp_path / "broken.sh"
    script.write_text(BROKEN)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode != 0


@needs_shellcheck
def test_shellcheck_rejects_the_old_submit_script(tmp_path):
    script = tmp_path / "broken.sh"
    script.write_text(BROKEN)
    proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert proc.returncode != 0 and "SC1009" in proc.stdout, proc.stdout


def test_submit_job_without_ray_address_says_what_to_set():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([str(REPO / "launch" / "submit_job.sh"), "--config-name", "frozenlake"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    assert "set RAY_ADDRESS to the dashboard address of the Ray cluster" in proc.stderr
