"""The gateway over real HTTP: uvicorn on 127.0.0.1 in a thread, the real ``openai`` client, and the tiny model
sampling through the project's HF engine (``HFRolloutWorker``, CPU). No Ray."""

from __future__ import annotations

import json

import httpx
import openai
import psutil
import pytest
from transformers import AutoTokenizer

from agent_trainer.gateway.app import Gateway, create_app
from agent_trainer.gateway.server import GatewayServer, new_api_key
from agent_trainer.gateway.sessions import SessionStore, build_rows
from agent_trainer.workers.rollout import GenerationOutput, HFRolloutWorker

MAX_MODEL_LEN = 512
RESPONSE_LENGTH = 48
"""The served gateway's per-turn budget (``actor_rollout_ref.rollout.response_length`` in a run)."""
TOOLS = [{"type": "function", "function": {"name": "move", "description": "Move one step.", "parameters": {
    "type": "object", "properties": {"direction": {"type": "string", "enum": ["Up", "Down"]}},
    "required": ["direction"]}}}]
MESSAGES = [{"role": "user", "content": "You are on a frozen lake. Where do you go?"}]


@pytest.fixture(scope="module")
def served(tiny_model_path):
    """(server, gateway, the engine calls seen): the tiny model behind the gateway."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = HFRolloutWorker(tiny_model_path, max_model_len=MAX_MODEL_LEN, seed=0)
    calls = []

    def generate(prompts, **sampling):
        calls.append((prompts, sampling))
        return engine.generate(prompts, **sampling)

    gateway = Gateway(tokenizer=tokenizer, generate=generate, store=SessionStore(), api_key=new_api_key(),
                      model="tiny-qwen2", max_model_len=MAX_MODEL_LEN, response_length=RESPONSE_LENGTH,
                      policy_version=lambda: 7)
    with GatewayServer(create_app(gateway)) as server:
        yield server, gateway, calls


def client(served, session_id: str, api_key: str | None = None) -> openai.OpenAI:
    server, gateway, _ = served
    return openai.OpenAI(base_url=server.base_url(session_id), api_key=api_key or gateway.api_key, max_retries=0)


def test_a_completion_returns_what_the_engine_sampled_and_the_session_records_it(served):
    _, gateway, calls = served
    sid = gateway.store.open()
    out = client(served, sid).chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=24,
                                                      temperature=1.0, logprobs=True,
                                                      extra_body={"return_token_ids": True})
    [record] = gateway.store.records(sid)
    prompts, sampling = calls[-1]
    expected_prompt = gateway.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
    assert prompts == [expected_prompt] and list(record.prompt_ids) == expected_prompt
    assert sampling["max_tokens"] == 24 and sampling["temperature"] == 1.0
    choice = out.choices[0]
    assert list(record.completion_ids) == choice.token_ids == choice.model_extra["token_ids"]
    assert out.model_extra["prompt_token_ids"] == expected_prompt
    assert [t.logprob for t in choice.logprobs.content] == list(record.logprobs)
    assert record.policy_version == 7 and record.finish_reason in ("stop", "length")
    decoded = gateway.tokenizer.decode(
        [i for i in record.completion_ids if i != gateway.tokenizer.eos_token_id], skip_special_tokens=True)
    assert choice.message.content == decoded
    assert out.usage.prompt_tokens == len(expected_prompt)
    assert out.usage.completion_tokens == len(record.completion_ids)
    assert choice.finish_reason == record.finish_reason
    rows, metrics = build_rows(gateway.store.close(sid))
    assert metrics.rows == 1 and rows[0].input_ids == expected_prompt + list(record.completion_ids)
    assert sum(rows[0].response_mask) == len(record.completion_ids)


def test_streaming_gives_the_same_text_and_ids_as_recorded(served):
    _, gateway, _ = served
    sid = gateway.store.open()
    chunks = list(client(served, sid).chat.completions.create(
        model="tiny-qwen2", messages=MESSAGES, max_tokens=24, stream=True, logprobs=True,
        stream_options={"include_usage": True}))
    [record] = gateway.store.records(sid)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_logprobs = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                         for t in c.choices[0].logprobs.content]
    assert streamed_logprobs == list(record.logprobs)
    assert text == gateway.tokenizer.decode(
        [i for i in record.completion_ids if i != gateway.tokenizer.eos_token_id], skip_special_tokens=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == record.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(record.completion_ids)


def test_n_choices_are_recorded_each_and_become_rows(served):
    _, gateway, calls = served
    sid = gateway.store.open()
    out = client(served, sid).chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=16, n=2,
                                                      seed=3, extra_body={"return_token_ids": True})
    records = gateway.store.records(sid)
    assert len(calls[-1][0]) == 2 and calls[-1][1]["seed"] == 3
    assert [r.choice_index for r in records] == [0, 1] == [c.index for c in out.choices]
    assert [list(r.completion_ids) for r in records] == [c.token_ids for c in out.choices]
    rows, metrics = build_rows(records)
    assert (metrics.rows, metrics.merges, metrics.breaks) == (2, 0, 0)


def test_tools_reach_the_chat_template_and_a_second_turn_extends_the_row(served):
    _, gateway, calls = served
    sid = gateway.store.open()
    api = client(served, sid)
    first = api.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                        max_tokens=16, temperature=0)
    prompt = gateway.tokenizer.decode(calls[-1][0][0])
    assert '"name": "move"' in prompt and "<tools>" in prompt
    reply = first.choices[0].message
    history = MESSAGES + [{"role": "assistant", "content": reply.content or ""},
                          {"role": "user", "content": "Go on."}]
    api.chat.completions.create(model="tiny-qwen2", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    records = gateway.store.records(sid)
    rows, metrics = build_rows(records)
    merged = list(records[0].prompt_ids) + list(records[0].completion_ids)
    if records[1].prompt_ids[:len(merged)] == tuple(merged):  # the reply re-rendered to the sampled ids
        assert (metrics.rows, metrics.merges, metrics.breaks) == (1, 1, 0)
        assert sum(rows[0].response_mask) == len(records[0].completion_ids) + len(records[1].completion_ids)
    else:
        assert (metrics.rows, metrics.merges, metrics.breaks) == (2, 0, 1)


def test_a_tool_call_in_the_reply_comes_back_as_tool_calls(served):
    """The tiny model rarely writes a well-formed call, so a scripted engine output is parsed here: the same
    app, HTTP and client, with the engine's ids fixed."""
    server, gateway, _ = served
    text = '<tool_call>\n{"name": "move", "arguments": {"direction": "Up"}}\n</tool_call>'
    ids = gateway.tokenizer.encode(text, add_special_tokens=False) + [gateway.tokenizer.eos_token_id]

    fixed = GenerationOutput(ids, [-0.5] * len(ids), "stop")
    scripted = Gateway(tokenizer=gateway.tokenizer, generate=lambda prompts, **_: [fixed] * len(prompts),
                       store=SessionStore(), api_key=gateway.api_key, model="tiny-qwen2", max_model_len=MAX_MODEL_LEN)
    with GatewayServer(create_app(scripted)) as other:
        sid = scripted.store.open()
        api = openai.OpenAI(base_url=other.base_url(sid), api_key=gateway.api_key, max_retries=0)
        out = api.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, tools=TOOLS)
        [call] = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "move" and json.loads(call.function.arguments) == {"direction": "Up"}
        none = api.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, tools=TOOLS, tool_choice="none")
        assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == text
        streamed = list(api.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, tools=TOOLS, stream=True))
        [delta_call] = [c for ch in streamed if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
        assert delta_call.function.name == "move"
        # The client sends the call back: the template renders it as the model wrote it, so the row merges.
        history = MESSAGES + [out.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "You moved up."}]
        api.chat.completions.create(model="tiny-qwen2", messages=history, tools=TOOLS)
        records = [r for r in scripted.store.records(sid) if r.request_index in (0, 3)]
        _, metrics = build_rows(records)
        assert (metrics.rows, metrics.merges, metrics.breaks) == (1, 1, 0)


