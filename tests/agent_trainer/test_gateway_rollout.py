"""The gateway rollout's parts that need no cluster: the agent function key's refusals, an episode's calls and
steps as training rows (rewards, turns, anchors, the layouts), and the batching of concurrent sessions' requests
onto the engines. The whole path runs for real in tests/e2e/test_gateway_e2e.py."""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from agent_trainer.config.splits import Split
from agent_trainer.gateway.sessions import CallRecord
from agent_trainer.gateway.task import is_sync_agent, resolve_agent_fn
from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.rollout.results import rollout_metrics
from agent_trainer.observe.tracking import format_metrics
from agent_trainer.agents.gateway import CondensedGatewayAgent, GatewayAgent, GatewayEpisode, training_rows
from agent_trainer.rollout.engines import GatherRule
from agent_trainer.rollout.gateway import EngineBatcher
from agent_trainer.rollout.multiturn import Generations
from agent_trainer.rollout.splits import SamplingParams

G = "agent_proxy.gateway"


async def two_args(task, client):
    return None


async def one_arg(task):
    return None


def not_async(task, client):
    return None


async def generator(task, client):
    yield None


NOT_A_FUNCTION = 3


@pytest.mark.parametrize("overrides, words", [
    ([f"{G}.agent=nodots"], [f"{G}.agent = 'nodots' is not an import path", "package.module:function"]),
    ([f"{G}.agent=no_such_module.run"], ["module 'no_such_module' does not import", "PYTHONPATH"]),
    ([f"{G}.agent=tests.agent_trainer.test_gateway_rollout.missing"], ["has no 'missing'", "'two_args'"]),
    ([f"{G}.agent=tests.agent_trainer.test_gateway_rollout.NOT_A_FUNCTION"], ["is not a function (int)",
                                                                               "def NOT_A_FUNCTION(task, client)"]),
    ([f"{G}.agent=tests.agent_trainer.test_gateway_rollout.generator"], ["is not a function (a generator function)"]),
    ([f"{G}.agent=tests.agent_trainer.test_gateway_rollout:one_arg"], ["must take two arguments (task, client)"]),
    ([f"{G}.agent=tests.agent_trainer.test_gateway_rollout.two_args", "agent_proxy.agent_cls=tool_call"],
     ["agent_proxy.agent_cls = 'tool_call' and agent_proxy.gateway.agent", "unset agent_proxy.agent_cls"]),
    ([f"{G}.agent=tests.agent_trainer.test_gateway_rollout.two_args", f"{G}.port=70000"], [f"{G}.port = 70000"]),
    ([f"{G}.agent=tests.agent_trainer.test_gateway_rollout.two_args", f"{G}.episode_timeout_s=0"],
     [f"{G}.episode_timeout_s = 0", "must be > 0"]),
])
def test_a_gateway_value_that_cannot_work_is_refused_in_one_line(tiny_model_path, overrides, words):
    with pytest.raises(SystemExit) as err:
        compose_and_prepare([f"model_path={tiny_model_path}", *overrides], "frozenlake")
    message = str(err.value.code)
    assert "\n" not in message and all(w in message for w in words), message


def test_a_synchronous_agent_function_is_taken_and_told_apart_by_the_function_itself(tiny_model_path):
    sync, _ = compose_and_prepare([f"model_path={tiny_model_path}",
                                   f"{G}.agent=examples.gateway.frozenlake_openai_sync.run"], "frozenlake_gateway")
    assert is_sync_agent(resolve_agent_fn(sync))
    async_cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}"], "frozenlake_gateway")
    assert not is_sync_agent(resolve_agent_fn(async_cfg))


def test_the_example_config_names_an_agent_that_resolves(tiny_model_path):
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}"], "frozenlake_gateway")
    assert cfg.agent_proxy.gateway.agent == "examples.gateway.frozenlake_openai.run"
    assert cfg.agent_proxy.gateway.host == "127.0.0.1"


