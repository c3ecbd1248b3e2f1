"""A documentation page's code blocks, run as written: the blocks a comment marks, in the page's order.

A block is marked by the comment line above it, ``<!-- MARKER: what -->`` with what one of: ``run`` (a bash or
python block, run), ``run e2e`` (run by the page's e2e test only), ``file PATH`` (its text is written to PATH,
relative to where the commands run) or ``not run (reason)``. docs/writing_an_environment.md (``first-hour``) and
docs/gateway.md (``gateway-page``) are pages of this kind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
END = "DOC_BLOCK_END"


def blocks(doc: Path, marker: str) -> list[tuple[str, str, str]]:
    """``(what, lang, body)`` of every block of ``doc`` marked ``<!-- marker: what -->``, in the page's order."""
    marked = re.compile(rf"<!-- {re.escape(marker)}: (?P<what>[^\n]*?) -->\n```(?P<lang>\w+)\n(?P<body>.*?)```",
                        re.DOTALL)
    return [(m["what"], m["lang"], m["body"]) for m in marked.finditer(doc.read_text())]


def unmarked_blocks(doc: Path, marker: str) -> list[str]:
    """The bash and python blocks of ``doc`` without a marker line, and marks that say none of the four things."""
    commands = re.findall(r"(?:^|\n)([^\n]*)\n```(bash|python|sh|shell)\n", doc.read_text())
    bad = [f"{lang} block after {line!r}" for line, lang in commands if not line.startswith(f"<!-- {marker}:")]
    return bad + [f"mark {what!r}" for what, _, _ in blocks(doc, marker)
                  if what not in ("run", "run e2e") and not what.startswith("file ")
                  and not re.fullmatch(r"not run \(.+\)", what)]


def script(doc: Path, marker: str, e2e: bool) -> str:
    """The page's commands as one bash script: files written, bash run, python fed to ``python -``."""
    lines = ["set -euo pipefail"]
    for what, lang, body in blocks(doc, marker):
        if what.startswith("file "):
            path = what.removeprefix("file ").strip()
            lines.append(f"mkdir -p \"$(dirname {path})\" && cat > {path} <<'{END}'\n{body}{END}")
        elif what == "run" or (what == "run e2e" and e2e):
            lines.append(body if lang == "bash" else f"python - <<'{END}'\n{body}{END}")
    return "\n".join(lines) + "\n"


def run_script(text: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """Run it as a user would, with this checkout's ``python`` first on PATH and this checkout and ``cwd``
    importable."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    return subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
