"""The queue of ``trainer.refill=group`` (agent_trainer.rollout.stream.GroupStream): which group seed each env tag's
next group plays, the start rule, and what a step takes. The producer thread that plays the groups on Ray env
actors and the vLLM engine is tested in tests/agent_trainer/test_rollout_async.py and tests/e2e."""

import threading
import time
from types import SimpleNamespace

from agent_trainer.rollout.stream import FinishedGroup, GroupStream


def _stream(layout, steps_allowed=lambda: 1, **kwargs) -> GroupStream:
    rollout = SimpleNamespace(cfg=SimpleNamespace(es_manager=SimpleNamespace(seed=100)))
    return GroupStream(rollout, agent=None, layout=layout, steps_allowed=steps_allowed, **kwargs)


def _finished(stream, tag, version, played=True) -> FinishedGroup:
    """A group as the producer hands it over: one reply of ``version`` (or none)."""
    seed, step, group = stream.claim(tag)
    episode = SimpleNamespace(env_id=0, num_replies=int(played))
    finished = FinishedGroup(number=(step - 1) * stream.num_groups + group, seed=seed, tag=tag, episodes=[episode],
                             states=[], generations={0: [[1]]}, versions={0: [version]} if played else {},
                             started_version=version)
    stream.put(finished)
    return finished


def test_each_tag_plays_the_seeds_of_its_places_in_the_synchronous_order_within_the_start_rule():
    allowed = [1]
    stream = _stream(["A", "B", "A"], steps_allowed=lambda: allowed[0])
    assert [stream.claim("A"), stream.claim("A"), stream.claim("A")] == [(100, 1, 0), (102, 1, 2), None]
    assert stream.claim("B") == (101, 1, 1) and stream.claim("B") is None
    allowed[0] = 2  # the actor moved on: one more step's worth of each tag
    assert [stream.claim("A"), stream.claim("A"), stream.claim("B")] == [(103, 2, 0), (105, 2, 2), (104, 2, 1)]
    assert stream.resume_resets() == 2
    resumed = _stream(["A", "B", "A"], steps_allowed=lambda: 3, first_reset=2, trained_steps=1)
    assert resumed.claim("B") == (107, 3, 1)  # past every group the checkpointed run started
    assert [resumed.claim("A") for _ in range(5)][-1] is None  # 1 trained step + 2 more = 3 steps of 2 A groups


def test_a_step_takes_each_tags_count_oldest_first_and_drops_the_stale_and_the_empty():
    stream = _stream(["A", "B"], steps_allowed=lambda: 3)
    new_a, old_a, stale_b, fresh_b = (_finished(stream, "A", 4), _finished(stream, "A", 3),
                                      _finished(stream, "B", 1), _finished(stream, "B", 3))
    empty = _finished(stream, "B", 3, played=False)
    taken, dropped, empties = stream.take(oldest=2)
    assert taken == sorted([old_a, fresh_b], key=lambda g: g.number)  # one per tag; A's older one first
    assert dropped == [stale_b] and empties == [empty]
    assert stream.counted == {"A": 2, "B": 1} and stream.waiting() == 1  # new_a waits for the next step
    assert stream.claim("B") is not None  # the dropped and the empty no longer count against the rule


def test_the_step_waits_for_a_group_in_flight_that_only_it_can_train():
    stream = _stream(["A"], steps_allowed=lambda: 3)
    _finished(stream, "A", 5)
    last_chance = object()
    stream.claim("A")
    stream.note_versions(last_chance, "A", 3)  # in flight, a token of version 3: stale for any later step
    out = []
    thread = threading.Thread(target=lambda: out.append(stream.take(oldest=3)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # a finished group is there, but the step waits for the last-chance one
    stream.note_versions(last_chance, "A", None)
    old = FinishedGroup(number=1, seed=101, tag="A", episodes=[SimpleNamespace(env_id=0, num_replies=1)], states=[],
                        generations={0: [[1]]}, versions={0: [3]}, started_version=3)
    stream.put(old)
    thread.join(5)
    assert out and out[0][0] == [old]
    stream.note_versions(object(), "A", 4)  # one that a later step can still train: no wait
    assert stream.take(oldest=3)[0][0].oldest_version == 5