def record(request: int, prompt: list[int], completion: list[int], choice: int = 0) -> CallRecord:
    return CallRecord(request_index=request, choice_index=choice, prompt_ids=tuple(prompt),
                      completion_ids=tuple(completion), logprobs=tuple(-0.5 for _ in completion),
                      finish_reason="stop", policy_version=0)


def episode(records: list[CallRecord], steps: list[tuple[int, float, int]], returned=None) -> GatewayEpisode:
    e = GatewayEpisode(env_id=3, group_id=1, tag="FrozenLake", instruction="", observation="o0", anchor=100,
                       records=records, steps=steps, returned_reward=returned)
    e.finish()
    return e


# Two calls that merge: prompt [1, 2], reply [10, 11]; then [1, 2, 10, 11, 5] and reply [12].
MERGED = [record(0, [1, 2], [10, 11]), record(1, [1, 2, 10, 11, 5], [12])]


def test_each_steps_reward_goes_on_the_last_token_of_the_reply_before_it():
    (row,) = training_rows(episode(MERGED, steps=[(1, -0.1, 200), (2, 1.0, 300)]))
    assert row.token_ids == [1, 2, 10, 11, 5, 12] and row.response_mask == [0, 0, 1, 1, 0, 1]
    assert row.rewards == [0, 0, 0, -0.1, 0, 1.0]
    assert row.turn_ids == [0, 0, 1, 1, 1, 2]  # call k's reply and the context after it are turn k (1-based)
    assert row.anchor_ids == [0, 0, 100, 100, 100, 200]  # the observation each call answered
    assert row.rollout_log_probs == [0, 0, -0.5, -0.5, 0, -0.5] and (row.traj_id, row.group_id) == (3, 1)
    assert episode(MERGED, steps=[(1, -0.1, 200), (2, 1.0, 300)]).total_reward == pytest.approx(0.9)


def test_turns_count_env_steps_and_calls_their_own_replies():
    """An agent that asks again before acting (a re-send after an unusable reply): 3 calls, 2 env steps. The
    episode's turns (rollout/num_turns_mean, the console's turns) are its env steps; its calls are replies."""
    retried = MERGED + [record(2, [1, 2, 10, 11, 5, 12, 6], [13, 14, 15])]
    e = episode(retried, steps=[(2, 0.0, 200), (3, 1.0, 300)])
    assert (e.num_turns, e.num_replies) == (2, 3)
    m = rollout_metrics([e], [], prefix="rollout")
    assert m["rollout/num_turns_mean"] == 2 and m["rollout/response_length_mean"] == pytest.approx(6 / 3)
    assert m["rollout/format_error_rate"] == 0
    silent = episode([record(0, [1, 2], [10])], steps=[])  # one call, no step (its agent raised): still trained
    assert (silent.num_turns, silent.num_replies) == (0, 1)
    line = format_metrics({**m, "rollout/num_calls_mean": 3.0, "rollout/gateway_merged": 5.0,
                           "rollout/gateway_stepwise": 2.0}, 1)
    assert "turns 2.0  calls 3.0  merged   5  stepwise   2" in line, line  # turns, calls, and which path


def test_a_returned_reward_replaces_the_env_rewards_on_the_last_reply():
    e = episode(MERGED, steps=[(1, -0.1, 200)], returned=0.25)
    (row,) = training_rows(e)
    assert row.rewards == [0, 0, 0, 0, 0, 0.25] and e.total_reward == 0.25


def test_a_step_before_any_call_credits_the_first_reply():
    (row,) = training_rows(episode(MERGED, steps=[(0, 0.5, 200)]))
    assert row.rewards[3] == 0.5


class _Tokenizer:
    pad_token_id, eos_token_id = 0, 9


