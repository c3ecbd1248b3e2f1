"""An agent written with the plain ``openai`` client trained through the gateway (real Ray, FSDP2 over gloo,
vLLM CPU, the HTTP gateway and the real ``openai`` client; nothing mocked): 2 GiGPO steps of
config/frozenlake_gateway.yaml on the tiny model. The training rows must hold exactly the ids and logprobs the
gateway returned for every call; an agent that raises, or never returns (the per-episode deadline), ends only
its own episode; an engine killed in the middle of a gateway rollout is restarted and the calls in flight are
generated again (step 3), the rows still exactly what each client got; the gateway's own Ray actor killed mid-
rollout stops the run with a line naming it (step 4). An agent that re-sends a request after a reply it cannot
parse trains in the default layout as step-wise rows, each exactly a call as its client received it."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import threading
import time

import httpx
import psutil
import pytest
import ray
import torch

from agent_trainer.training.trainer import AgentTrainer
from e2e_runs import metrics_records, started
from gateway_agents import CALLS, HANGS, HOLD, STARTED

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

SMALL = ["trainer.test_freq=0", "trainer.progress_bar=false", "trainer.save_freq=0",
         "es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
         "agent_proxy.num_env_actors=1", "agent_proxy.max_turn=3", "actor_rollout_ref.actor.fsdp.world_size=1",
         "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.response_length=32",
         "trainer.collapse_metrics_freq=0", "agent_proxy.gateway.episode_timeout_s=300"]
"""An episode's deadline far above what one takes on a loaded machine (the first engine call includes its warm-up)."""


class KeepsBatches(AgentTrainer):
    """Keeps every training rollout's batch with the calls its agents recorded, and looks at the gateway."""

    def collect(self, step):
        _, port = self.train_rollout.address()  # the gateway's Ray actor, started with the first rollout
        listening = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
        no_key = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        owners = {int(pid): " ".join(psutil.Process(int(pid)).cmdline())  # the processes that listen
                  for pid in re.findall(r"pid=(\d+),", listening) if int(pid) != os.getpid()}
        CALLS.clear()
        HANGS.clear()
        HANGS.update({2} if step == 2 else set())  # step 2: env_id 2's agent never returns
        STARTED.clear()
        HOLD.clear()
        HOLD.extend([threading.Event()] if step == 3 else [])  # step 3: the other calls follow the engine's kill
        kill = {3: self.engines[0], 4: self.train_rollout.host()}.get(step)  # step 3: the engine; 4: the gateway
        killer = threading.Thread(target=self.kill_after_a_call, args=(kill,)) if kill else None
        # step 2: the deadline that ends the hung agent; other steps: the agents wait for the engine's restart (a
        # vLLM start) within theirs
        self.cfg.agent_proxy.gateway.episode_timeout_s = 90 if step == 2 else 300
        if killer:
            killer.start()
        try:
            result = super().collect(step)
        finally:
            if killer:
                killer.join()
        self.seen = getattr(self, "seen", []) + [(result.batch, dict(CALLS), listening, owners, no_key.status_code)]
        return result

    @staticmethod
    def kill_after_a_call(actor):
        """Kill ``actor`` once the first call has come back, while the agents go on calling (Ray restarts an
        engine; the gateway's actor is not restarted)."""
        deadline = time.monotonic() + 120
        while not CALLS and time.monotonic() < deadline:
            time.sleep(0.005)
        ray.kill(actor, no_restart=False)
        for event in HOLD:
            event.set()


