"""Misbehaving environments and dying engines on the real stack (Ray, FSDP2, vLLM, the tiny model):
each fault ends only what it touches (docs/reliability.md).

One run shared by every case: one env tag per fault (``FAULT_TAGS``), one group and one env actor per
tag, plus a healthy Bandit group; ``es_manager.env_step_timeout_s`` = ``env_reset_timeout_s`` = 5.
The engine cases (killed during weight sync, killed mid-rollout) run last on the same workers;
tests/faults/test_engine_faults.py holds the generate deadline.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import ray
import torch
from ray.exceptions import RayActorError
from transformers import AutoTokenizer

from agent_trainer.episode.es_manager import EnvStateManager
from agent_trainer.ray_cluster import init_ray, shutdown_ray
from agent_trainer.rollout import make_context_manager
from agent_trainer.workers.worker_group import wait_until_ready
from agent_trainer.training.trainer import AgentTrainer
from agent_trainer.workers.build import build_workers
from fault_runs import fault_config

pytestmark = pytest.mark.e2e

TAGS = ["Bandit", "FaultyHangStep", "FaultyHangReset", "FaultyRaiseStep", "FaultyRaiseReset", "FaultyWrongTypes",
        "FaultyNanReward", "FaultyMegabytes", "FaultySurrogates"]
TIMEOUT_S = 5


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory, no_ray_left):
    """One GRPO step with every env fault at once; yields the trainer (workers alive), its history and the
    env actor handles from before training. Afterwards no Ray process of the run may be left."""
    run_dir = tmp_path_factory.mktemp("env_faults")
    cfg, tags = fault_config(tiny_model_path, run_dir, TAGS, "trainer.total_training_steps=1",
                             "actor_rollout_ref.actor.optim.lr=1e-3",
                             f"es_manager.env_step_timeout_s={TIMEOUT_S}", f"es_manager.env_reset_timeout_s={TIMEOUT_S}")
    init_ray(cfg)
    try:
        trainer = AgentTrainer(cfg, AutoTokenizer.from_pretrained(tiny_model_path), tags, build_workers=build_workers)
        trainer.init_workers(build_workers(cfg))
        before = list(trainer.train_rollout.env_actors)
        history = trainer.fit()
        yield trainer, history, before
    finally:
        shutdown_ray()
    assert no_ray_left(30.0) == []


def _actor_index(rollout, tag: str) -> int:
    return rollout.actor_of_env[next(e.env_id for e in rollout.episodes if e.tag == tag)]


def test_the_run_finishes_its_steps_and_reports_every_fault(run):
    trainer, history, _ = run
    assert len(history) == 1
    for m in history:
        assert m["rollout/reset_failures"] == 4  # FaultyRaiseReset and FaultyHangReset: 2 episodes each
        assert m["rollout/env_timeouts"] == 2  # the hung reset and the hung step (one actor kill each)
        assert m["env/FaultyHangReset/timeouts"] == 2
        assert m["rollout/nonfinite_dropped"] == 2  # FaultyNanReward's group, left out of training
        assert m["rollout/engine_failures"] == 0 and m["rollout/env_actor_failures"] == 0
        assert m["perf/num_rows"] >= 2 * 4  # Bandit, RaiseStep, WrongTypes, Megabytes, Surrogates, HangStep
    assert history[0]["env/FaultyHangStep/timeouts"] == 2  # the hung step ended its group's two episodes


def test_the_hung_env_actors_are_gone_and_replaced(run):
    trainer, _, before = run
    rollout = trainer.train_rollout
    for tag in ("FaultyHangStep", "FaultyHangReset"):
        i = _actor_index(rollout, tag)
        assert rollout.env_actors[i] is not before[i]
        with pytest.raises(RayActorError):  # the stuck actor (and its process) was killed
            ray.get(before[i].__ray_ready__.remote(), timeout=30)
        ray.get(rollout.env_actors[i].__ray_ready__.remote(), timeout=30)  # its replacement answers
        assert ray.get_actor(rollout.env_pool.name(i)) is not None  # under the same name
    healthy = _actor_index(rollout, "Bandit")
    assert rollout.env_actors[healthy] is before[healthy]


def test_env_errors_end_their_episodes_with_the_error_text(run):
    trainer, _, _ = run
    result = trainer.train_rollout.rollout(step=3)
    errors = {s.tag: s.error or "" for s in result.states}
    assert "injected step failure" in errors["FaultyRaiseStep"]  # every reply acts (fault_runs.EveryReplyActs)
    assert "observation of type int" in errors["FaultyWrongTypes"]
    assert "FaultyRaiseReset" not in errors and "FaultyHangReset" not in errors  # dropped from the step
    by_tag = {s.tag: s for s in result.states}
    surrogate_obs = by_tag["FaultySurrogates"].final_observation
    assert "\ufffd" in surrogate_obs and "\x00" not in surrogate_obs
    assert len(by_tag["FaultyMegabytes"].final_observation) < 21_000  # es_manager.max_observation_chars
    logged = trainer.train_rollout.logged_errors  # each logged once with its text (over the whole run)
    assert {("FaultyRaiseStep", "RuntimeError"), ("FaultyWrongTypes", "TypeError"),
            ("FaultyRaiseReset", "RuntimeError")} <= logged


def test_too_many_failed_resets_stop_the_rollout_naming_tag_seed_and_error(run):
    trainer, _, _ = run
    rollout = trainer.train_rollout
    cfg = rollout.cfg
    rollout.cfg = copy.deepcopy(cfg)
    rollout.cfg.es_manager.max_failed_reset_fraction = 0.1
    try:
        with pytest.raises(RuntimeError, match=r"failed to reset.*max_failed_reset_fraction = 0.1.*env tag "
                                               r"'Faulty\w+Reset'.*group seed \d+"):
            rollout.rollout(step=4)
    finally:
        rollout.cfg = cfg


def test_context_overflow_ends_episodes_as_truncated_keeping_their_rewards(run, tiny_model_path):
    trainer, _, _ = run
    rollout = trainer.train_rollout
    local = EnvStateManager(trainer.env_tags, [e for e in rollout.episodes if e.tag in ("Bandit", "FaultyNanReward",
                                                                                         "FaultySurrogates")])
    longest_prompt = max(len(rollout.ctx.start(out).token_ids) for out in local.reset({g: 0 for g in range(9)}))
    cfg, ctx = rollout.cfg, rollout.ctx
    rollout.cfg = copy.deepcopy(cfg)
    rollout.cfg.actor_rollout_ref.rollout.max_model_len = longest_prompt + 24 + 8  # room for one turn only
    rollout.ctx = make_context_manager(rollout.cfg, trainer.tokenizer)
    try:
        result = rollout.rollout(step=5)
    finally:
        rollout.cfg, rollout.ctx = cfg, ctx
    assert result.metrics["rollout/context_overflow_rate"] > 0
    assert result.metrics["rollout/truncated_rate"] >= result.metrics["rollout/context_overflow_rate"]
    batch = result.batch
    for state in result.states:  # every episode's batch rewards equal what its env paid (nothing lost)
        rows = (batch["traj_uid"] == state.env_id).nonzero()
        if len(rows):
            earned = sum(turn.reward for turn in state.history)
            assert torch.isclose(batch["token_level_rewards"][rows[0, 0]].sum(), torch.tensor(float(earned)),
                                 atol=1e-4), state.tag


def _engine_vs_actor_logprob_diff(trainer) -> float:
    """Largest |engine - actor| logprob over fixed sequences (0 when the engine holds the actor's weights)."""
    from agent_trainer.common.batch import TensorBatch

    seqs = [trainer.tokenizer.encode(t, add_special_tokens=False)
            for t in ("<think>go down</think><answer>Down</answer>", "Reward: 1\nLeft Right Up")]
    engine_lp = ray.get(trainer.engines[0].prompt_logprobs.remote(seqs))
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    batch = TensorBatch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                         "response_mask": mask})  # the actor scores the response tokens: here every token
    actor_lp = trainer.actor_wg.dp_compute("compute_log_prob", batch)["old_log_probs"]
    return max((torch.tensor(engine_lp[i][1:]) - actor_lp[i, 1 : len(s)]).abs().max().item()
               for i, s in enumerate(seqs))


