"""The queue of ``trainer.refill=group`` (agent_trainer.rollout.stream.GroupStream): which group seed each env tag's
next group plays, the start rule, and what a step takes. The producer thread that plays the groups on Ray env
actors and the vLLM engine is tested in tests/agent_trainer/test_rollout_async.py and tests/e2e."""

import threading
import time
from types import SimpleNamespace

import pytest

from agent_trainer.episode.es_manager import EpisodeState
from agent_trainer.rollout.stream import FinishedGroup, GroupStream, NoInformativeGroups, uninformative
from agent_trainer.training.colocation import ColocatedMemory
from agent_trainer.training.trainer import AgentTrainer


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
    taken, dropped, empties, aside = stream.take(oldest=2)
    assert taken == sorted([old_a, fresh_b], key=lambda g: g.number)  # one per tag; A's older one first
    assert dropped == [stale_b] and empties == [empty] and aside == []
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


def _scored(stream, tag, rewards, success=None, lost=()) -> FinishedGroup:
    """A finished group of ``len(rewards)`` episodes with these rewards (and success flags), as the producer hands
    it over; the episodes in ``lost`` lost their env actor."""
    seed, step, group = stream.claim(tag)
    success = success or [0.0] * len(rewards)
    episodes = [SimpleNamespace(env_id=m, num_replies=1, env_actor_lost=m in lost) for m in range(len(rewards))]
    states = [EpisodeState(env_id=m, group_id=0, tag=tag, history=[], penalty=0.0, final_observation="",
                           metrics={"success": success[m]}, reward=r)
              for m, r in enumerate(rewards) if m not in lost]
    finished = FinishedGroup(number=(step - 1) * stream.num_groups + group, seed=seed, tag=tag, episodes=episodes,
                             states=states, generations={m: [[1]] for m in range(len(rewards))},
                             versions={m: [3] for m in range(len(rewards))}, started_version=3)
    stream.put(finished)
    return finished


def test_a_group_is_uninformative_when_every_episode_that_played_scored_the_same():
    stream = _stream(["A"], steps_allowed=lambda: 10)
    assert uninformative(_scored(stream, "A", [1.0, 1.0, 1.0]), "reward")
    assert not uninformative(_scored(stream, "A", [1.0, 0.9, 1.0]), "reward")  # a format penalty differs
    assert uninformative(_scored(stream, "A", [1.0, 0.9], success=[1.0, 1.0]), "success")
    assert not uninformative(_scored(stream, "A", [0.0, 0.0], success=[1.0, 0.0]), "success")
    assert uninformative(_scored(stream, "A", [0.0, 0.0, 1.0], lost=[2]), "reward")  # the lost one has no say
    assert not uninformative(_scored(stream, "A", [0.0, 1.0], lost=[1]), "reward")  # one left: not judged


def test_dynamic_sampling_sets_uninformative_groups_aside_and_the_step_waits_for_informative_ones():
    stream = _stream(["A", "B"], steps_allowed=lambda: 1, set_aside=lambda g: uninformative(g, "reward"),
                     max_set_aside=2)
    same_a = _scored(stream, "A", [1.0, 1.0])
    assert stream.claim("A") is not None  # the set-aside group freed its place under the start rule
    stream.playing -= 1  # (that claim is not played here)
    informative_b = _scored(stream, "B", [0.0, 1.0])
    out = []
    thread = threading.Thread(target=lambda: out.append(stream.take(oldest=3)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # no informative group of A yet
    informative_a = FinishedGroup(number=2, seed=1, tag="A", episodes=informative_b.episodes,
                                  states=informative_b.states, generations=informative_b.generations,
                                  versions=informative_b.versions, started_version=3)
    stream.playing += 1
    stream.put(informative_a)
    thread.join(5)
    taken, stale, empty, aside = out[0]
    assert taken == [informative_b, informative_a] and aside == [same_a] and not stale and not empty
    assert stream.aside == []  # reported once


def test_more_uninformative_groups_in_a_row_than_max_num_gen_batches_allows_stop_the_run_naming_the_key():
    stream = _stream(["A", "A"], steps_allowed=lambda: 10, set_aside=lambda g: uninformative(g, "success"),
                     max_set_aside=2)
    for _ in range(3):
        _scored(stream, "A", [1.0, 1.0], success=[1.0, 1.0])
    _scored(stream, "A", [1.0, 1.0], success=[1.0, 0.0])  # an informative one: the count starts again
    for _ in range(4):  # two rollouts' worth of A's two groups in a row: allowed
        _scored(stream, "A", [1.0, 1.0], success=[1.0, 1.0])
    assert stream.error is None and stream.claim("A") is not None
    stream.playing -= 1
    _scored(stream, "A", [1.0, 1.0], success=[1.0, 1.0])
    with pytest.raises(NoInformativeGroups, match=r"algorithm.filter_groups.max_num_gen_batches = 2 .*enable=false"):
        stream.take(oldest=0)
    assert stream.claim("A") is None  # the producer starts no more groups


def test_a_run_stopped_for_want_of_informative_groups_saves_its_last_step_first(tmp_path, caplog):
    """``AgentTrainer.fit_steps`` catches :class:`NoInformativeGroups` on step s, saves step s - 1 (unless that step is
    saved already, or is step 0) and stops with the error: what the run learned is kept, and the same command
    continues from it."""
    saved = []

    def save_checkpoint():
        folder = tmp_path / f"global_step_{trainer.global_step}"
        folder.mkdir()
        saved.append(trainer.global_step)
        return folder

    trainer = SimpleNamespace(run_dir=tmp_path, global_step=7, save_checkpoint=save_checkpoint,
                              memory=ColocatedMemory([], None, sleep=False, offload=False),
                              tracking=SimpleNamespace(close=lambda: None))
    AgentTrainer.save_before_stopping(trainer, "no informative groups")
    assert saved == [7] and "step 7 is saved in" in caplog.text
    AgentTrainer.save_before_stopping(trainer, "no informative groups")  # saved already (save_freq): not again
    trainer.global_step = 0  # nothing trained yet: nothing to save
    AgentTrainer.save_before_stopping(trainer, "no informative groups")
    assert saved == [7]
