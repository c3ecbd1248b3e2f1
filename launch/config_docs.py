"""Write the generated config pages: ``docs/configuration.md`` and the SFT table of ``docs/sft.md`` (from the typed
config's field docstrings), and ``docs/compatibility.md`` (from ``agent_trainer.config.compat.TABLE``).

The dataclasses in ``agent_trainer/config/`` are the single source of defaults and help texts; the
rendering lives in ``agent_trainer.config.docs`` and ``agent_trainer.config.compat`` (tests check the pages are
current).

    python -m launch.config_docs            # rewrite the three pages
"""

from __future__ import annotations

from pathlib import Path

from agent_trainer.config import compat
from agent_trainer.config.docs import DOCS_PAGE, render, render_docs

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "configuration.md"
SFT_PAGE = REPO / DOCS_PAGE


def main() -> None:
    """Rewrite the pages."""
    OUT.write_text(render())
    print(f"wrote {OUT}")
    SFT_PAGE.write_text(render_docs(SFT_PAGE.read_text()))
    print(f"wrote {SFT_PAGE}")
    compat.DOC.write_text(compat.render())
    print(f"wrote {compat.DOC}")


if __name__ == "__main__":
    main()
