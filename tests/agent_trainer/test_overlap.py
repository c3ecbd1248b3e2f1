"""RolloutBuffer and PolicyVersions: the background rollouts of trainer.max_off_policy_steps >= 1
(agent_trainer.rollout.overlap)."""

import threading
from contextlib import contextmanager

import pytest
import torch

from agent_trainer.rollout.overlap import PolicyVersions, RolloutBuffer
from agent_trainer.training.trainer import staleness_metrics


def producer(versions: PolicyVersions, resets: list[int], log: list, ship=lambda: 0.0):
    """A produce job as the trainer's: sync when newer, mark the start, draw one reset."""
    def produce(pending):
        versions.sync_if_newer(ship)
        pending.mark_started(resets=resets[0], version=versions.engines)
        resets[0] += 1
        log.append((pending.step, versions.engines, threading.current_thread().name))
        return f"experience {pending.step}"
    return produce


@contextmanager
def an_update_running(versions: PolicyVersions):
    """The actor's update in another thread, holding the version lock until the block ends (version + 1)."""
    inside, release = threading.Event(), threading.Event()

    def update():
        with versions.updating():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=update)
    thread.start()
    assert inside.wait(5)
    try:
        yield
    finally:
        release.set()
        thread.join(5)


def test_a_prefetched_step_is_generated_in_the_background_and_taken_once():
    release, started = threading.Event(), threading.Event()
    threads = []

    def produce(pending):
        threads.append(threading.current_thread().name)
        pending.mark_started(resets=7, version=0)
        started.set()
        release.wait(5)
        return f"experience {pending.step}"

    buffer = RolloutBuffer()
    buffer.start(3, produce)
    assert started.wait(5) and buffer.first_resets() == 7  # running while the caller goes on
    release.set()
    buffer.wait()
    assert buffer.pending[0].future.done()
    taken = buffer.take(3, oldest_version=0)
    assert taken.result == "experience 3" and taken.version == 0 and taken.dropped == []
    assert buffer.take(3, oldest_version=0) is None and len(buffer) == 0  # taken once; the caller collects itself
    assert threads[0].startswith("rollout-producer") and threads[0] != threading.current_thread().name


def test_the_background_error_is_raised_when_its_step_is_taken():
    def produce(pending):
        raise RuntimeError(f"env of step {pending.step} crashed")

    buffer = RolloutBuffer()
    buffer.start(2, produce)
    buffer.wait()  # waiting does not raise: the step that needs the batch does
    assert buffer.first_resets() is None  # a rollout that failed before starting never blocks a checkpoint
    with pytest.raises(RuntimeError, match="env of step 2 crashed"):
        buffer.take(2, oldest_version=0)


def test_a_prefetch_for_another_step_is_dropped_not_trained_on():
    """After an in-place restart the run continues from a checkpoint: an older prefetch must not be used."""
    versions, log = PolicyVersions(), []
    buffer = RolloutBuffer(depth=2)
    buffer.start(5, producer(versions, [0], log))
    assert buffer.take(3, oldest_version=0) is None and len(buffer) == 0
    buffer.start(4, lambda pending: 1 / 0)
    assert buffer.drop() == 1  # a failed rollout is discarded with a warning, never raised
    assert len(buffer) == 0


def test_at_most_depth_rollouts_are_held():
    buffer = RolloutBuffer(depth=2)
    buffer.start(2, lambda pending: pending.step)
    buffer.start(3, lambda pending: pending.step)
    with pytest.raises(RuntimeError, match=r"2 rollouts \(steps \[2, 3\]\) are already held, the most of 2"):
        buffer.start(4, lambda pending: pending.step)


def test_the_producer_runs_queued_rollouts_in_order_and_syncs_only_to_newer_versions():
    """k = 2 as the trainer drives it: the queue is topped up to k after each take, the actor's update moves the
    version, and each rollout starts on the newest version the actor held then: never more than k behind."""
    k, total = 2, 6
    versions, resets, log, shipped = PolicyVersions(), [0], [], []
    produce = producer(versions, resets, log, ship=lambda: shipped.append(versions.actor) or 0.0)
    buffer: RolloutBuffer[str] = RolloutBuffer(depth=k)
    for step in range(1, total + 1):
        taken = buffer.take(step, oldest_version=versions.actor - k)
        if taken is None:
            versions.sync_if_newer(lambda: 0.0)
            taken_version, result = versions.engines, f"experience {step}"
            resets[0] += 1
        else:
            taken_version, result = taken.version, taken.result
        assert result == f"experience {step}"
        assert 0 <= versions.actor - taken_version <= k  # the bound
        for queued in range(step + 1 + len(buffer), min(step + k, total) + 1):
            buffer.start(queued, produce)
        with versions.updating():
            pass
    assert [entry[0] for entry in log] == list(range(2, total + 1))  # one thread, in step order
    assert len({entry[2] for entry in log}) == 1
    assert shipped == sorted(set(shipped))  # a version is shipped once, never an older one after a newer
    assert resets[0] == total


def test_a_batch_more_than_k_versions_old_is_dropped_and_the_next_one_taken():
    buffer = RolloutBuffer(depth=3)
    for step, version in ((4, 0), (5, 1), (6, 3)):
        buffer.start(step, lambda pending, v=version: pending.mark_started(0, v) or f"batch of version {v}")
    taken = buffer.take(4, oldest_version=1)  # the trainer at version 3 with k = 2
    assert taken.result == "batch of version 1" and taken.version == 1
    assert taken.dropped == ["batch of version 0"]
    assert [p.step for p in buffer.pending] == [5]  # the queue moved up one step
    assert buffer.take(5, oldest_version=4).dropped == ["batch of version 3"]  # all stale: the step collects itself


