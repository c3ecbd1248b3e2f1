"""Resume under continuous asynchronous training through the real command line: kill -9 a run while it writes
step 2's checkpoint, with the producer generating steps 3 and 4 beside it, then start the same command.

Documented (docs/architecture.md, "Asynchronous training"): a checkpoint holds none of the buffered or in-flight
rollouts; it counts them (rollout/buffered_not_checkpointed) and saves the env reset counter from before the
oldest, so the resumed run plays those steps again from the same initial states (on its own weights: an
asynchronous run is not bit for bit repeatable, the engines' weight updates land where the timing puts them).
So each trained step's groups, identified by their reset seed (``group_seed`` in the trajectory records), must be
the uninterrupted run's: step s plays reset s - 1's seeds, no group twice, none lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_resume_e2e import _finish, _kill_during_save, _start

pytestmark = pytest.mark.e2e
GROUPS, STEPS = 2, 4


def _command(model_path: str, run_dir: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake_grpo",
            f"model_path={model_path}", f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=0",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.save_hf_model=false",
            "trainer.max_off_policy_steps=2", "trainer.async_mode=continuous",
            "algorithm.rollout_correction.rollout_is=token",
            "trainer.log_trajectories_freq=1", "trainer.log_trajectories_per_tag=8", "agent_proxy.max_turn=2",
            f"es_manager.train.env_groups={GROUPS}", "es_manager.train.group_size=4",
            "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]", "es_manager.train.env_configs.n_groups=[1,1]",
            "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.response_length=16", "actor_rollout_ref.actor.optim.lr=1e-3"]


def _kill_and_resume(command: list[str], run: Path, tmp_path: Path) -> list[dict]:
    """SIGKILL ``command`` while it saves step 2, start it again, wait for it: the metrics of every step."""
    _kill_during_save(command, run, step=2)
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "1"
    log = tmp_path / "resumed.log"
    resumed = _finish(_start(command, log), log)
    assert f"resumed from {run / 'global_step_1'}" in resumed
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))  # the killed run's step 2 was logged again
    return lines


def test_sigkill_during_continuous_async_then_resume_trains_every_group_once(tiny_model_path, tmp_path):
    run = tmp_path / "run"
    lines = _kill_and_resume(_command(tiny_model_path, run), run, tmp_path)
    assert lines[0]["rollout/buffered_not_checkpointed"] >= 1  # the documented discard, counted
    assert all(m["rollout/policy_staleness"] <= 2 for m in lines)

    seeds = {}
    for step in range(1, STEPS + 1):
        records = [json.loads(line) for line in (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(records) == GROUPS * 4 and all(r["step"] == step for r in records)
        seeds[step] = sorted({r["group_seed"] for r in records})
    base = seeds[1][0]
    assert seeds == {s: [base + (s - 1) * GROUPS + g for g in range(GROUPS)] for s in seeds}, seeds


def test_sigkill_with_groups_refilled_then_resume_trains_no_group_twice(tiny_model_path, tmp_path):
    """``trainer.refill=group``: each group slot starts the next group seed as soon as its group ends, so a step
    trains whichever groups ended first. A checkpoint discards the groups not yet trained (counted) and saves the
    reset counter past every group started: the resumed run trains only groups no step trained before, every
    token still within k versions of the weights its step trains from. With dynamic sampling on, every trained
    group's episodes scored differently (the others were set aside, counted, and their seeds never come back)."""
    run = tmp_path / "run"
    command = [*_command(tiny_model_path, run), "trainer.refill=group", "actor_rollout_ref.rollout.mode=async",
               "algorithm.filter_groups.enable=true"]
    lines = _kill_and_resume(command, run, tmp_path)
    # k x 2 = 4 slots played at once, step 1 took 2 groups: the slots went on, in flight at its save
    assert lines[0]["rollout/buffered_not_checkpointed"] >= 1
    assert all(m["rollout/policy_staleness"] <= 2 and m["rollout/stale_dropped"] == 0 for m in lines)
    assert all({"rollout/in_flight_episodes", "rollout/buffered", "rollout/versions_in_batch",
                "rollout/set_aside_groups"} <= set(m) for m in lines)

    seeds = []
    for step in range(1, STEPS + 1):
        records = [json.loads(line) for line in (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(records) == GROUPS * 4 and all(r["step"] == step for r in records)
        groups = sorted({r["group_seed"] for r in records})
        assert len(groups) == GROUPS
        for seed in groups:  # dynamic sampling: no trained group whose episodes all scored the same
            assert len({r["total_reward"] for r in records if r["group_seed"] == seed}) > 1, (step, seed)
        seeds += groups
    assert len(set(seeds)) == len(seeds), seeds  # no group trained twice, before or after the kill
    first_after_resume = min(seeds[GROUPS:])
    assert first_after_resume > max(seeds[:GROUPS])  # the resumed run starts past every group started before