def test_the_plain_openai_agent_trains_on_exactly_what_the_engine_returned(tiny_model_path, tmp_path):
    with started("frozenlake_gateway", tiny_model_path, tmp_path, *SMALL, "trainer.total_training_steps=4",
                 "agent_proxy.gateway.agent=gateway_agents.recorded_frozenlake", trainer_cls=KeepsBatches) as trainer:
        # step 4: the gateway's own actor dies mid-rollout: the run stops there as for any dead worker, naming it
        with pytest.raises(RuntimeError, match=r"gateway \(train\) died: .*GatewayHost.*trainer.max_restarts"):
            trainer.fit()
    history = metrics_records(tmp_path)
    assert len(history) == 3 and len(trainer.seen) == 3
    assert [math.isfinite(h["actor/pg_loss"]) for h in history] == [True, True, True]
    # step 3: the engine died after the first call; the calls that followed met it dead (in flight) or restarted
    # from the checkpoint on disk (its weights are not the last sync's): each time it was re-synced and the call
    # generated again
    assert [h["rollout/engine_failures"] for h in history[:2]] == [0, 0] and history[2]["rollout/engine_failures"] >= 1
    # env_id 0's agent raises after one call, and in step 2 env_id 2's never returns: each ends its own episode
    assert all(h["rollout/gateway_calls"] >= 4 and h["rollout/gateway_agent_errors"] == 1 for h in history)
    assert history[1]["rollout/gateway_agent_timeouts"] >= 1
    for (batch, calls, listening, owners, no_key), h in zip(trainer.seen, history):
        addresses = [line.split()[3] for line in listening.splitlines()]
        assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), listening
        pids = {int(pid) for pid in re.findall(r"pid=(\d+),", listening)}
        assert pids and set(owners) == pids, (listening, owners)  # the gateway's Ray actor listens, not the driver
        assert all("GatewayHost" in cmdline for cmdline in owners.values()), owners
        assert no_key == 401  # no key, no answer
        trained = set(batch["traj_uid"].tolist())  # every episode that made a call trains
        assert trained == set(calls) and h["rollout/gateway_merged"] + h["rollout/gateway_stepwise"] >= len(calls)
        for env_id in trained:
            episode = calls[env_id]
            rows = [r for r in range(len(batch)) if int(batch["traj_uid"][r]) == env_id]
            masks = [batch["response_mask"][r].bool() for r in rows]
            ids = [t for r, m in zip(rows, masks) for t in batch["input_ids"][r][m].tolist()]
            logprobs = torch.cat([batch["rollout_log_probs"][r][m] for r, m in zip(rows, masks)])
            assert ids == [t for call in episode for t in call["ids"]]
            assert torch.allclose(logprobs, torch.tensor([lp for call in episode for lp in call["logprobs"]]),
                                  atol=1e-6)
            first = episode[0]["prompt_ids"]
            assert batch["input_ids"][rows[0]][:len(first)].tolist() == first
            assert int(batch["response_mask"][rows[0]][:len(first)].sum()) == 0


def test_a_synchronous_openai_agent_calls_batch_as_the_async_agents_do(tiny_model_path, tmp_path):
    """examples/gateway/frozenlake_openai_sync.py (``def run``, ``openai.OpenAI``) and the async example play the
    same rollout (the same group seeds): the sync agent's episodes run in threads of their own, so its calls reach
    the engines together, within 2x the async agent's engine calls (one at a time they would be one engine call
    each). Its episodes' turns are env steps, its calls counted apart, and the trajectories pair them."""
    from agent_trainer.gateway.task import is_sync_agent
    from agent_trainer.observe.trajectories import read_records, write_step
    from examples.gateway import frozenlake_openai

    groups = ["es_manager.train.env_groups=4", "es_manager.train.env_configs.n_groups=[4]"]
    with started("frozenlake_gateway", tiny_model_path, tmp_path, *SMALL, *groups, "trainer.total_training_steps=1",
                 "agent_proxy.gateway.agent=examples.gateway.frozenlake_openai_sync.run") as trainer:
        rollout = trainer.train_rollout
        assert is_sync_agent(rollout.agent_fn)
        sync_agent, rollout.agent_fn = rollout.agent_fn, frozenlake_openai.run
        by_async = rollout.rollout(step=1)
        rollout.agent_fn = sync_agent
        by_sync = rollout.rollout(step=1, seeds=by_async.group_seeds)
    a, s = by_async.metrics, by_sync.metrics
    logging.getLogger(__name__).info("engine calls per rollout: async %d (%d chat completions), sync %d (%d)",
                                     a["rollout/gateway_engine_calls"], a["rollout/gateway_calls"],
                                     s["rollout/gateway_engine_calls"], s["rollout/gateway_calls"])
    assert s["rollout/gateway_calls"] >= 8 and s["rollout/gateway_agent_errors"] == 0, s
    assert s["rollout/gateway_engine_calls"] <= 2 * a["rollout/gateway_engine_calls"], (s, a)
    assert s["rollout/gateway_engine_calls"] < s["rollout/gateway_calls"] / 2, s  # batched, not one by one
    for m in (a, s):  # one call per env step: turns are the env steps (at most max_turn), calls counted apart
        assert 1 <= m["rollout/num_turns_mean"] <= 3 and m["rollout/num_calls_mean"] == m["rollout/num_turns_mean"]
        # a group's steps go to its env actor together (4 groups of 2 episodes: half as many env calls as steps
        # when both ask at once); a call per episode's step would be one per chat completion
        assert m["rollout/gateway_env_calls"] <= 0.75 * m["rollout/gateway_calls"], m
    assert all(state.turn_replies is not None and state.metrics["gateway_rows"] >= 1 for state in by_sync.states)
    path = write_step(tmp_path, 1, "train", by_sync.states, by_sync.batch, trainer.tokenizer, per_tag=8)
    for record in (r for r in read_records(path.parent) if r.metrics["gateway_rows"] == 1):  # trained rows
        assert [(t.call, t.step) for t in record.turns] == [(k, k) for k in range(1, len(record.turns) + 1)]
        assert all(any(t.mask) for t in record.turns) and "gateway_rows" in record.metrics


