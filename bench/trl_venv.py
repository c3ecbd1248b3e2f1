"""The TRL comparison's own virtualenv (``bench/.venv-trl``, git-ignored).

TRL is never a dependency of the project: the bench builds a separate venv
with TRL pinned to the torch and transformers versions the project's venv runs,
so both sides of the P2/P5 comparison use the same kernels and model code.
The venv is rebuilt only when those pins change (a stamp file records them).

    python bench/trl_venv.py            # create or refresh, print the venv's python
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

VENV = Path(__file__).resolve().parent / ".venv-trl"
TRL_SPEC = "trl"  # newest TRL the index offers that accepts the pinned torch + transformers


def project_pins() -> dict[str, str]:
    """torch and transformers versions of the running (project) interpreter."""
    pins = {name: metadata.version(name) for name in ("torch", "transformers")}
    pins["torch"] = pins["torch"].split("+")[0]  # "2.13.0+cpu": the local tag is the wheel's, not the spec's
    return pins


def ensure_trl_venv(venv: Path = VENV) -> Path:
    """Create or refresh the venv when the pins changed; return its python."""
    python = venv / "bin" / "python"
    stamp = venv / "pins.json"
    pins = project_pins()
    if python.exists() and stamp.exists() and json.loads(stamp.read_text()) == pins:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    specs = [f"{name}=={version}" for name, version in pins.items()] + [TRL_SPEC, "psutil"]
    subprocess.run([str(python), "-m", "pip", "install", "-q", *specs], check=True)
    # Same fix as the Makefile's: PyPI's CUDA builds of these break transformers' imports on a CPU torch.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False, capture_output=True)
    stamp.write_text(json.dumps(pins))
    return python


if __name__ == "__main__":
    print(ensure_trl_venv())
