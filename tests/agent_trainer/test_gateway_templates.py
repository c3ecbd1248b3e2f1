"""Chat-template fidelity: a multi-turn agent through the gateway, the engine's ids fixed, under real templates'
rules (tests/data/chat_templates: Qwen2.5 with tools, Llama-3.1, Qwen3 with thinking), applied with the tiny
model's tokenizer.

Each conversation runs through the gateway app with the real ``openai`` client (in process, no socket); the
"engine" returns fixed ids turn by turn. Where the template re-renders a reply to exactly the sampled ids, the
turns merge into one row whose ids are, turn by turn, the engine's ids and what the template renders between
them (mask 0), the sampled ids kept even where the text's own tokenisation differs; where it does not (Llama's
``trim``, Qwen3 dropping earlier thinking, a client that edits a reply), the row breaks and the next turn starts
a row of its own: counted, never mis-masked.
"""

from __future__ import annotations

from pathlib import Path

import openai
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from agent_trainer.gateway.app import Gateway, create_app
from agent_trainer.gateway.sessions import SessionStore, build_rows
from agent_trainer.workers.rollout import GenerationOutput

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
KEY = "test-key"
TOOLS = [{"type": "function", "function": {"name": "move", "description": "Move one step.", "parameters": {
    "type": "object", "properties": {"direction": {"type": "string", "enum": ["Up", "Down"]}},
    "required": ["direction"]}}}]
TEMPLATE_TOKENS = {
    "qwen2_5_tools": dict(special=[], plain=[], eos="<|im_end|>", bos=None),
    "qwen3_thinking": dict(special=[], plain=["<think>", "</think>"], eos="<|im_end|>", bos=None),
    "llama3_1": dict(special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                     plain=[], eos="<|eot_id|>", bos="<|begin_of_text|>"),
}
"""Each template's tokens added to the tiny tokenizer as its model has them (Qwen3's think tags are added, not
special: they stay in decoded text)."""


def template_tokenizer(tiny_model_path: str, name: str):
    tokens = TEMPLATE_TOKENS[name]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens["special"]} if tokens["special"] else {})
    tokenizer.add_tokens(tokens["plain"])
    tokenizer.eos_token = tokens["eos"]
    if tokens["bos"]:
        tokenizer.bos_token = tokens["bos"]
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


class Agent:
    """A user's agent: the openai client on one session, the engine's replies scripted as ids."""

    def __init__(self, tokenizer, tools=None):
        self.tokenizer, self.tools, self.script, self.store = tokenizer, tools, [], SessionStore()
        gateway = Gateway(tokenizer=tokenizer, generate=self._generate, store=self.store, api_key=KEY, model="m",
                          max_model_len=4096)
        self.session = self.store.open()
        self.client = openai.OpenAI(base_url=f"http://testserver/sessions/{self.session}/v1", api_key=KEY,
                                    http_client=TestClient(create_app(gateway)), max_retries=0)

    def _generate(self, prompts, **_):
        ids = self.script.pop(0)
        return [GenerationOutput(list(ids), [-0.25 - 0.01 * k for k in range(len(ids))], "stop") for _ in prompts]

    def turn(self, messages: list[dict], ids: list[int]) -> dict:
        """One call whose engine output is ``ids``; returns the assistant message as the client got it."""
        self.script.append(ids)
        kwargs = dict(tools=self.tools) if self.tools else {}
        out = self.client.chat.completions.create(model="m", messages=messages, **kwargs)
        return out.choices[0].message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio",
                                                                             "function_call"})


