"""The build's reading exercises: each question has exactly the one right answer it is given."""

import random
import re

from agent_trainer.common import prompts
from launch import reading_corpus as rc


def _pairs(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+): (\w+)", line.split(".")[0]))


def test_every_exercise_has_exactly_its_answer():
    rng = random.Random(0)
    kinds = set()
    for _ in range(500):
        ex = rc.make_exercise(rng)
        values = _pairs(ex.line)
        if ex.question.startswith("What is "):
            kinds.add("value_of")
            assert values[ex.question[len("What is "):-1]] == ex.answer
            continue
        options, target = re.fullmatch(r"Which of (.+) is (?:not )?(\w+)\?", ex.question).groups()
        options = options.split(" | ")
        negated = " is not " in ex.question
        kinds.add("which_is_not" if negated else "which_is")
        right = [k for k in options if (values[k] != target) == negated]
        assert right == [ex.answer], ex
    assert kinds == set(rc.QUESTION_KINDS)


def test_the_chat_is_the_rollouts_answer_only_layout_and_the_probe_is_held_out():
    chat = rc.exercise_chats(1, seed=0)[0]
    assert [m["role"] for m in chat] == ["system", "user", "assistant"]
    assert chat[1]["content"].endswith(prompts.ANSWER_ONLY_FORMAT) and "Observation:\n" in chat[1]["content"]
    assert prompts.parse_response(chat[2]["content"], enable_think=False).format_ok
    seen = {c[1]["content"] for c in rc.exercise_chats(300, seed=0)}
    held_out = rc.held_out_exercises(50, seed=0, seen=seen)
    assert len(held_out) == 50 and not {prompt for prompt, _ in held_out} & seen
