"""The reply parser: well-formed replies give actions; anything else gives none, never an exception."""

import random
import re
import time

from agent_trainer.common.prompts import first_user_message, next_user_message, parse_response


def test_think_answer_with_several_actions():
    p = parse_response("<think>go right</think><answer>Right || Down</answer>")
    assert p.format_ok and p.think == "go right" and p.actions == ["Right", "Down"]


def test_missing_think_is_a_format_error_when_think_is_required():
    p = parse_response("<answer>Left</answer>", enable_think=True)
    assert not p.format_ok and p.actions == []
    q = parse_response("<answer>Left</answer>", enable_think=False)
    assert q.format_ok and q.actions == ["Left"]


def test_think_after_answer_is_rejected_and_empty_answer_has_no_actions():
    assert not parse_response("<answer>Left</answer><think>x</think>").format_ok
    assert parse_response("<think>x</think><answer> || </answer>").actions == []


def test_first_complete_answer_block_wins():
    p = parse_response("<think>a</think><answer>Up</answer> trailing <answer>Down</answer>")
    assert p.actions == ["Up"]


def test_garbage_never_raises():
    rng = random.Random(0)
    alphabet = "<>/thinkanswer|| \n\x00😀"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        p = parse_response(text)
        assert p.format_ok == bool(p.actions)
    assert not parse_response(None).format_ok  # type: ignore[arg-type]


def test_messages_contain_the_observation_and_the_format():
    m = first_user_message("Solve it.", "P_\n_G")
    assert "Solve it." in m and "P_\n_G" in m and "<answer>" in m
    assert "Reward: 0.5" in next_user_message("obs", 0.5)


def test_parser_equals_the_non_greedy_regex_on_random_text():
    """The linear parser returns what ``<answer>(.*?)</answer>`` (DOTALL) would."""
    rng = random.Random(1)
    pieces = ["<answer>", "</answer>", "<think>", "</think>", "Up", " || ", "x", "\n", "<", ">"]
    regex = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        match = regex.search(text)
        assert parse_response(text, enable_think=False).answer == (match.group(1).strip() if match else "")


def test_unclosed_tags_parse_in_linear_time():
    """A collapsed model's reply of 100,000 unclosed <answer> tags (800,000 characters): a regex takes minutes."""
    text = "<answer>" * 100_000
    start = time.perf_counter()
    assert not parse_response(text).format_ok
    assert not parse_response("<think>" * 100_000 + "<answer>a</answer>").format_ok
    assert time.perf_counter() - start < 1.0
