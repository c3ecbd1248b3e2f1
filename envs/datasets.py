"""Prompt datasets: one entry, :func:`load_prompts`, for JSON, JSONL, TXT and parquet files.

A dataset is a list of :class:`PromptRecord` (a prompt, an optional ground truth, the row's
``data_source`` and ``extra_info``), read from any mix of:

- ``.jsonl``: one JSON object a line (blank lines skipped);
- ``.json``: a list of objects, or a list of strings (one prompt each);
- ``.txt``: one prompt a line (blank lines skipped; no ground truth);
- ``.parquet``: verl's rows (``prompt`` as chat ``messages``, ``reward_model.ground_truth``,
  ``data_source``, ``extra_info``), read with pandas/pyarrow;
- a folder: RAGEN's layout, ``<folder>/prompts.json`` (e.g. ``data/<task>/train``).

``prompt_key`` names the prompt field: plain text, or a chat ``messages`` list (a list of
``{"role", "content"}``), kept as messages. ``ground_truth_key`` is a dotted path into the
row (verl's ``reward_model.ground_truth`` by default); a row without it has no ground truth.
A malformed file raises ``ValueError`` naming the file, the line (or row) and the problem.
This module imports neither torch nor a tokenizer (environments load datasets).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

FORMATS = (".json", ".jsonl", ".txt", ".parquet")
RAGEN_PROMPTS_FILE = "prompts.json"
"""RAGEN's layout: a split folder (``data/<task>/train``, ``data/<task>/val``) holding this file."""


@dataclass(frozen=True)
class PromptRecord:
    """One dataset row as the trainer uses it."""

    prompt: str | tuple
    """Plain text, or a chat conversation: a tuple of (role, content) pairs."""
    ground_truth: Any = None
    """The reference answer (None when the row has none)."""
    data_source: str = ""
    """verl's ``data_source`` (passed to reward functions; picks the default scorer)."""
    extra_info: dict = field(default_factory=dict)
    """verl's ``extra_info`` (passed to reward functions)."""
    where: str = ""
    """``file:line`` (or ``file row N``) of the row, for error messages."""

    def prompt_text(self) -> str:
        """The prompt as one string: the text, or the conversation's contents joined (roles kept when several)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) == 1:
            return self.prompt[0][1]
        return "\n\n".join(f"{role}: {content}" for role, content in self.prompt)


def load_prompts(paths: str | Path | Sequence[str | Path], prompt_key: str = "prompt",
                 ground_truth_key: str = "reward_model.ground_truth") -> list[PromptRecord]:
    """Every row of every file, in order; each file's format is chosen by its suffix."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise ValueError("no data files given; list at least one JSON, JSONL, TXT or parquet file")
    out: list[PromptRecord] = []
    for path in paths:
        out.extend(_load_file(str(path), prompt_key, ground_truth_key))
    return out


@functools.lru_cache(maxsize=8)
def _load_file(path: str, prompt_key: str, ground_truth_key: str) -> tuple[PromptRecord, ...]:
    """One file's records (cached: every episode of an env actor shares one read-only copy)."""
    p = Path(path)
    if p.is_dir():
        p = p / RAGEN_PROMPTS_FILE
    if not p.is_file():
        raise ValueError(f"data file {str(p)!r} does not exist; give a {'/'.join(FORMATS)} file or a folder "
                         f"holding {RAGEN_PROMPTS_FILE} (RAGEN's layout)")
    suffix = p.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"data file {str(p)!r}: unknown format {suffix!r}; supported: {', '.join(FORMATS)}")
    rows = _READERS[suffix](p)
    records = tuple(_record(row, where, prompt_key, ground_truth_key) for row, where in rows)
    if not records:
        raise ValueError(f"data file {str(p)!r} holds no rows")
    return records