def test_a_stop_string_stops_the_engine_on_its_token_and_is_left_out_of_the_text(served):
    _, gateway, _ = served
    tok = gateway.tokenizer
    [period] = tok.encode(".", add_special_tokens=False)
    ids = tok.encode("Go up", add_special_tokens=False) + [period]
    seen = []

    def engine(prompts, **sampling):
        seen.append(sampling)
        return [GenerationOutput(ids, [-0.1] * len(ids), "stop")] * len(prompts)

    scripted = Gateway(tokenizer=tok, generate=engine, store=SessionStore(), api_key=gateway.api_key,
                       model="tiny-qwen2", max_model_len=MAX_MODEL_LEN)
    with GatewayServer(create_app(scripted)) as other:
        sid = scripted.store.open()
        api = openai.OpenAI(base_url=other.base_url(sid), api_key=gateway.api_key, max_retries=0)
        out = api.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, stop=".")
    assert seen[0]["stop_token_ids"] == [period]
    assert out.choices[0].message.content == "Go up" and out.choices[0].finish_reason == "stop"
    assert list(scripted.store.records(sid)[0].completion_ids) == ids  # the stop id is trained on, as sampled


def test_a_wrong_or_missing_key_gets_401(served):
    server, gateway, _ = served
    sid = gateway.store.open()
    with pytest.raises(openai.AuthenticationError) as err:
        client(served, sid, api_key="wrong").chat.completions.create(model="tiny-qwen2", messages=MESSAGES)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    response = httpx.post(f"{server.base_url(sid)}/chat/completions", json={"model": "tiny-qwen2",
                                                                           "messages": MESSAGES})
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    assert gateway.store.records(sid) == []


