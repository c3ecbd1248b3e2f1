"""``actor_rollout_ref.rollout.mode=async``: the rollout without a turn barrier.

The e2e tests run the real thing: a local Ray cluster, the vLLM engine on the tiny model and
real (threaded) env actors hosting FrozenLake with a simulated long-tailed step latency
(``envs.slow_env``), so the groups really do finish their turns at different times.
"""

import dataclasses
import os
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from agent_trainer.checks.load import load_config
from agent_trainer.checks.prepare import CONFIG_DIR, compose_and_prepare
from agent_trainer.rollout import SyncMultiTurnRollout
from envs import load_env_tags

SLOW_TAG = "SlowFrozenLake3x3"
BUILT_MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2"


@pytest.fixture(scope="module")
def model_path(tiny_model_path) -> str:
    """A tiny model that answers FrozenLake in format, so turns really step the slow env: the one ``make
    model`` built (``make test`` passes it as AGENT_TRAINER_TEST_MODEL); the untrained test build never does."""
    if os.environ.get("AGENT_TRAINER_TEST_MODEL") or not (BUILT_MODEL / "config.json").exists():
        return tiny_model_path
    return str(BUILT_MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(compose("frozenlake", overrides=[
            "es_manager.train.env_groups=4", "es_manager.train.group_size=2",
            "es_manager.train.env_configs.n_groups=[4]", "agent_proxy.max_turn=3",
            "actor_rollout_ref.rollout.response_length=64", "actor_rollout_ref.rollout.mode=async",
            "ppo_mini_batch_size=8", "micro_batch_size_per_gpu=1", *overrides]))


def _slow_tags(max_latency_ms: float = 60.0) -> dict:
    """FrozenLake3x3 whose steps take 1..max_latency_ms (long tail): groups get out of step."""
    tags = load_env_tags()
    env_config = dict(tags["FrozenLake3x3"].env_config, min_latency_ms=1.0, max_latency_ms=max_latency_ms,
                      tail_power=1.0)
    tags[SLOW_TAG] = dataclasses.replace(tags["FrozenLake3x3"], env_type="slow_frozen_lake", env_config=env_config)
    return tags


def _assert_same_batch(a, b, logprob_atol: float = 0.0) -> None:
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        x, y = a.batch[key], b.batch[key]
        if key == "rollout_log_probs" and logprob_atol:
            assert torch.allclose(x, y, atol=logprob_atol), key
        else:
            assert torch.equal(x, y), key


@pytest.mark.parametrize("overrides, needle", [
    (["actor_rollout_ref.rollout.mode=fast"], "actor_rollout_ref.rollout.mode"),
    (["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.name=hf"], "rollout.name=vllm"),
])
def test_bad_rollout_mode_is_refused_in_one_line(overrides, needle, tiny_model_path):
    """Refused before Ray starts (this test runs before the module's e2e tests start their cluster)."""
    with pytest.raises(SystemExit) as exit_info:
        compose_and_prepare([*overrides, f"model_path={tiny_model_path}"])
    line = exit_info.value.code
    assert isinstance(line, str) and "\n" not in line and needle in line, line
    assert not ray.is_initialized()


def _count_engine_calls(rollout) -> list[int]:
    """Record the number of prompts of each ``_generate`` call the rollout makes (it still calls through)."""
    calls: list[int] = []
    generate = rollout._generate

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    rollout._generate = counted
    return calls


@pytest.fixture(scope="module")
def engine(ray_cluster, model_path):
    from agent_trainer.workers.rollout import VLLMRolloutWorker

    return ray_cluster.remote(VLLMRolloutWorker).options(num_cpus=0.5).remote(model_path, max_model_len=1536)


_made: list[SyncMultiTurnRollout] = []


@pytest.fixture(autouse=True)
def _kill_env_actors_after_each_test():
    """Each test's env actors are dead (names free) before the next test builds ``env_train_*`` again."""
    yield
    from agent_trainer.training.lifecycle import kill_actors

    kill_actors([actor for rollout in _made for actor in rollout.env_actors])
    _made.clear()


def _rollout(cfg, tokenizer, engine, tags=None, label=None) -> SyncMultiTurnRollout:
    from agent_trainer.workers.env_worker import EnvWorker

    rollout = SyncMultiTurnRollout(cfg, tokenizer, [engine], EnvWorker, tags or _slow_tags(), split="train",
                                   num_env_actors=2, label=label)
    _made.append(rollout)
    return rollout


@pytest.mark.e2e
def test_sampled_rollout_without_barrier_equals_the_synchronous_one(engine, model_path, tokenizer):
    """Temperature 1, same seeds: the barrier-free batch is the turn-synchronous batch, row for row.

    Each request is seeded by (seed, split, step, env_id, turn), so it does not matter which groups
    shared an engine call; the env latency puts the groups out of step, so they do not share the same ones.
    """
    cfg = _config(f"model_path={model_path}", f"es_manager.train.env_configs.tags=[{SLOW_TAG}]")
    rollout = _rollout(cfg, tokenizer, engine)
    assert rollout.env_pool.max_concurrency == 2  # two groups per actor step at once
    calls = _count_engine_calls(rollout)
    free = rollout.rollout(step=5)
    free_calls, calls[:] = list(calls), []
    replies = dict(rollout.last_generations)
    rollout.barrier_free = False  # the same actors, engine and seeding; the turn-synchronous loop
    synced = rollout.rollout(step=5, seeds=free.group_seeds)
    assert len(free_calls) > len(calls)  # the groups really went out of step: more, smaller engine calls
    assert dict(rollout.last_generations) == replies
    _assert_same_batch(free, synced, logprob_atol=1e-4)  # a logprob may differ in its last bits with the batch
    assert free.metrics["rollout/num_turns_mean"] > 1 and free.metrics["rollout/format_error_rate"] < 0.5
    rollout.barrier_free = True
    rollout.rollout(step=6, seeds=free.group_seeds)
    assert dict(rollout.last_generations) != replies  # the seeds follow the step: not one fixed sample


@pytest.mark.e2e
def test_rollouts_in_flight_share_engine_calls_and_sample_what_each_samples_alone(engine, model_path, tokenizer):
    """Two rollouts playing at once (``trainer.rollouts_in_flight``, each on env actors of its own) send their
    waiting requests to the engine together; each request is seeded on its own, so each rollout's batch is the one
    it plays alone, row for row."""
    import threading
    import time

    from agent_trainer.rollout.engines import EngineCalls

    cfg = _config(f"model_path={model_path}", f"es_manager.train.env_configs.tags=[{SLOW_TAG}]")
    rollouts = [_rollout(cfg, tokenizer, engine), _rollout(cfg, tokenizer, engine, label="train-2")]
    calls = EngineCalls()
    for rollout in rollouts:
        rollout.engine_calls = calls
    seeds = [rollouts[0].next_group_seeds(), rollouts[0].next_group_seeds()]
    results: dict[int, object] = {}

    def play(i):
        results[i] = rollouts[i].rollout(step=5 + i, seeds=seeds[i])

    with calls.lock:  # as if a call were in flight: the two rollouts' first requests wait for it together
        threads = [threading.Thread(target=play, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while len({id(r.owner) for r in calls._waiting}) < 2:
            assert time.monotonic() < deadline and all(t.is_alive() for t in threads), "no request came"
            time.sleep(0.01)
    for t in threads:
        t.join()
    together = [(results[i], dict(rollouts[i].last_generations)) for i in range(2)]
    shared = [rollout.engine_call_counts[1] for rollout in rollouts]
    assert min(shared) >= 1, shared  # their first calls at least went out as one
    for i, rollout in enumerate(rollouts):  # now one at a time, from the same seeds and steps
        alone = rollout.rollout(step=5 + i, seeds=seeds[i])
        assert rollout.engine_call_counts[1] == 0
        assert dict(rollout.last_generations) == together[i][1]
        _assert_same_batch(alone, together[i][0], logprob_atol=1e-4)  # a logprob's last bits follow the batch
    assert together[0][0].metrics["rollout/num_turns_mean"] > 1


@pytest.mark.e2e
def test_greedy_rollout_without_barrier_equals_todays_synchronous_one(engine, model_path, tokenizer):
    """Greedy: the barrier-free batch equals the default (rollout.mode=sync, one seed per call) batch."""
    cfg = _config(f"model_path={model_path}", "actor_rollout_ref.rollout.temperature=0",
                  f"es_manager.train.env_configs.tags=[{SLOW_TAG}]")
    rollout = _rollout(cfg, tokenizer, engine)
    free = rollout.rollout(step=3)
    replies = dict(rollout.last_generations)
    rollout.barrier_free = rollout.seed_per_request = False  # what rollout.mode=sync runs
    synced = rollout.rollout(step=3, seeds=free.group_seeds)
    assert dict(rollout.last_generations) == replies
    _assert_same_batch(free, synced, logprob_atol=1e-4)
    assert free.metrics["rollout/num_turns_mean"] == synced.metrics["rollout/num_turns_mean"] > 1


@pytest.mark.e2e
def test_condensed_rollout_with_summaries_without_barrier(engine, model_path, tokenizer):
    """The condensation hook (summaries written by the policy) and the contract check run in the async loop;
    with greedy summaries it gives the batch the sync loop gives."""
    cfg = _config(f"model_path={model_path}", f"es_manager.train.env_configs.tags=[{SLOW_TAG}]",
                  "ctx_manager.mode=condensed", "algorithm.adv_estimator=grpo_multiturn",
                  "multiturn_trajectory.context_condenser.type=summary",
                  "multiturn_trajectory.context_condenser.keep_last_n_steps=1",
                  "multiturn_trajectory.context_condenser.summary_max_tokens=16", "trajectory_profiling.enable=true")
    rollout = _rollout(cfg, tokenizer, engine)
    free = rollout.rollout(step=2)
    assert free.metrics["profile/summaries"] > 0 and len(free.batch) > 8  # one row per turn
    rollout.barrier_free = False
    synced = rollout.rollout(step=2, seeds=free.group_seeds)
    _assert_same_batch(free, synced, logprob_atol=1e-4)
    assert free.metrics["profile/summaries"] == synced.metrics["profile/summaries"]


@pytest.mark.e2e
def test_an_env_timeout_ends_only_that_actors_episodes(engine, model_path, tokenizer):
    """A step that misses env_step_timeout_s: its actor is replaced once; its episodes, ended by the
    infrastructure, leave the batch and their groups' statistics (counted); the other actor's groups train."""
    cfg = _config(f"model_path={model_path}", f"es_manager.train.env_configs.tags=[FrozenLake3x3,{SLOW_TAG}]",
                  "es_manager.train.env_configs.n_groups=[2,2]", "es_manager.env_step_timeout_s=0.5",
                  "agent_proxy.max_turn=2")
    tags = _slow_tags()
    env_config = dict(tags[SLOW_TAG].env_config, min_latency_ms=2000.0, max_latency_ms=2000.0)
    tags[SLOW_TAG] = dataclasses.replace(tags[SLOW_TAG], env_config=env_config)
    rollout = _rollout(cfg, tokenizer, engine, tags)
    result = rollout.rollout(step=1)
    assert result.metrics["rollout/env_timeouts"] >= 1 and rollout.env_pool.replaced == 1  # the slow actor, once
    assert result.metrics[f"env/{SLOW_TAG}/timeouts"] == 4 and result.metrics["rollout/env_actor_lost"] == 4
    slow_envs = {e.env_id for e in rollout.episodes if e.tag == SLOW_TAG}
    assert len(result.batch) == 4 and not slow_envs & set(result.batch["traj_uid"].tolist())
    assert result.metrics["rollout/small_groups_dropped"] == 0  # a whole group left, not a part of one

@pytest.mark.e2e
def test_an_env_actor_killed_mid_episode_is_left_out_of_its_groups_and_counted(engine, model_path, tokenizer):
    """The slow groups' env actor dies while their first env step runs (a second of latency): their episodes,
    ended by the infrastructure and not by the policy, are left out of the batch and of their groups' baselines
    (rollout/env_actor_lost), never scored as they stood; the fast actor's groups train as usual."""
    import threading
    import time

    cfg = _config(f"model_path={model_path}", f"es_manager.train.env_configs.tags=[FrozenLake3x3,{SLOW_TAG}]",
                  "es_manager.train.env_configs.n_groups=[2,2]", "agent_proxy.max_turn=3")
    tags = _slow_tags()
    tags[SLOW_TAG] = dataclasses.replace(tags[SLOW_TAG], env_config=dict(
        tags[SLOW_TAG].env_config, min_latency_ms=1500.0, max_latency_ms=1500.0))
    rollout = _rollout(cfg, tokenizer, engine, tags)
    slow_envs = {e.env_id for e in rollout.episodes if e.tag == SLOW_TAG}
    slow_actor = rollout.env_actors[rollout.actor_of_env[min(slow_envs)]]

    def kill_once_the_slow_groups_step():
        deadline = time.monotonic() + 300
        while not slow_envs & set(rollout.last_generations) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # inside their 1.5 s env step
        ray.kill(slow_actor, no_restart=False)

    killer = threading.Thread(target=kill_once_the_slow_groups_step)
    killer.start()
    result = rollout.rollout(step=1)
    killer.join()
    m = result.metrics
    assert m["rollout/env_actor_failures"] >= 1 and m["rollout/env_actor_lost"] == 4
    assert len(result.batch) == 4 and not slow_envs & set(result.batch["traj_uid"].tolist())
    assert m["rollout/small_groups_dropped"] == 0


@pytest.mark.e2e
def test_groups_refilled_as_they_end_play_what_the_synchronous_rollout_plays(engine, model_path, tokenizer):
    """``trainer.refill=group``: 4 group slots (k = 1, one rollout's worth, 4 groups a step) on two threaded env
    actors, each reset with the next group seed as soon as its group ends (12 groups: every slot plays three). The slow env puts the groups out of step, so they end (and are
    handed over) in another order than they started; still every group plays, episode for episode and token for
    token, what the synchronous rollout plays for that reset's seed at that step. The start rule caps the groups
    started, and a batch built from refilled groups is numbered as a rollout's (group j, env ids 2j and 2j + 1)."""
    from agent_trainer.rollout import make_context_manager
    from agent_trainer.rollout.stream import GroupStream, stream_split

    cfg = _config(f"model_path={model_path}", f"es_manager.train.env_configs.tags=[{SLOW_TAG}]",
                  "trainer.max_off_policy_steps=1", "trainer.async_mode=continuous", "trainer.refill=group",
                  "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.temperature=1.0")
    stream_cfg = dataclasses.replace(cfg, es_manager=dataclasses.replace(cfg.es_manager, train=stream_split(cfg)))
    streamed = _rollout(stream_cfg, tokenizer, engine)
    streamed.engine_version = lambda: 0  # the trainer counts policy versions; here the weights never change
    assert len({e.group_id for e in streamed.episodes}) == 4
    allowed = [1]  # one step's groups; then two more steps'
    stream = GroupStream(streamed, make_context_manager(cfg, tokenizer), [SLOW_TAG] * 4,
                         steps_allowed=lambda: allowed[0])
    stream.start()
    try:
        first, dropped, empty, aside = stream.take()
        assert stream.started == {SLOW_TAG: 4} and not dropped and not empty and not aside  # the rule held the slots idle once their groups ended
        allowed[0] = 3
        stream.wake()
        later = stream.take()[0] + stream.take()[0]
    finally:
        stream.stop()
    groups = {g.number: g for g in first + later}
    assert sorted(groups) == list(range(12))
    slots = [frozenset(g.generations) for g in groups.values()]  # the env ids of the slot each group played in
    assert len(set(slots)) < len(slots)  # a slot whose group ended played the next one

    plain = _rollout(cfg, tokenizer, engine, label="plain")  # 4 groups, the synchronous loop's seeding per step
    plain.barrier_free = False
    for reset in range(3):
        seeds = plain.next_group_seeds()
        plain.rollout(step=reset + 1, seeds=seeds)
        for g, seed in enumerate(seeds):
            group = groups[reset * 4 + g]
            assert group.seed == seed
            members = sorted(group.generations)
            assert [group.generations[e] for e in members] == [plain.last_generations[2 * g + m] for m in range(2)]
    batch = stream.assemble(first, []).batch
    assert batch.meta.group_seeds == [g.seed for g in first]
    assert sorted(set(batch["traj_uid"].tolist())) == list(range(8)) and batch["uid"].unique().numel() == 4
    assert "token_versions" in batch
