"""Reading exercises for the tiny model's build: what a pretrained model brings to every task, taught generically.

A pretrained LM can already read a line such as ``Left: wall, Down: ice, Right: hole, Up: wall.`` and say
which listed option has which value; RL then only has to learn which value the task wants. The tiny model
is built from scratch, so its build teaches that skill on lines of random keys and values, with questions
that name the value asked for. No environment's policy is in these exercises (no task instruction, no
reward, no goal): the FrozenLake keys and words appear among others, and the questions ask for any of them.

Each exercise is a one-turn chat in the rollout's own prompt layout (``agent_trainer.common.prompts``), answered as
``<answer>KEY</answer>`` (or the value). ``launch.build_tiny_model.reading_accuracy`` is the probe: greedy
exact-match accuracy on exercises the build did not train on (:func:`held_out_exercises`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from agent_trainer.common import prompts

KEY_SETS = (
    ("Left", "Down", "Right", "Up"),
    ("North", "East", "South", "West"),
    ("Red", "Green", "Blue", "Yellow"),
    ("First", "Second", "Third", "Fourth"),
    ("Door", "Window", "Table", "Chair"),
)
"""Keys of a line, in the order they are listed (FrozenLake's directions are one set among several)."""
VALUES = ("ice", "hole", "wall", "goal", "rock", "sand", "water", "tree", "box", "empty", "fire", "grass")
"""Values a key can hold."""
INSTRUCTIONS = ("Read the line and answer the question.", "Answer the question about the line below.",
                "Look at the observation and answer.")
QUESTION_KINDS = ("value_of", "which_is", "which_is_not")
TRAILING_SENTENCE_RATE = 0.3


@dataclass(frozen=True)
class Exercise:
    """One reading exercise: a line of ``key: value`` pairs, a question about it, and its one right answer."""

    line: str
    question: str
    answer: str

    def messages(self, instruction: str) -> list[dict]:
        """The exercise as a chat, in the rollout's answer-only layout, with the answer as the reply."""
        return [{"role": "system", "content": prompts.SYSTEM_PROMPT},
                {"role": "user", "content": self.prompt(instruction)},
                {"role": "assistant", "content": f"<answer>{self.answer}</answer>"}]

    def prompt(self, instruction: str) -> str:
        """The user turn: instruction, the line as the observation, the question, the format line."""
        return prompts.first_user_message(f"{instruction}\nQuestion: {self.question}", self.line,
                                          enable_think=False)


def make_exercise(rng: random.Random) -> Exercise:
    """A random line and a question with exactly one right answer."""
    keys = rng.choice(KEY_SETS)
    values = [rng.choice(VALUES) for _ in keys]
    kind = rng.choice(QUESTION_KINDS)
    line = ", ".join(f"{k}: {v}" for k, v in zip(keys, values)) + "."
    if rng.random() < TRAILING_SENTENCE_RATE:  # a trailing sentence to read past, as some observations have
        line += f" The {rng.choice(VALUES)} is {rng.choice(['near', 'far', 'down', 'up', 'left', 'right'])}."
    if kind == "value_of":
        i = rng.randrange(len(keys))
        return Exercise(line, f"What is {keys[i]}?", values[i])
    options = rng.sample(range(len(keys)), rng.choice([2, 2, 3]))
    target = values[rng.choice(options)]
    matching = [i for i in options if values[i] == target]
    if kind == "which_is" and len(matching) == 1:
        return Exercise(line, f"Which of {' | '.join(keys[i] for i in options)} is {target}?", keys[matching[0]])
    if kind == "which_is_not" and len(matching) == len(options) - 1:
        odd = next(i for i in options if values[i] != target)
        return Exercise(line, f"Which of {' | '.join(keys[i] for i in options)} is not {target}?", keys[odd])
    return make_exercise(rng)  # no single right answer for this draw: draw again


def exercise_chats(n: int, seed: int) -> list[list[dict]]:
    """``n`` exercises as chats (seeded)."""
    rng = random.Random(f"reading/{seed}")
    return [make_exercise(rng).messages(rng.choice(INSTRUCTIONS)) for _ in range(n)]


def held_out_exercises(n: int, seed: int, seen: set[str]) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs whose prompt is not in ``seen`` (the build's training prompts)."""
    rng = random.Random(f"reading-probe/{seed}")
    out = []
    while len(out) < n:
        exercise = make_exercise(rng)
        prompt = exercise.prompt(rng.choice(INSTRUCTIONS))
        if prompt not in seen:
            out.append((prompt, exercise.answer))
    return out


def corpus_texts(seed: int, n: int = 200) -> list[str]:
    """Exercise texts for the tokenizer (so the keys and values become tokens of their own), and every key and
    value alone: a reply's word follows ``<answer>``, which is split off before the BPE sees it, so the bare
    word (``Down``, not only `` Down``) must be a token too."""
    words = [word for keys in KEY_SETS for word in keys] + list(VALUES)
    return [m["content"] for chat in exercise_chats(n, seed) for m in chat[1:]] + words * 20