def test_an_episode_whose_calls_do_not_merge_trains_as_one_row_per_call_in_either_layout():
    """A re-sent request after an unusable reply: the second call's prompt is the first's again, so it extends no
    row. The episode trains step-wise, each call a row of its own prompt (mask 0) and exactly its sampled ids
    (mask 1), its step's reward on the reply that led to it; the episode's rows share its traj_uid."""
    resent = [record(0, [1, 2], [10]), record(1, [1, 2], [11, 12]), record(2, [1, 2, 11, 12, 5], [13])]
    whole = episode(MERGED, steps=[(2, 1.0, 1)])
    split = episode(resent, steps=[(2, 0.5, 1), (3, 1.0, 2)])
    split.env_id = 4
    assert split.row_metrics.breaks == 1 and split.row_metrics.stepwise and not whole.row_metrics.stepwise
    assert [(r.input_ids, r.response_mask) for r in split.rows] == [
        ([1, 2, 10], [0, 0, 1]), ([1, 2, 11, 12], [0, 0, 1, 1]), ([1, 2, 11, 12, 5, 13], [0, 0, 0, 0, 0, 1])]
    for agent in (GatewayAgent(_Tokenizer()), CondensedGatewayAgent(_Tokenizer())):
        batch = agent.build_update_batch([whole, split])
        assert batch["traj_uid"].tolist() == [3, 4, 4, 4]
        assert batch["token_level_rewards"][1:].sum(-1).tolist() == [0.0, 0.5, 1.0]
        assert batch["turn_ids"][3].tolist() == [0, 0, 0, 0, 0, 3]  # the call's number on its reply


