"""The reply parser: well-formed replies give actions; anything else gives none, never an exception."""

import random

from agent_trainer.prompts import first_user_message, next_user_message, parse_response


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