def test_an_unknown_session_or_model_gets_404(served):
    _, gateway, _ = served
    with pytest.raises(openai.NotFoundError) as err:
        client(served, "nope").chat.completions.create(model="tiny-qwen2", messages=MESSAGES)
    assert err.value.code == "session_not_found"
    sid = gateway.store.open()
    with pytest.raises(openai.NotFoundError) as err:
        client(served, sid).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    assert [m.id for m in client(served, sid).models.list()] == ["tiny-qwen2"]
    server = served[0]
    root = httpx.get(f"http://127.0.0.1:{server.port}/v1/models",
                     headers={"Authorization": f"Bearer {gateway.api_key}"})
    assert [m["id"] for m in root.json()["data"]] == ["tiny-qwen2"]
    assert httpx.get(f"http://127.0.0.1:{server.port}/v1/models").status_code == 401
    gateway.store.close(sid)
    with pytest.raises(openai.NotFoundError):
        client(served, sid).models.list()


@pytest.mark.parametrize("extra, param", [
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(temperature="hot"), "temperature"),
    (dict(n=0), "n"),
    (dict(top_k=5), "top_k"),
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(tool_choice="required", tools=TOOLS), "tool_choice"),
    (dict(stop=["a much longer stop sequence"]), "stop"),
    (dict(top_logprobs=3, logprobs=True), "top_logprobs"),
])
def test_a_malformed_or_unsupported_request_gets_400_in_openai_shape(served, extra, param):
    server, gateway, calls = served
    sid = gateway.store.open()
    body = {"model": "tiny-qwen2", "messages": MESSAGES, **extra}
    before = len(calls)
    response = httpx.post(f"{server.base_url(sid)}/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {gateway.api_key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param)
    assert len(calls) == before and gateway.store.records(sid) == []


@pytest.mark.parametrize("messages, param, said", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role", "'wizard' is not a valid role"),
    ([*MESSAGES, {"content": "no role"}], "messages[1].role", "a role is required"),
])
def test_an_unknown_or_missing_role_is_named_with_the_valid_roles(served, messages, param, said):
    """Not pydantic's message for the union's first member ("Input should be 'developer'"), but the bad role
    and the roles the gateway takes."""
    server, gateway, calls = served
    sid = gateway.store.open()
    before = len(calls)
    response = httpx.post(f"{server.base_url(sid)}/chat/completions",
                          json={"model": "tiny-qwen2", "messages": messages},
                          headers={"Authorization": f"Bearer {gateway.api_key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert said in error["message"] and "system, developer, user, assistant, tool" in error["message"]
    assert "Input should be" not in error["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the client raises its usual error, the message kept
        client(served, sid).chat.completions.create(model="tiny-qwen2", messages=messages)
    assert err.value.status_code == 400 and err.value.body["message"] == error["message"]
    assert len(calls) == before and gateway.store.records(sid) == []


def test_a_tool_message_without_its_call_id_names_that_field(served):
    server, gateway, _ = served
    sid = gateway.store.open()
    response = httpx.post(f"{server.base_url(sid)}/chat/completions",
                          json={"model": "tiny-qwen2", "messages": [*MESSAGES, {"role": "tool", "content": "ok"}]},
                          headers={"Authorization": f"Bearer {gateway.api_key}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[1].tool_call_id"


def test_a_body_that_is_not_json_gets_400(served):
    server, gateway, _ = served
    sid = gateway.store.open()
    response = httpx.post(f"{server.base_url(sid)}/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {gateway.api_key}", "Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_a_prompt_over_max_model_len_gets_context_length_exceeded(served):
    _, gateway, calls = served
    sid = gateway.store.open()
    before = len(calls)
    long = [{"role": "user", "content": "lake " * MAX_MODEL_LEN}]
    for asked in ({}, {"max_tokens": 8}):
        with pytest.raises(openai.BadRequestError) as err:
            client(served, sid).chat.completions.create(model="tiny-qwen2", messages=long, **asked)
        assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
        assert err.value.body["param"] == "messages" and str(MAX_MODEL_LEN) in err.value.body["message"]
    assert len(calls) == before and gateway.store.records(sid) == []


def test_max_tokens_over_the_budget_is_capped_and_served(served):
    """Agent frameworks ask for 4096 and more: the call is served with the run's per-turn budget."""
    _, gateway, calls = served
    sid = gateway.store.open()
    out = client(served, sid).chat.completions.create(model="tiny-qwen2", messages=MESSAGES,
                                                      max_tokens=MAX_MODEL_LEN, temperature=1.0)
    [record] = gateway.store.records(sid)
    assert calls[-1][1]["max_tokens"] == RESPONSE_LENGTH
    assert out.usage.completion_tokens == len(record.completion_ids) <= RESPONSE_LENGTH
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("response_length, asked, room_left, expected", [
    (None, {"max_tokens": 5000}, None, "room"),              # the context left after the prompt
    (None, {}, None, "room"),
    (64, {"max_tokens": 5000}, None, 64),                    # the run's per-turn budget
    (64, {"max_completion_tokens": 4096, "max_tokens": 8}, None, 64),
    (64, {"max_tokens": 10}, None, 10),                      # under the budget: as asked
    (64, {}, None, 64),
    (64, {"max_tokens": 4096}, 20, 20),                      # a long prompt: the context left is smaller
    (64, {"max_tokens": 4096}, 1, 1),
])
def test_max_tokens_is_capped_to_the_smaller_of_the_budget_and_the_room_left(served, response_length, asked,
                                                                              room_left, expected):
    _, gateway, _ = served
    prompt = len(gateway.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
    max_model_len = prompt + room_left if room_left is not None else MAX_MODEL_LEN
    seen = []

    def engine(prompts, **sampling):
        seen.append(sampling)
        return [GenerationOutput([5], [-0.1], "length")] * len(prompts)

    scripted = Gateway(tokenizer=gateway.tokenizer, generate=engine, store=SessionStore(), api_key=gateway.api_key,
                       model="tiny-qwen2", max_model_len=max_model_len, response_length=response_length)
    with GatewayServer(create_app(scripted)) as other:
        sid = scripted.store.open()
        api = openai.OpenAI(base_url=other.base_url(sid), api_key=gateway.api_key, max_retries=0)
        out = api.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, **asked)
    assert seen[0]["max_tokens"] == (max_model_len - prompt if expected == "room" else expected)
    assert out.choices[0].finish_reason == "length"


def broken(prompts, **_):
    raise RuntimeError("engine died")


def misaligned(prompts, **_):
    return [GenerationOutput([5, 6], [-0.1], "stop")] * len(prompts)


@pytest.mark.parametrize("engine", [broken, misaligned])
def test_an_engine_failure_gets_500_and_records_nothing(served, engine):
    _, gateway, _ = served
    failing = Gateway(tokenizer=gateway.tokenizer, generate=engine, store=SessionStore(), api_key=gateway.api_key,
                      model="tiny-qwen2", max_model_len=MAX_MODEL_LEN)
    with GatewayServer(create_app(failing)) as other:
        sid = failing.store.open()
        api = openai.OpenAI(base_url=other.base_url(sid), api_key=gateway.api_key, max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            api.chat.completions.create(model="tiny-qwen2", messages=MESSAGES)
        assert err.value.status_code == 500 and err.value.body["type"] == "server_error"
        assert failing.store.records(sid) == []


def test_a_client_that_disconnects_mid_stream_loses_only_its_call(served):
    """The stream is dropped after its first chunk: the call was sampled and stays recorded (a row of its own,
    since nothing continues it), and the session and the server go on serving."""
    server, gateway, _ = served
    sid = gateway.store.open()
    body = {"model": "tiny-qwen2", "messages": MESSAGES, "stream": True, "max_tokens": 8}
    with httpx.stream("POST", f"{server.base_url(sid)}/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {gateway.api_key}"}) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    out = client(served, sid).chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert [r.request_index for r in gateway.store.close(sid)] == [0, 1]


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="non-empty api_key"):
        Gateway(tokenizer=None, generate=None, store=SessionStore(), api_key="", model="m", max_model_len=8)


def test_the_server_listens_on_127_0_0_1_only(served):
    server, _, _ = served
    listening = [c.laddr for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening)


def test_an_agent_built_with_the_openai_agents_sdk_plays_through_the_gateway(tiny_model_path):
    """examples/gateway/frozenlake_agents_sdk.py (the SDK's Agent, function tool and Runner) against the gateway
    and the tiny model, its tool stepping a real FrozenLake: every request the SDK sends is accepted, carries
    the tool, and is recorded."""
    import asyncio

    from envs import make_env
    from examples.gateway import frozenlake_agents_sdk

    from agent_trainer.gateway.task import Task

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = HFRolloutWorker(tiny_model_path, max_model_len=1536, seed=0)  # the SDK's tool schema is long
    gateway = Gateway(tokenizer=tokenizer, generate=engine.generate, store=SessionStore(), api_key=new_api_key(),
                      model="tiny-qwen2", max_model_len=1536)
    env = make_env("FrozenLake")
    sid = gateway.store.open()
    task = Task.local(env, seed=0, instruction=f"Walk to the goal.\nValid actions: {env.action_description()}",
                      tag="FrozenLake", model="tiny-qwen2", max_turns=3)
    with GatewayServer(create_app(gateway)) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key=gateway.api_key, max_retries=0)
        asyncio.run(frozenlake_agents_sdk.run(task, client))
    records = gateway.store.close(sid)
    assert records and task.turns >= 1
    first = gateway.tokenizer.decode(list(records[0].prompt_ids))
    assert '"name": "move"' in first and "Walk to the goal." in first
