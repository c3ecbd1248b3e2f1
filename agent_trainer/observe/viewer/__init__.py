"""A static, self-contained HTML viewer of sampled trajectories (no server, no CDN).

:func:`write_viewer` takes the records of a trajectories folder (every ``*.jsonl`` file, read by
``agent_trainer.observe.trajectories``) and writes ``viewer.html`` next to them: the records are
embedded as JSON in a ``<script type="application/json">`` element, the page's script and
style inline (``agent_trainer.observe.viewer.assets``). Open the file in any browser; a fragment
preselects filters (``viewer.html#tag=FrozenLake3x3&step=10&outcome=failure&index=0``).
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from agent_trainer.observe.viewer.assets import SCRIPT, STYLE


def embed_json(data: object) -> str:
    """JSON that is safe inside a ``<script>`` element: no ``<`` survives (so no ``</script>`` or ``<!--``)."""
    return json.dumps(data).replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_html(records: list, title: str = "agent_trainer trajectories") -> str:
    """The viewer page for ``records`` (``EpisodeRecord`` objects or their dicts)."""
    data = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in records]
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>\n"
        f"<header><h1>{html.escape(title)}</h1><div id=\"filters\"></div></header>\n"
        "<main><nav id=\"episodes\"></nav><section id=\"episode\"></section></main>\n"
        f"<script id=\"trajectory-data\" type=\"application/json\">{embed_json(data)}</script>\n"
        f"<script>{SCRIPT}</script>\n</body></html>\n"
    )


def write_viewer(folder: str | Path, records: list) -> Path:
    """(Re)write ``<folder>/viewer.html`` showing ``records`` (every record of the folder's JSONL files, read by
    ``agent_trainer.observe.trajectories.read_records``); return its path."""
    folder = Path(folder)
    path = folder / "viewer.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_html(records, title=f"trajectories: {folder.parent.name}"), encoding="utf-8")
    tmp.replace(path)
    return path