def _read_jsonl(p: Path) -> list[tuple[Any, str]]:
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((json.loads(line), f"{p}:{n}"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}:{n}: not valid JSON ({err.msg} at column {err.colno})") from None
    return rows


def _read_json(p: Path) -> list[tuple[Any, str]]:
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{p}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ValueError(f"{p}:1: a JSON data file must hold a list of rows (objects or prompt strings), "
                         f"got {type(data).__name__}")
    return [(row, f"{p} row {i}") for i, row in enumerate(data)]


def _read_txt(p: Path) -> list[tuple[Any, str]]:
    return [(line, f"{p}:{n}") for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
            if line.strip()]


def _read_parquet(p: Path) -> list[tuple[Any, str]]:
    import pandas as pd  # only parquet needs it

    try:
        frame = pd.read_parquet(p)
    except Exception as err:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise ValueError(f"{p}: not a readable parquet file ({type(err).__name__}: {err})") from None
    return [(_plain(row), f"{p} row {i}") for i, row in enumerate(frame.to_dict("records"))]


def _plain(obj: Any) -> Any:
    """numpy arrays and scalars from parquet rows as lists and Python values."""
    if hasattr(obj, "tolist"):
        obj = obj.tolist()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


_READERS: dict[str, Callable[[Path], list[tuple[Any, str]]]] = {
    ".jsonl": _read_jsonl, ".json": _read_json, ".txt": _read_txt, ".parquet": _read_parquet}


def _dig(row: dict, dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted path (``reward_model.ground_truth``) in a row."""
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _record(row: Any, where: str, prompt_key: str, ground_truth_key: str) -> PromptRecord:
    """A row as a PromptRecord; a row that cannot be one raises naming where it is and why."""
    if isinstance(row, str):
        if not row.strip():
            raise ValueError(f"{where}: the prompt is empty")
        return PromptRecord(prompt=row, where=where)
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object (or a prompt string), got {type(row).__name__}")
    found, prompt = _dig(row, prompt_key)
    if not found:
        raise ValueError(f"{where}: no prompt field {prompt_key!r} (set data.prompt_key); the row has keys "
                         f"{sorted(row)}")
    prompt = _prompt(prompt, where, prompt_key)
    _, truth = _dig(row, ground_truth_key) if ground_truth_key else (False, None)
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return PromptRecord(prompt=prompt, ground_truth=truth, data_source=str(row.get("data_source") or ""),
                        extra_info=dict(extra), where=where)


def _prompt(value: Any, where: str, key: str) -> str | tuple:
    """Plain text, or chat messages as a tuple of (role, content) pairs."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: the prompt {key!r} is empty")
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return tuple((m["role"], m["content"]) for m in value)
    raise ValueError(f"{where}: the prompt {key!r} must be text or a non-empty list of chat messages "
                     f"({{'role': ..., 'content': ...}}), got {str(value)[:80]!r}")


def check_prompt_lengths(records: Sequence[PromptRecord], count_tokens: Callable[[str], int],
                         max_prompt_length: int, key: str = "data.max_prompt_length") -> None:
    """Refuse the first prompt longer than ``max_prompt_length`` tokens, naming its file and line.

    The policy's tokenizer measures the prompt text (without the chat template and instruction).
    """
    for rec in records:
        n = count_tokens(rec.prompt_text())
        if n > max_prompt_length:
            raise ValueError(f"{rec.where}: the prompt is {n} tokens, more than {key} = {max_prompt_length}; "
                             f"raise {key} or shorten or remove the row")


def row_for_position(position: int, num_rows: int, shuffle: bool, seed: int) -> int:
    """The row an episode plays: position p walks the dataset; each epoch is a fresh seeded permutation.

    Position p is in epoch ``p // num_rows``; with ``shuffle`` the epoch's order is a permutation
    seeded by ``(seed, epoch)``, so a resumed run (same env seeds) replays the same rows.
    """
    import numpy as np

    epoch, index = divmod(int(position), num_rows)
    if not shuffle:
        return index
    return int(np.random.default_rng([int(seed), epoch]).permutation(num_rows)[index])
