"""The session store and the rows built from a session's call records (plain ids, no model)."""

from __future__ import annotations

import pytest

from agent_trainer.gateway.sessions import CallRecord, SessionStore, build_rows


def record(request: int, prompt: list[int], completion: list[int], choice: int = 0, version: int = 0) -> CallRecord:
    return CallRecord(request_index=request, choice_index=choice, prompt_ids=tuple(prompt),
                      completion_ids=tuple(completion), logprobs=tuple(-float(t) for t in completion),
                      finish_reason="stop", policy_version=version)


def test_a_prompt_that_extends_the_row_merges_with_the_ids_between_as_context():
    records = [record(0, [1, 2], [10, 11], version=3), record(1, [1, 2, 10, 11, 5, 6], [12], version=4)]
    [row], metrics = build_rows(records)
    assert row.input_ids == [1, 2, 10, 11, 5, 6, 12]
    assert row.response_mask == [0, 0, 1, 1, 0, 0, 1]
    assert row.rollout_log_probs == [0.0, 0.0, -10.0, -11.0, 0.0, 0.0, -12.0]
    assert row.calls == [(0, 0), (1, 0)] and row.policy_versions == [3, 4]
    assert metrics.as_metrics() == {"rollout/gateway_rows": 1, "rollout/gateway_merges": 1,
                                    "rollout/gateway_breaks": 0}


def test_a_prompt_that_differs_anywhere_in_the_prefix_starts_a_new_row():
    """One id off in the earlier reply (re-tokenised text) is enough: no partial or fuzzy merge."""
    records = [record(0, [1, 2], [10, 11]), record(1, [1, 2, 10, 99, 5], [12]), record(2, [1, 2, 10], [13])]
    rows, metrics = build_rows(records)
    assert [r.input_ids for r in rows] == [[1, 2, 10, 11], [1, 2, 10, 99, 5, 12], [1, 2, 10, 13]]
    assert [r.response_mask for r in rows] == [[0, 0, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1]]
    assert (metrics.rows, metrics.merges, metrics.breaks) == (3, 0, 2)


def test_siblings_of_one_request_are_rows_of_their_own_and_the_chosen_one_continues():
    records = [record(0, [1], [10], choice=0), record(0, [1], [20], choice=1),
               record(1, [1, 20, 7], [21])]  # the agent went on from choice 1
    rows, metrics = build_rows(records)
    assert [r.input_ids for r in rows] == [[1, 10], [1, 20, 7, 21]]
    assert (metrics.rows, metrics.merges, metrics.breaks) == (2, 1, 0)


def test_the_longest_matching_row_is_extended():
    records = [record(0, [1], [2]), record(1, [5], [6]), record(2, [1, 2, 3], [4]), record(3, [1, 2, 3, 4, 8], [9])]
    rows, metrics = build_rows(records)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 8, 9], [5, 6]]
    assert (metrics.rows, metrics.merges, metrics.breaks) == (2, 2, 1)


def test_no_records_no_rows():
    rows, metrics = build_rows([])
    assert rows == [] and (metrics.rows, metrics.merges, metrics.breaks) == (0, 0, 0)


def test_the_store_opens_records_and_closes_sessions():
    store = SessionStore()
    sid = store.open()
    assert sid in store and store.open("mine") == "mine"
    with pytest.raises(ValueError, match="already open"):
        store.open("mine")
    assert [store.next_request(sid), store.next_request(sid)] == [0, 1]
    store.record(sid, [record(1, [1], [2])])
    store.record(sid, [record(0, [1], [3], choice=1), record(0, [1], [4])])
    assert [(r.request_index, r.choice_index) for r in store.records(sid)] == [(0, 0), (0, 1), (1, 0)]
    closed = store.close(sid)
    assert len(closed) == 3 and sid not in store
    with pytest.raises(KeyError):
        store.record(sid, [])
