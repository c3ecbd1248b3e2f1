"""RolloutPrefetch: the one background rollout of trainer.max_off_policy_steps 1 (agent_trainer.overlap)."""

import threading

import pytest

from agent_trainer.overlap import RolloutPrefetch


def test_a_prefetched_step_is_generated_in_the_background_and_taken_once():
    release, started = threading.Event(), threading.Event()
    threads = []

    def collect(step):
        threads.append(threading.current_thread().name)
        started.set()
        release.wait(5)
        return f"experience {step}"

    prefetch = RolloutPrefetch()
    prefetch.start(3, collect, resets=7)
    assert started.wait(5) and prefetch.pending.resets == 7  # running while the caller goes on
    release.set()
    prefetch.wait()
    assert prefetch.pending.future.done()
    assert prefetch.take(3) == "experience 3"
    assert prefetch.take(3) is None and prefetch.pending is None  # taken once; the caller then collects itself
    assert threads[0].startswith("rollout-prefetch") and threads[0] != threading.current_thread().name


def test_the_background_error_is_raised_when_its_step_is_taken():
    def collect(step):
        raise RuntimeError(f"env of step {step} crashed")

    prefetch = RolloutPrefetch()
    prefetch.start(2, collect, resets=0)
    prefetch.wait()  # waiting does not raise: the step that needs the batch does
    with pytest.raises(RuntimeError, match="env of step 2 crashed"):
        prefetch.take(2)


def test_a_prefetch_for_another_step_is_dropped_not_trained_on():
    """After an in-place restart the run continues from a checkpoint: an older prefetch must not be used."""
    prefetch = RolloutPrefetch()
    prefetch.start(5, lambda step: step, resets=0)
    assert prefetch.take(3) is None and prefetch.pending is None
    prefetch.start(4, lambda step: 1 / 0, resets=0)
    prefetch.drop()  # a failed rollout is discarded with a warning, never raised
    assert prefetch.pending is None


def test_only_one_rollout_is_held_at_a_time():
    prefetch = RolloutPrefetch()
    prefetch.start(2, lambda step: step, resets=0)
    with pytest.raises(RuntimeError, match="step 2's rollout is still held"):
        prefetch.start(3, lambda step: step, resets=0)
