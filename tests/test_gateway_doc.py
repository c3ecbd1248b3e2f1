"""docs/gateway.md's code runs as written: its marked blocks (``<!-- gateway-page: ... -->``, tests/doc_blocks.py),
in order, in an empty folder: the agent file, ``Task.local`` against the gateway app in front of the HF engine, the
check of the rows against what the client received (``return_token_ids``), the synchronous agent; the e2e test
also runs the page's training command (Ray, FSDP2, vLLM, the gateway). The page's model, ``models/tiny-qwen2``
(what ``make`` builds in the repository), is the tiny model the tests use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from doc_blocks import ROOT, blocks, run_script, script, unmarked_blocks

DOC = ROOT / "docs" / "gateway.md"
MARKER = "gateway-page"
PAGE_MODEL = "models/tiny-qwen2"


def page(tiny_model_path: str, e2e: bool) -> str:
    text = script(DOC, MARKER, e2e)
    assert PAGE_MODEL in text, f"the page no longer uses {PAGE_MODEL!r}; update PAGE_MODEL"
    return text.replace(PAGE_MODEL, str(Path(tiny_model_path).resolve()))


def test_every_code_block_of_the_page_is_marked():
    assert not unmarked_blocks(DOC, MARKER), unmarked_blocks(DOC, MARKER)
    whats = [what for what, _, _ in blocks(DOC, MARKER)]
    assert whats.count("run") >= 3 and "run e2e" in whats and "file my_agent.py" in whats


def test_the_pages_agent_tries_and_checks_as_written(tmp_path, tiny_model_path):
    """No Ray: the page's agent file, Task.local over the gateway app and the HF engine, the rows check, the
    synchronous agent with SyncTask.local."""
    proc = run_script(page(tiny_model_path, e2e=False), tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^\d+ steps, reward -?[\d.]+, success (True|False)$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\d+ calls, \d+ row\(s\), (merged|step-wise): exactly what the client received$", proc.stdout,
                     re.M), proc.stdout
    assert re.search(r"^synchronous: [1-6] steps, reward ", proc.stdout, re.M), proc.stdout


@pytest.mark.e2e
def test_the_pages_training_command_runs_as_written(tmp_path, tiny_model_path):
    proc = run_script(page(tiny_model_path, e2e=True), tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "my_agent" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout/gateway_merged"] + r["rollout/gateway_stepwise"] == 8 for r in trained), trained
