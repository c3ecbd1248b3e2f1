"""Sessions of the gateway and the training rows built from one session's calls.

A session is one episode of a user's agent: every chat completion it asks for through its base URL
(``/sessions/{session_id}/v1``) is recorded as a :class:`CallRecord` per returned choice, holding the
ids the engine was given and the ids it sampled, never text.

:func:`build_rows` turns a session's records into :class:`TrainingRow` s, token in, token out:

- a record whose prompt ids start exactly with a row's ids (the row's last prompt + its sampled ids)
  extends that row: the ids between (what the chat template rendered for the tool or user turn and the
  next assistant header) are context (``response_mask`` 0), the new sampled ids are response (mask 1),
  their logprobs the engine's;
- any other record starts a new row (step-wise): its prompt is context, its sampled ids response.
  A request's first choice that starts a row while the session already has rows is a *break* (the
  template re-rendered earlier turns differently from the ids sampled: re-tokenised text, a template that
  drops earlier reasoning); the other choices of an ``n > 1`` request are siblings, rows of their own.

Nothing is re-tokenised and nothing is guessed: an id is in ``response_mask`` only if the engine sampled it.
An episode trains as the one row its records merge into, or, when they make several, as one row per record
(:func:`episode_rows`, step-wise).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CallRecord:
    """One choice of one chat completion, as the engine saw and produced it."""

    request_index: int
    """Which request of the session (0, 1, ...), in the order the gateway received them."""
    choice_index: int
    """Which of the request's ``n`` choices."""
    prompt_ids: tuple[int, ...]
    """The ids the engine was given: the chat template applied to the request's messages (and tools)."""
    completion_ids: tuple[int, ...]
    """The ids the engine sampled, including the stop token that ended them."""
    logprobs: tuple[float, ...]
    """The engine's logprob of each sampled id (raw, temperature-1 model logprobs)."""
    finish_reason: str
    """The engine's finish reason: "stop" or "length"."""
    policy_version: int
    """The policy version (weight-sync count) of the engine that sampled them."""
    rendered: str = ""
    """The text of the prompt ids and the sampled ids (``chat.rendered``): a later prompt that starts with it
    continues this call from its ids (``SessionStore.prefix_of``)."""


@dataclass
class TrainingRow:
    """One row of the training batch built from a session: ``input_ids`` with ``response_mask`` 1 exactly on
    the sampled ids and ``rollout_log_probs`` (aligned with ``input_ids``, 0 off the mask) their logprobs."""

    input_ids: list[int]
    response_mask: list[int]
    rollout_log_probs: list[float]
    calls: list[tuple[int, int]] = field(default_factory=list)
    """(request_index, choice_index) of every record the row holds, in order."""
    policy_versions: list[int] = field(default_factory=list)
    """The policy version of each record the row holds."""
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """Per record the row holds: where its context starts, where its sampled ids start and end in ``input_ids``."""

    def extend(self, context: list[int] | tuple[int, ...], record: CallRecord) -> None:
        """Append ``context`` (mask 0) then the record's sampled ids (mask 1, with their logprobs)."""
        start = len(self.input_ids)
        self.spans.append((start, start + len(context), start + len(context) + len(record.completion_ids)))
        self.input_ids += [*context, *record.completion_ids]
        self.response_mask += [0] * len(context) + [1] * len(record.completion_ids)
        self.rollout_log_probs += [0.0] * len(context) + list(record.logprobs)
        self.calls.append((record.request_index, record.choice_index))
        self.policy_versions.append(record.policy_version)


@dataclass(frozen=True)
class RowMetrics:
    """How a session's records became rows (``rollout/gateway_*`` metrics)."""

    rows: int
    merges: int
    """Records appended to an existing row (their prompt extended it exactly)."""
    breaks: int
    """Requests after the first whose prompt extended no row, so a new row started (step-wise)."""
    stepwise: bool = False
    """The records did not merge into one row, so each is a row of its own (:func:`episode_rows`)."""

    def as_metrics(self) -> dict[str, float]:
        return {"rollout/gateway_rows": self.rows, "rollout/gateway_merges": self.merges,
                "rollout/gateway_breaks": self.breaks}