def engine_ids(tokenizer, text: str) -> list[int]:
    """What an engine samples for ``text``: the text's own tokens and the template's end-of-turn token."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def check_merged(tokenizer, records, replies: list[list[int]], between: list[str]):
    """One row: the first prompt, then per turn the engine's ids (mask 1) and the template's text before the next
    turn (mask 0, decoded to exactly ``between``)."""
    rows, metrics = build_rows(records)
    assert (metrics.rows, metrics.merges, metrics.breaks) == (1, len(replies) - 1, 0)
    [row] = rows
    expected, mask = list(records[0].prompt_ids), [0] * len(records[0].prompt_ids)
    for k, ids in enumerate(replies):
        expected += ids
        mask += [1] * len(ids)
        if k + 1 < len(replies):
            context = list(records[k + 1].prompt_ids[len(expected):])
            assert tokenizer.decode(context) == between[k]
            assert list(records[k + 1].prompt_ids[:len(expected)]) == expected  # the prefix holds exactly
            expected += context
            mask += [0] * len(context)
    assert row.input_ids == expected and row.response_mask == mask
    assert [lp for lp, m in zip(row.rollout_log_probs, mask) if m] == [lp for r in records for lp in r.logprobs]


def check_step_wise(records, breaks: int):
    """Every record its own row: its prompt (mask 0) and its sampled ids (mask 1), nothing else masked."""
    rows, metrics = build_rows(records)
    assert (metrics.rows, metrics.merges, metrics.breaks) == (len(records), 0, breaks)
    for row, record in zip(rows, records):
        assert row.input_ids == list(record.prompt_ids) + list(record.completion_ids)
        assert row.response_mask == [0] * len(record.prompt_ids) + [1] * len(record.completion_ids)


def test_qwen2_5_tool_loop_merges_with_the_tool_response_turns_as_context(tiny_model_path):
    tok = template_tokenizer(tiny_model_path, "qwen2_5_tools")
    agent = Agent(tok, tools=TOOLS)
    call = '<tool_call>\n{{"name": "move", "arguments": {{"direction": "{}"}}}}\n</tool_call>'
    replies = [engine_ids(tok, call.format("Up")), engine_ids(tok, "I will go down now.\n" + call.format("Down")),
               engine_ids(tok, "The goal is reached.")]
    messages = [{"role": "system", "content": "You walk on a lake."}, {"role": "user", "content": "Reach the goal."}]
    for k, ids in enumerate(replies):
        message = agent.turn(messages, ids)
        messages += [message]
        if k < 2:
            assert message["tool_calls"][0]["function"]["name"] == "move"
            messages += [{"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": f"obs {k}"}]
    records = agent.store.records(agent.session)
    check_merged(tok, records, replies, between=[
        f"\n<|im_start|>user\n<tool_response>\nobs {k}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        for k in range(2)])


def test_qwen2_5_ids_that_are_not_the_texts_own_tokens_stay_the_sampled_ids(tiny_model_path):
    """The engine sampled "Up" as two pieces; the client sends back the text, which the template's tokenisation
    would make one token (rLLM's silent retokenisation mismatch). The gateway continues the call from its ids:
    the next prompt holds the two sampled pieces, and the row merges with them under the mask."""
    tok = template_tokenizer(tiny_model_path, "qwen2_5_tools")
    pieces = [tok.convert_tokens_to_ids(t) for t in ("U", "p")]
    assert tok.encode("Up", add_special_tokens=False) != pieces and tok.decode(pieces) == "Up"
    agent = Agent(tok)
    messages = [{"role": "user", "content": "Where to?"}]
    replies = [pieces + [tok.eos_token_id], engine_ids(tok, "Down")]
    messages += [agent.turn(messages, replies[0]), {"role": "user", "content": "And then?"}]
    agent.turn(messages, replies[1])
    records = agent.store.records(agent.session)
    assert list(records[1].prompt_ids[:len(records[0].prompt_ids) + 3]) == list(records[0].prompt_ids) + replies[0]
    check_merged(tok, records, replies, between=["\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"])


def test_a_client_that_edits_a_reply_starts_a_new_row(tiny_model_path):
    """The agent sends back another text than the reply (here: the reply edited): no earlier call renders as
    the start of the prompt, so the row breaks and the next call is a row of its own."""
    tok = template_tokenizer(tiny_model_path, "qwen2_5_tools")
    agent = Agent(tok)
    messages = [{"role": "user", "content": "Where to?"}]
    agent.turn(messages, engine_ids(tok, "Up"))
    messages += [{"role": "assistant", "content": "Up, I think"}, {"role": "user", "content": "And then?"}]
    agent.turn(messages, engine_ids(tok, "Down"))
    check_step_wise(agent.store.records(agent.session), breaks=1)


def test_llama3_1_turns_merge_with_the_headers_between_as_context(tiny_model_path):
    tok = template_tokenizer(tiny_model_path, "llama3_1")
    agent = Agent(tok)
    replies = [engine_ids(tok, "Go up."), engine_ids(tok, "Then go left."), engine_ids(tok, "Done.")]
    messages = [{"role": "system", "content": "You walk on a lake."}, {"role": "user", "content": "Start."}]
    for k, ids in enumerate(replies):
        messages += [agent.turn(messages, ids), {"role": "user", "content": f"Observation {k}."}]
    records = agent.store.records(agent.session)
    assert tok.decode(records[0].prompt_ids[:1]) == "<|begin_of_text|>"
    check_merged(tok, records, replies, between=[
        f"<|start_header_id|>user<|end_header_id|>\n\nObservation {k}.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n" for k in range(2)])


def test_llama3_1_trim_of_a_reply_with_outer_spaces_breaks_the_row(tiny_model_path):
    tok = template_tokenizer(tiny_model_path, "llama3_1")
    agent = Agent(tok)
    messages = [{"role": "user", "content": "Start."}]
    messages += [agent.turn(messages, engine_ids(tok, "Go up. ")), {"role": "user", "content": "Next."}]
    agent.turn(messages, engine_ids(tok, "Go left."))
    check_step_wise(agent.store.records(agent.session), breaks=1)


def test_qwen3_keeps_thinking_inside_a_tool_loop_so_the_row_merges(tiny_model_path):
    tok = template_tokenizer(tiny_model_path, "qwen3_thinking")
    agent = Agent(tok, tools=TOOLS)
    replies = [engine_ids(tok, '<think>\nThe goal is up.\n</think>\n\n<tool_call>\n{"name": "move", "arguments": '
                               '{"direction": "Up"}}\n</tool_call>'),
               engine_ids(tok, "<think>\nI am there.\n</think>\n\nReached the goal.")]
    messages = [{"role": "user", "content": "Reach the goal."}]
    message = agent.turn(messages, replies[0])
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "moved"}]
    agent.turn(messages, replies[1])
    check_merged(tok, agent.store.records(agent.session), replies, between=[
        "\n<|im_start|>user\n<tool_response>\nmoved\n</tool_response><|im_end|>\n<|im_start|>assistant\n"])


def test_qwen3_drops_earlier_thinking_after_a_new_user_turn_so_rows_go_step_wise(tiny_model_path):
    tok = template_tokenizer(tiny_model_path, "qwen3_thinking")
    agent = Agent(tok)
    replies = [engine_ids(tok, f"<think>\nStep {k} plan.\n</think>\n\nAnswer {k}.") for k in range(3)]
    messages = [{"role": "user", "content": "Question 0?"}]
    for k, ids in enumerate(replies):
        messages += [agent.turn(messages, ids), {"role": "user", "content": f"Question {k + 1}?"}]
    records = agent.store.records(agent.session)
    rendered = tok.decode(records[1].prompt_ids)
    assert "Step 0 plan" not in rendered and "<|im_start|>assistant\nAnswer 0.<|im_end|>" in rendered
    check_step_wise(records, breaks=2)