def test_an_env_actor_lost_mid_rollout_leaves_its_episodes_out_of_the_batch(tiny_model_path, tmp_path):
    """The agents' env steps go to the env actors together; the actor of groups 2 and 3 dies as the first such call
    reaches it. Its episodes end there, are counted (``env_actor_lost``) and left out of the batch and of their
    groups' statistics (an infrastructure failure is never scored as the episode's reward), their agents are not
    counted as failing, and the other actor's episodes train."""
    groups = ["es_manager.train.env_groups=4", "es_manager.train.env_configs.n_groups=[4]",
              "agent_proxy.num_env_actors=2"]
    with started("frozenlake_gateway", tiny_model_path, tmp_path, *SMALL, *groups,
                 "trainer.total_training_steps=1") as trainer:
        rollout = trainer.train_rollout
        submit, killed = rollout.env_pool.submit, []

        def kill_first(method, args_by_index, timeout_s):  # the actor dies as its first step call is sent
            if method == "step" and 1 in args_by_index and not killed:
                killed.append(sorted(inp.env_id for inp in args_by_index[1]))
                ray.kill(rollout.env_actors[1], no_restart=False)
            return submit(method, args_by_index, timeout_s)

        rollout.env_pool.submit = kill_first
        try:
            result = rollout.rollout(step=1)
        finally:
            rollout.env_pool.submit = submit
    m = result.metrics
    lost_ids = set(killed[0])
    on_actor = {env_id for env_id, actor in rollout.actor_of_env.items() if actor == 1}
    assert killed and lost_ids <= on_actor, (killed, on_actor)
    assert m["rollout/env_actor_failures"] >= 1 and m["rollout/env_actor_lost"] >= len(lost_ids), m
    assert m["rollout/gateway_agent_errors"] == 0, m  # the lost env ended them, not their code
    trained = set(result.batch["traj_uid"].tolist())
    assert not trained & lost_ids, (trained, lost_ids)
    assert trained >= set(rollout.actor_of_env) - on_actor  # the other actor's episodes all train


class KeepsRows(AgentTrainer):
    """Keeps every training rollout's batch with the calls its agents' clients received."""

    def collect(self, step):
        CALLS.clear()
        result = super().collect(step)
        self.seen = getattr(self, "seen", []) + [(result.batch, {k: list(v) for k, v in CALLS.items()})]
        return result


def test_an_agent_that_resends_a_request_trains_step_wise_in_the_default_layout(tiny_model_path, tmp_path):
    """examples/gateway/frozenlake_retry.py re-sends its request after a reply it cannot parse (here: every
    episode's first reply), so no episode's calls merge into one row. In the default layout (one row per episode,
    GiGPO) every episode trains as one row per call: the row is that call's prompt ids (mask 0) and exactly the ids
    its client received (mask 1, with their logprobs), and the update has a gradient."""
    groups = ["es_manager.train.env_groups=4", "es_manager.train.group_size=4",
              "es_manager.train.env_configs.n_groups=[4]"]
    with started("frozenlake_gateway", tiny_model_path, tmp_path, *SMALL, *groups, "trainer.total_training_steps=2",
                 "agent_proxy.gateway.agent=gateway_agents.recorded_retry", trainer_cls=KeepsRows) as trainer:
        assert trainer.cfg.ctx_manager.mode == "full"
        trainer.fit()
    history = metrics_records(tmp_path)
    assert len(history) == 2 and all(h["actor/grad_norm"] > 0 for h in history), history
    for (batch, calls), h in zip(trainer.seen, history):
        assert h["rollout/gateway_stepwise"] == 16 and h["rollout/gateway_merged"] == 0, h
        assert h["rollout/gateway_breaks"] >= 16 and h["rollout/gateway_calls"] == len(batch)
        assert set(batch["traj_uid"].tolist()) == set(calls) and len(calls) == 16
        for env_id, episode in calls.items():
            rows = [r for r in range(len(batch)) if int(batch["traj_uid"][r]) == env_id]
            assert len(rows) == len(episode) >= 2
            for row, call in zip(rows, episode):  # call for call, in the order the client made them
                n, length = len(call["prompt_ids"]), len(call["prompt_ids"]) + len(call["ids"])
                assert int(batch["attention_mask"][row].sum()) == length
                assert batch["input_ids"][row][:length].tolist() == call["prompt_ids"] + call["ids"]
                assert batch["response_mask"][row][:length].tolist() == [0] * n + [1] * len(call["ids"])
                assert torch.allclose(batch["rollout_log_probs"][row][n:length], torch.tensor(call["logprobs"]),
                                      atol=1e-6)
