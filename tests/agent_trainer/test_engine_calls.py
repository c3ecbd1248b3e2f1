"""The engine calls of rollouts in flight (``rollout.engines.EngineCalls``): one call at a time, the waiting requests
of several rollouts sent together, each handed its own outputs. The real engines are in
``test_rollout_async.py``; here ``send`` records what each call carried."""

import threading
import time
from contextlib import ExitStack

import pytest

from agent_trainer.rollout.engines import EngineCalls, GatherRule, WaitingCall
from agent_trainer.rollout.splits import SamplingParams

HANG_GUARD_S = 600.0
"""A thread that has not ended by then is stuck (no test here waits anywhere near this long when it works)."""


class Owner:
    """A rollout as the engine calls see it: the engines it generates on."""

    def __init__(self, name, engines):
        self.name, self.engines = name, engines


def request(owner, n, seeded=True, temperature=1.0, max_tokens=8):
    return WaitingCall(owner, [[owner.name, k] for k in range(n)], SamplingParams(max_tokens, temperature),
                         seed=0, budgets=[max_tokens] * n, prompt_seeds=list(range(n)) if seeded else None)


class Engine:
    """``send``: records each call's requests and answers each prompt with (its owner, its index)."""

    def __init__(self):
        self.calls: list[list[WaitingCall]] = []

    def __call__(self, batch):
        self.calls.append(list(batch))
        return [[(r.owner.name, p[1]) for p in r.prompts] for r in batch]


def ask(calls, req, send, out, playing=True):
    def run():
        with calls.play() if playing else ExitStack():
            try:
                out[id(req)] = calls.call(req, send)
            except BaseException as err:  # noqa: BLE001 - checked by the test
                out[id(req)] = err
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def until(condition):
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "stuck"
        time.sleep(0.01)


def a_leads(calls):
    """Another thread holds the engine lock."""
    if calls.lock.acquire(blocking=False):
        calls.lock.release()
        return False
    return True


def waiting_owners(calls):
    with calls._changed:
        return {r.owner.name for r in calls._waiting}


def test_waiting_requests_of_two_rollouts_go_in_one_call_each_with_its_own_outputs():
    engines, engine, calls, out = [object()], Engine(), EngineCalls(), {}
    a, b = request(Owner("a", engines), 2), request(Owner("b", engines), 3, max_tokens=4)
    with calls.lock:  # a call in flight: both requests wait for the engines
        threads = [ask(calls, a, engine, out), ask(calls, b, engine, out)]
        until(lambda: waiting_owners(calls) == {"a", "b"})
    for t in threads:
        t.join(HANG_GUARD_S)
    assert len(engine.calls) == 1 and set(engine.calls[0]) == {a, b}
    assert out[id(a)] == [("a", 0), ("a", 1)] and out[id(b)] == [("b", 0), ("b", 1), ("b", 2)]
    assert a.shared and b.shared


def test_a_leader_waits_for_the_other_playing_rollout_and_no_longer():
    engines, engine, calls, out = [object()], Engine(), EngineCalls(rule=GatherRule(max_s=HANG_GUARD_S)), {}
    a, b = request(Owner("a", engines), 1), request(Owner("b", engines), 1)
    with calls.play():  # b's rollout plays: a waits for its request ...
        first = ask(calls, a, engine, out)
        until(lambda: engine.calls or a_leads(calls))
        assert not engine.calls  # a leads, gathering: nothing sent yet
        second = ask(calls, b, engine, out, playing=False)  # ... and stops waiting once b asks
        for t in (first, second):
            t.join(HANG_GUARD_S)
    assert [set(c) for c in engine.calls] == [{a, b}]
    # the only rollout playing: nothing to wait for, at once (the guard is far below the rule's max_s)
    alone = request(Owner("a", engines), 1)
    ask(calls, alone, engine, out).join(HANG_GUARD_S)
    assert out[id(alone)] == [("a", 0)] and not alone.shared


@pytest.mark.parametrize("other", [
    dict(seeded=False),  # one seed for the call: sharing would change its draws
    dict(temperature=0.5),  # sampled otherwise (a condenser's summaries)
    dict(engines=[object()]),  # other engines
    dict(share=False),  # trainer.share_engine_calls=false
])
def test_requests_that_cannot_share_go_in_calls_of_their_own(other):
    engines, engine, out = [object()], Engine(), {}
    calls = EngineCalls(rule=GatherRule(max_s=HANG_GUARD_S), share=other.pop("share", True))
    a = request(Owner("a", engines), 2)
    b = request(Owner("b", other.pop("engines", engines)), 2, **other)
    with calls.lock:
        threads = [ask(calls, a, engine, out), ask(calls, b, engine, out)]
        until(lambda: waiting_owners(calls) == {"a", "b"})
    for t in threads:
        t.join(HANG_GUARD_S)
    assert sorted(len(c) for c in engine.calls) == [1, 1]
    assert out[id(a)] == [("a", 0), ("a", 1)] and out[id(b)] == [("b", 0), ("b", 1)]
    assert not a.shared and not b.shared


def test_a_failed_call_raises_in_every_request_it_carried():
    engines, calls, out = [object()], EngineCalls(), {}
    a, b = request(Owner("a", engines), 1), request(Owner("b", engines), 1)

    def send(batch):
        raise RuntimeError("engine died twice")

    with calls.lock:
        threads = [ask(calls, a, send, out), ask(calls, b, send, out)]
        until(lambda: waiting_owners(calls) == {"a", "b"})
    for t in threads:
        t.join(HANG_GUARD_S)
    assert all(isinstance(out[id(r)], RuntimeError) for r in (a, b))
    assert calls.call(request(Owner("a", engines), 1), Engine()) == [("a", 0)]  # the next call goes on