class _Engines:
    """A stand-in for the rollout's ``_generate``: each prompt's reply is its last id + 1, from policy version n at
    the n-th call; slow enough that requests queue while one call runs."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def __call__(self, prompts, sampling, seed, budgets=None):
        self.calls.append((len(prompts), sampling.stop_token_ids, list(budgets)))
        time.sleep(0.2)
        if self.fail:
            raise RuntimeError("engine down")
        return Generations([([p[-1] + 1, 9], [-0.1, -0.2]) for p in prompts], version=len(self.calls))


def _batcher(engines: _Engines, live: int = 1) -> EngineBatcher:
    cfg = SimpleNamespace(trainer=SimpleNamespace(seed=1),
                          actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(response_length=16)))
    rollout = SimpleNamespace(cfg=cfg, split=Split.TRAIN, _generate=engines, ctx=SimpleNamespace(
        tokenizer=_Tokenizer()))
    return EngineBatcher(rollout, SamplingParams(max_tokens=16, temperature=1.0), step=0, live=lambda: live)


def _ask(batcher, prompt, out, **kw):
    args = dict(max_tokens=64, temperature=1.0, top_p=1.0, stop_token_ids=None, seed=None) | kw
    try:
        out[prompt[0]] = batcher([prompt], **args)
    except RuntimeError as err:
        out[prompt[0]] = err


def test_concurrent_requests_share_engine_calls_and_each_gets_its_own_reply():
    engines = _Engines()
    batcher, out = _batcher(engines), {}
    threads = [threading.Thread(target=_ask, args=(batcher, [k], out), kwargs=dict(temperature=0.5 if k == 3 else 1.0))
               for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {k: (v[0].token_ids, v[0].finish_reason) for k, v in out.items()} == {k: ([k + 1, 9], "stop")
                                                                                 for k in range(8)}
    assert sum(n for n, _, _ in engines.calls) == 8 and len(engines.calls) < 8  # batched
    # each reply carries the policy version of the engine call that served it (continuous async training's tag)
    assert Counter(v[0].version for v in out.values()) == {i + 1: n for i, (n, _, _) in enumerate(engines.calls)}
    assert all(budgets == [16] * n for n, _, budgets in engines.calls)  # max_tokens capped by response_length
    assert batcher.requests == 8 and batcher.overridden == 1 and batcher.engine_calls == len(engines.calls)


def test_the_first_request_waits_for_every_live_session_so_lockstep_agents_share_one_call():
    engines = _Engines()
    batcher, out = _batcher(engines, live=6), {}
    batcher.calls.rule = GatherRule(max_s=600.0, call_fraction=0.0, quiet_s=600.0)  # only the six requests end it
    threads = [threading.Thread(target=_ask, args=(batcher, [k], out)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [n for n, _, _ in engines.calls] == [6] and sorted(out) == list(range(6))


def test_requests_with_other_stop_ids_go_in_their_own_call_and_an_engine_error_fails_its_requests():
    engines = _Engines()
    batcher, out = _batcher(engines), {}
    _ask(batcher, [5], out, stop_token_ids=[7])
    assert engines.calls == [(1, [7], [16])] and out[5][0].finish_reason == "stop"  # ends in the eos (9)
    failing = _Engines(fail=True)
    batcher, out = _batcher(failing), {}
    _ask(batcher, [1], out)
    assert isinstance(out[1], RuntimeError) and "engine down" in str(out[1])


def test_a_local_task_steps_its_env_charges_a_missing_action_and_ends():
    """``Task.local``: the in-process task a user tries an agent with (no env actor): a real FrozenLake."""
    import asyncio

    from envs import make_env

    from agent_trainer.gateway.task import EpisodeOver, Task

    env = make_env("FrozenLake")
    task = Task.local(env, seed=3, instruction="Walk.", tag="FrozenLake", model="m", max_turns=2)
    assert task.observation == make_env("FrozenLake").reset(seed=3) and not task.done
    missing = asyncio.run(task.step(None))
    assert missing.reward == -0.1 and missing.info == {"action_is_valid": False}
    assert missing.observation == task.observation and task.turns == 1 and not task.done
    moved = asyncio.run(task.step(["Left", "Up"]))  # the first action of a list is taken
    assert moved.info["action_is_valid"] and task.done and task.turns == 2  # max_turns reached
    assert task.reward == -0.1 + moved.reward
    with pytest.raises(EpisodeOver, match="is over after 2 steps"):
        asyncio.run(task.step("Left"))


def test_a_local_task_starts_with_the_instruction_a_training_episode_of_its_tag_gets():
    from envs import load_env_tags, make_env

    from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
    from agent_trainer.gateway.task import Task

    tag = "FrozenLakeNoDeadEnds"
    [trained] = EnvStateManager(load_env_tags(), [EpisodeSpec(env_id=0, group_id=0, tag=tag)]).reset({0: 5})
    task = Task.local(make_env(tag), seed=5, tag=tag, model="m", max_turns=6)
    assert task.instruction == trained.instruction and task.observation == trained.observation
    assert "Valid actions:" in task.instruction and task.instruction.endswith("Give exactly one action per turn.")


def test_a_local_sync_task_steps_without_await():
    """``SyncTask.local``: a synchronous agent's task blocks in ``step`` and returns the result (no event loop)."""
    from envs import make_env

    from agent_trainer.gateway.task import SyncTask

    task = SyncTask.local(make_env("FrozenLake"), seed=3, instruction="Walk.", tag="FrozenLake", model="m", max_turns=1)
    moved = task.step("Left")
    assert moved.info["action_is_valid"] and task.done and task.turns == 1 and task.reward == moved.reward


def test_a_sync_agent_runs_in_a_daemon_thread_whose_result_or_error_reaches_its_episode():
    """``in_thread``: the result and the exception of a synchronous agent come back to the event loop; one past its
    deadline is cancelled there and its thread, a daemon, ends on its own without raising into the closed loop."""
    import asyncio

    from agent_trainer.rollout.gateway import in_thread

    seen = {}

    async def play():
        loop = asyncio.get_running_loop()
        seen["sum"] = await in_thread(loop, lambda a, b: a + b, 1, 2, name="agent-sum")
        with pytest.raises(ZeroDivisionError):
            await in_thread(loop, lambda: 1 / 0, name="agent-error")
        release = threading.Event()
        late = in_thread(loop, release.wait, name="agent-late")
        done, _ = await asyncio.wait({late}, timeout=0.05)
        late.cancel()
        seen["late"] = (done, next(t for t in threading.enumerate() if t.name == "agent-late").daemon)
        return release

    release = asyncio.run(play())
    release.set()  # the loop is closed by now: the thread's result is dropped quietly
    assert seen == {"sum": 3, "late": (set(), True)}