def build_rows(records: list[CallRecord]) -> tuple[list[TrainingRow], RowMetrics]:
    """A session's records (in the order received) as training rows; see the module docstring.

    A record extends the row with the longest ids that are a prefix of its prompt; rows grown by an
    earlier record no longer match a sibling's prompt, so ``n > 1`` siblings start rows of their own.
    """
    rows: list[TrainingRow] = []
    merges = breaks = 0
    for record in records:
        row = _longest_prefix_row(rows, record.prompt_ids)
        if row is not None:
            row.extend(record.prompt_ids[len(row.input_ids):], record)
            merges += 1
            continue
        if rows and record.choice_index == 0:
            breaks += 1
        row = TrainingRow(input_ids=[], response_mask=[], rollout_log_probs=[])
        row.extend(record.prompt_ids, record)
        rows.append(row)
    return rows, RowMetrics(rows=len(rows), merges=merges, breaks=breaks)


def episode_rows(records: list[CallRecord]) -> tuple[list[TrainingRow], RowMetrics]:
    """The rows an episode trains as: the one row its records merge into (:func:`build_rows`), or, when they do
    not (a re-sent request after an unusable reply, a history the agent rewrote, a template that re-renders a
    reply, ``n > 1`` siblings), one row per record, step-wise: the record's prompt as context (mask 0) and its
    sampled ids (mask 1), exactly what the engine was given and what the client received."""
    rows, metrics = build_rows(records)
    if len(rows) <= 1:
        return rows, metrics
    stepwise = []
    for record in records:
        row = TrainingRow(input_ids=[], response_mask=[], rollout_log_probs=[])
        row.extend(record.prompt_ids, record)
        stepwise.append(row)
    return stepwise, RowMetrics(rows=len(stepwise), merges=metrics.merges, breaks=metrics.breaks, stepwise=True)


def _longest_prefix_row(rows: list[TrainingRow], prompt: tuple[int, ...]) -> TrainingRow | None:
    """The row whose ids are the longest exact prefix of ``prompt``, or None."""
    best = None
    for row in rows:
        n = len(row.input_ids)
        if n <= len(prompt) and tuple(prompt[:n]) == tuple(row.input_ids) and (best is None or n > len(best.input_ids)):
            best = row
    return best


@dataclass
class Session:
    """One episode's calls, in the order the gateway received them."""

    session_id: str
    records: list[CallRecord] = field(default_factory=list)
    requests: int = 0
    """Requests answered so far (the next request's ``request_index``)."""


class SessionStore:
    """The open sessions, by id; safe to use from the server's threads."""

    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str | None = None) -> str:
        """Start a session (a fresh random id when none is given) and return its id; an open id is refused."""
        session_id = session_id or secrets.token_hex(8)
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open; close it first or use another id")
            self._sessions[session_id] = Session(session_id)
        return session_id

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def next_request(self, session_id: str) -> int:
        """Reserve the next request index of an open session (KeyError when it is not open)."""
        with self._lock:
            session = self._sessions[session_id]
            session.requests += 1
            return session.requests - 1

    def requests(self, session_id: str) -> int:
        """Requests an open session has made so far (KeyError when it is not open)."""
        with self._lock:
            return self._sessions[session_id].requests

    def record(self, session_id: str, records: list[CallRecord]) -> None:
        """Add one request's records to an open session (KeyError when it was closed meanwhile)."""
        with self._lock:
            self._sessions[session_id].records.extend(records)

    def prefix_of(self, session_id: str, text: str) -> tuple[str, list[int]] | None:
        """The (text, ids) of the open session's call whose prompt and sampled ids render as the longest proper
        start of ``text`` (a rendered prompt), or None (KeyError when it is not open)."""
        with self._lock:
            records = list(self._sessions[session_id].records)
        best = max((r for r in records if r.rendered and len(r.rendered) < len(text) and text.startswith(r.rendered)),
                   key=lambda r: len(r.rendered), default=None)
        return None if best is None else (best.rendered, [*best.prompt_ids, *best.completion_ids])

    def records(self, session_id: str) -> list[CallRecord]:
        """A copy of an open session's records, ordered by request then choice."""
        with self._lock:
            return sorted(self._sessions[session_id].records, key=lambda r: (r.request_index, r.choice_index))

    def close(self, session_id: str) -> list[CallRecord]:
        """End a session: its records (ordered by request then choice); its URL answers 404 from now on."""
        with self._lock:
            session = self._sessions.pop(session_id)
        return sorted(session.records, key=lambda r: (r.request_index, r.choice_index))
