"""The body of the gateway's Ray actor (``agent_trainer.gateway.host.GatewayHost``) in this process: real HTTP
through uvicorn and the real ``openai`` client, the engine calls served by the test as the driver serves them
(``take`` then ``deliver``) with the tiny model's HF engine. The actor itself runs in tests/e2e/test_gateway_e2e.py."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from transformers import AutoTokenizer

from agent_trainer.gateway.host import GatewayHost, serve_requests
from agent_trainer.gateway.server import new_api_key, session_url
from agent_trainer.rollout.gateway import Combined, Sampled
from agent_trainer.workers.rollout import GenerationOutput, HFRolloutWorker

MESSAGES = [{"role": "user", "content": "You are on a frozen lake. Where do you go?"}]


@pytest.fixture(scope="module")
def host(tiny_model_path):
    host = GatewayHost(AutoTokenizer.from_pretrained(tiny_model_path), api_key=new_api_key(), model="policy",
                       max_model_len=512, host="127.0.0.1", port=0)
    yield host
    host.stop()


def _client(host: GatewayHost, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=session_url(*host.address(), session), api_key=host.gateway.api_key, max_retries=0)


def _call_in_thread(host: GatewayHost, session: str, **extra) -> tuple[threading.Thread, dict]:
    got: dict = {}

    def call():
        try:
            got["reply"] = _client(host, session).chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=16, logprobs=True,
                extra_body={"return_token_ids": True}, **extra)
        except openai.APIError as err:
            got["error"] = err

    thread = threading.Thread(target=call)
    thread.start()
    return thread, got


def test_a_call_waits_for_the_driver_and_gets_what_it_delivered(host, tiny_model_path):
    engine = HFRolloutWorker(tiny_model_path, max_model_len=512, seed=0)
    session = host.open_session(policy_version=5)
    thread, got = _call_in_thread(host, session, temperature=0.5)
    [request] = host.take(wait_s=30)  # the request the app could not answer from its own state
    assert request.max_tokens == 16 and request.temperature == 0.5 and len(request.prompts) == 1
    assert host.take(wait_s=0.01) == []  # taken once
    outputs = engine.generate(request.prompts, **request.sampling())
    host.deliver(request.request_id, outputs)
    thread.join(30)
    choice = got["reply"].choices[0]
    assert choice.model_extra["token_ids"] == outputs[0].token_ids
    assert [t.logprob for t in choice.logprobs.content] == outputs[0].logprobs
    assert host.before_step(session) == (1, outputs[0].token_ids)
    [record] = host.close_session(session)
    assert list(record.completion_ids) == outputs[0].token_ids and record.policy_version == 5


def test_a_call_served_by_a_later_policy_version_is_recorded_with_it(host, tiny_model_path):
    """Continuous asynchronous training: the engines may take new weights between two calls of a session, and each
    call's record carries the version of the engine call that served it, not the one the session opened with."""
    engine = HFRolloutWorker(tiny_model_path, max_model_len=512, seed=0)
    session = host.open_session(policy_version=3)
    for version in (3, 4):
        thread, got = _call_in_thread(host, session)
        [request] = host.take(wait_s=30)
        outputs = [Sampled(o.token_ids, o.logprobs, o.finish_reason, version)
                   for o in engine.generate(request.prompts, **request.sampling())]
        host.deliver(request.request_id, outputs)
        thread.join(30)
        assert got["reply"].choices[0].model_extra["token_ids"] == outputs[0].token_ids
    assert [r.policy_version for r in host.close_session(session)] == [3, 4]


def test_a_failed_or_abandoned_engine_call_is_a_500_for_its_agent_only(host):
    session = host.open_session(policy_version=0)
    failed, got_failed = _call_in_thread(host, session)
    [request] = host.take(wait_s=30)
    host.deliver(request.request_id, None, "RuntimeError: the engine is gone")
    failed.join(30)
    assert isinstance(got_failed["error"], openai.InternalServerError)
    abandoned, got_abandoned = _call_in_thread(host, session)
    assert len(host.take(wait_s=30)) == 1
    assert host.fail_waiting("the rollout is over") == 1  # a rollout ended with the call unanswered
    abandoned.join(30)
    assert isinstance(got_abandoned["error"], openai.InternalServerError)
    assert host.close_session(session) == []  # nothing was recorded for either


def test_the_driver_side_pump_serves_every_request_until_stopped(host):
    session = host.open_session(policy_version=0)
    stopped, served = threading.Event(), []

    def serve(request):
        served.append(request.request_id)
        host.deliver(request.request_id, [GenerationOutput([7], [-0.5], "length")])

    pump = threading.Thread(target=serve_requests, args=(lambda: host.take(0.05), serve, stopped, 4))
    pump.start()
    calls = [_call_in_thread(host, session) for _ in range(3)]
    for thread, _ in calls:
        thread.join(30)
    stopped.set()
    pump.join(30)
    assert len(served) == 3 and all(got["reply"].choices[0].model_extra["token_ids"] == [7] for _, got in calls)
    assert len(host.close_session(session)) == 3


def test_requests_that_arrive_together_are_taken_together_and_answered_in_one_delivery(host):
    """Agents answered by one engine call ask again within moments of each other: the driver takes their requests
    in one ``take`` and hands every answer back in one ``deliver_many``."""
    sessions = host.open_sessions(policy_version=0, n=6)
    calls = [_call_in_thread(host, session) for session in sessions]
    deadline = time.monotonic() + 30
    while len(host._untaken) < 6 and time.monotonic() < deadline:  # all six reached the app
        time.sleep(0.01)
    taken = host.take(wait_s=30)
    assert len(taken) == 6
    host.deliver_many([(r.request_id, [GenerationOutput([7 + k], [-0.5], "length")], "")
                       for k, r in enumerate(taken)])
    for thread, _ in calls:
        thread.join(30)
    by_request = {r.request_id: 7 + k for k, r in enumerate(taken)}
    assert sorted(got["reply"].choices[0].model_extra["token_ids"][0] for _, got in calls) == sorted(
        by_request.values())
    assert [host.before_steps([s])[0][0] for s in sessions] == [1] * 6
    for session in sessions:
        host.close_session(session)


def test_combined_sends_every_item_once_in_fewer_calls_than_items():
    sent: list[list[int]] = []

    def send(items):
        sent.append(items)
        time.sleep(0.02)  # a slow send: the items put meanwhile wait for the next one

    combined = Combined(send)
    threads = [threading.Thread(target=combined.put, args=(k,)) for k in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(k for items in sent for k in items) == list(range(40))
    assert len(sent) < 40