def test_a_checkpoint_reads_the_reset_counter_of_the_oldest_buffered_rollout():
    versions, resets, log = PolicyVersions(), [5], []
    buffer = RolloutBuffer(depth=3)
    for step in (2, 3, 4):
        buffer.start(step, producer(versions, resets, log))
    buffer.wait()
    assert resets[0] == 8 and buffer.first_resets() == 5  # the buffered steps' draws are not counted
    assert buffer.drop() == 3


def test_a_weight_sync_never_overlaps_the_actor_update():
    versions, seen = PolicyVersions(), []
    with an_update_running(versions):
        syncing = threading.Thread(target=lambda: versions.sync_if_newer(lambda: seen.append(versions.actor) or 0.0))
        syncing.start()
        syncing.join(0.2)
        assert syncing.is_alive() and seen == []  # waits for the update
    syncing.join(5)
    assert seen == [1] and versions.engines == versions.actor == 1
    versions.reset(7)
    assert (versions.actor, versions.engines) == (7, 7) and not versions.sync_if_newer(lambda: 1 / 0)


def test_staleness_metrics_give_max_mean_and_the_share_of_rows_at_each_lag():
    metrics = staleness_metrics(torch.tensor([0, 1, 1, 2]), 2)
    assert metrics == {"rollout/policy_staleness": 2.0, "rollout/policy_staleness_mean": 1.0,
                       "rollout/policy_staleness_frac/0": 0.25, "rollout/policy_staleness_frac/1": 0.5,
                       "rollout/policy_staleness_frac/2": 0.25}


def test_an_in_flight_sync_never_waits_for_the_actor_update():
    """trainer.async_mode=continuous: between two engine calls the engines take the newest weights, unless the
    actor is updating right then; the rollout goes on with the weights it holds and never waits."""
    versions, shipped = PolicyVersions(), []
    ship = lambda: shipped.append(versions.actor) or 0.0
    assert versions.sync_unless_updating(ship) is False  # nothing newer
    inside, release, done = threading.Event(), threading.Event(), threading.Event()

    def update():
        with versions.updating():
            inside.set()
            release.wait()
        done.set()

    thread = threading.Thread(target=update)
    thread.start()
    inside.wait()
    assert versions.sync_unless_updating(ship) is False and shipped == []  # returned at once, mid-update
    release.set()
    done.wait()
    thread.join()
    assert versions.sync_unless_updating(ship) is True and shipped == [1] and versions.engines == 1


def test_a_batch_with_per_token_versions_is_screened_by_its_fresh_test():
    buffer = RolloutBuffer(depth=2)
    for step, groups in ((4, [0, 1]), (5, [2, 3])):
        buffer.start(step, lambda pending, g=groups: pending.mark_started(0, 0) or g)
    taken = buffer.take(4, oldest_version=2, fresh=lambda oldest_per_group: max(oldest_per_group) >= 2)
    assert taken.result == [2, 3] and taken.dropped == [[0, 1]]  # started at version 0, judged by its tokens


def test_rollouts_in_flight_run_at_once_and_are_taken_in_step_order():
    """trainer.rollouts_in_flight: the buffer's producer threads run that many rollouts at once; each step's seeds
    were drawn when it was queued, so a checkpoint reads the counter from before the oldest one's draw without
    waiting for it to start, and the steps are taken in order whichever ends first."""
    buffer, both_running, order = RolloutBuffer(depth=3, workers=2), threading.Barrier(2, timeout=10), []
    release_first = threading.Event()

    def produce(pending):
        pending.mark_started(resets=99, version=0)  # ignored: the seeds were drawn at queue time
        if pending.step in (2, 3):
            both_running.wait()  # steps 2 and 3 run at the same time, or this times out
        if pending.step == 2:
            release_first.wait(10)
        order.append(pending.step)
        return pending.seeds

    for step, resets in ((2, 5), (3, 6), (4, 7)):
        buffer.start(step, produce, resets=resets, seeds=[10 * step])
    assert buffer.first_resets() == 5
    while len(order) < 2:  # steps 3 and 4 end while step 2 still runs
        threading.Event().wait(0.01)
    assert order == [3, 4] and buffer.running() == 1
    release_first.set()
    assert [buffer.take(step, oldest_version=0).result for step in (2, 3, 4)] == [[20], [30], [40]]


def test_a_sync_before_a_rollout_waits_for_the_update_without_holding_the_engine_lock():
    """Several rollouts in flight: the producer's sync before a rollout waits for the actor's update to end (the
    bound), but not inside the engine lock, so the other rollouts' engine calls go on; it then ships inside it."""
    versions, engine_lock, shipped = PolicyVersions(), threading.RLock(), []

    def ship():
        assert engine_lock._is_owned()  # the sync runs with no engine call in flight
        shipped.append(versions.actor)
        return 0.0

    with an_update_running(versions):
        syncing = threading.Thread(target=versions.sync_when_free, args=(ship, engine_lock))
        syncing.start()
        syncing.join(0.2)
        assert syncing.is_alive() and shipped == []  # waits for the update ...
        with engine_lock:  # ... while a rollout's engine call takes the lock at once
            assert shipped == []
    syncing.join(5)
    assert shipped == [1] and versions.engines == 1
    assert versions.sync_when_free(lambda: 1 / 0, engine_lock) is False  # nothing newer: nothing shipped