def test_an_engine_killed_during_weight_sync_is_restarted_and_resynced(run):
    trainer, _, _ = run
    ray.kill(trainer.engines[0], no_restart=False)
    trainer.sync_weights()  # found dead while loading: waits for Ray's restart and sends the weights again
    # the restarted engine holds the actor's trained weights (lr 1e-3 moved them), not the model on disk
    assert _engine_vs_actor_logprob_diff(trainer) < 1e-3


def test_a_killed_env_actor_and_a_killed_engine_mid_rollout_end_only_what_they_touch(run, monkeypatch):
    """One rollout, two deaths: the env actor hung in reset is killed once its reset is submitted (a call in
    flight, well inside the reset timeout), the engine right after the first turn; the rollout retries both and
    finishes."""
    trainer, _, _ = run
    rollout = trainer.train_rollout
    hung_index = _actor_index(rollout, "FaultyHangReset")
    hung = rollout.env_actors[hung_index]
    reset_submitted = threading.Event()
    submit = rollout.env_pool.submit

    def observed_submit(method, args_by_index, timeout_s):
        pending = submit(method, args_by_index, timeout_s)
        if method == "reset" and hung_index in args_by_index:
            reset_submitted.set()
        return pending

    monkeypatch.setattr(rollout.env_pool, "submit", observed_submit)  # observes the call; Ray runs it unchanged

    def kill_env_actor_then_engine():
        reset_submitted.wait(120)  # a loaded machine may take seconds to get there: the kill waits for the call
        time.sleep(0.5)
        ray.kill(hung, no_restart=False)
        deadline = time.monotonic() + 120
        while not rollout.last_generations and time.monotonic() < deadline:
            time.sleep(0.005)
        ray.kill(trainer.engines[0], no_restart=False)

    rollout.last_generations.clear()
    killer = threading.Thread(target=kill_env_actor_then_engine)
    killer.start()
    result = rollout.rollout(step=7)
    killer.join()
    m = result.metrics
    assert m["rollout/env_actor_failures"] == 1 and m["rollout/engine_failures"] == 1
    assert m["rollout/reset_failures"] == 4  # the restarted actor hung again (timeout) and RaiseReset raised
    assert {s.tag for s in result.states} == set(TAGS) - {"FaultyHangReset", "FaultyRaiseReset"}
    assert max(len(turns) for turns in rollout.last_generations.values()) >= 2  # later turns were generated
    wait_until_ready(trainer.engines)
    assert _engine_vs_actor_logprob_diff(trainer) < 1e-3  # re-synced after the restart
