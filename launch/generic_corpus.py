"""Synthetic environments for the tiny model's build: "choose one of the listed valid actions" taught generically.

A pretrained instruct model answers ``Valid actions: Up | Down | Open`` with one of those actions for any
environment; the tiny model is built from scratch and has only seen the environments of its corpus, so without
this it answers a new one with their words. The build therefore also plays many made-up environments: each
``reset(seed)`` of :class:`SyntheticEnv` draws a new one, with 2-6 actions of 1-3 words (ordinary and made-up
words, in one of several letter cases) and observations of one style (a grid with a legend, sentences, numbers,
``key: value`` lines, a list). It is an ordinary ``BaseEnv`` registered by import path and presents its actions
as docs/writing_an_environment.md tells a user to (``action_description() -> "A | B | C"``, a ``legend()``), so
its prompts come from the same functions as the rollout's (``es_manager.episode_instruction``,
``prompts.first_user_message``). The warm-up replies pick among the listed actions uniformly: no task, no policy.

Their text is not in the tokenizer's training corpus: made-up words split into byte-level pieces there, as an
unseen user's words do, so the warm-up teaches copying pieces, not whole-word tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from envs import BaseEnv, make_info

ENV_TYPE = "launch.generic_corpus:SyntheticEnv"
WORDS = (
    "move go walk run jump climb push pull open close take drop use look read wait rest turn lift lower "
    "press hold throw catch buy sell pay ask tell call search scan fire load save stop start play pass "
    "fold raise check bet hit stand split draw pick place build dig plant water feed cook eat drink sleep "
    "north south east west left right up down forward back top bottom middle inner outer next previous "
    "door gate key box chest lamp torch rope map coin card stone wood iron gold silver table chair bed "
    "window road bridge river tower cave room hall shop bank cart item tool button lever switch valve pipe "
    "red blue green yellow black white small large old new quick slow first second third last "
    "one two three four five alpha beta gamma delta sigma omega node edge path"
).split()
"""Ordinary words for actions and observations (none of them a word the test's unseen environment uses)."""
SYLLABLES = ("ba be bi bo bu ka ke ki ko ku za ze zi zo zu ra re ri ro ru ta te ti to tu ma me mi mo mu "
             "fle gra pli tro snu vex qua wim jor dro kly prax zun ulm orb esk").split()
CASES = ("title", "lower", "upper", "first", "mixed")
STYLES = ("grid", "sentences", "numbers", "fields", "list")
GRID_SYMBOLS = "#._@*+oxXO$%&=~^PBGT"
INSTRUCTIONS = (
    "Solve the task.", "Reach the {w}.", "Find the {w} and bring it back.", "Collect as many {w}s as you can.",
    "Get the {w} to the {v}.", "Avoid the {w}.", "Win the game.", "Open the {w}.", "Keep the {w} safe.",
    "Choose well.", "Follow the rules of the game.", "Play the game below.",
)


def made_up_word(rng: random.Random) -> str:
    """A pronounceable word that is (almost surely) in no dictionary: 1-3 syllables."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))


def _cased(words: list[str], case: str, rng: random.Random) -> str:
    if case == "title":
        return " ".join(w.capitalize() for w in words)
    if case == "upper":
        return " ".join(w.upper() for w in words)
    if case == "first":
        return " ".join(words).capitalize()
    if case == "mixed":
        return " ".join(w.capitalize() if rng.random() < 0.5 else w for w in words)
    return " ".join(words)


def action_set(rng: random.Random) -> list[str]:
    """2-6 distinct actions of 1-3 words each, in one letter case; some words made up, some with a number."""
    case, made_up = rng.choice(CASES), rng.choice((0.0, 0.3, 1.0))
    max_words = rng.choice((1, 1, 2, 3))
    actions: list[str] = []
    n_actions = rng.randint(2, 6)
    while len(actions) < n_actions:
        words = [made_up_word(rng) if rng.random() < made_up else rng.choice(WORDS)
                 for _ in range(rng.randint(1, max_words))]
        if rng.random() < 0.1:
            words.append(str(rng.randint(1, 9)))
        action = _cased(words, case, rng)
        if action.lower() not in {a.lower() for a in actions}:
            actions.append(action)
    return actions


def _word(rng: random.Random) -> str:
    return made_up_word(rng) if rng.random() < 0.3 else rng.choice(WORDS)


def observation(style: str, rng: random.Random, symbols: str) -> str:
    """One observation in ``style``; ``symbols`` are the grid's symbols (its legend names them)."""
    if style == "grid":
        h, w = rng.randint(2, 6), rng.randint(2, 6)
        return "\n".join("".join(rng.choice(symbols) for _ in range(w)) for _ in range(h))
    if style == "sentences":
        templates = ("You see a {a} {n}.", "The {n} is {k} steps to the {d}.", "Nothing happens.",
                     "A {n} lies on the {m}.", "You hold a {n}.", "The {n} is {a}.")
        return " ".join(rng.choice(templates).format(a=_word(rng), n=_word(rng), m=_word(rng), k=rng.randint(1, 9),
                                                     d=rng.choice(("north", "south", "east", "west")))
                        for _ in range(rng.randint(1, 3)))
    if style == "numbers":
        return " ".join(f"{_word(rng).capitalize()}: {rng.randint(0, 99)}." for _ in range(rng.randint(1, 4)))
    if style == "fields":
        return "\n".join(f"{_word(rng).capitalize()}: {_word(rng)}" for _ in range(rng.randint(2, 5)))
    return f"{_word(rng).capitalize()}: " + ", ".join(_word(rng) for _ in range(rng.randint(2, 5)))


@dataclass
class SyntheticConfig:
    """Options of one synthetic tag."""

    world: int = 0
    """Mixed into every reset seed, so tags differ at the same seed."""


class SyntheticEnv(BaseEnv):
    """A made-up environment drawn anew at each reset; any listed action is valid, none is better."""

    config_cls = SyntheticConfig

    def reset(self, seed=None, **kwargs):
        self.rng = random.Random(f"{self.config.world}/{seed}")
        self.actions = action_set(self.rng)
        self.style = self.rng.choice(STYLES)
        self.symbols = "".join(self.rng.sample(GRID_SYMBOLS, self.rng.randint(3, 6)))
        self.names = [_word(self.rng) for _ in self.symbols]
        self.text = observation(self.style, self.rng, self.symbols)
        return self.render()

    def step(self, action):
        valid = isinstance(action, str) and action.strip() in self.actions
        if valid:
            self.text = observation(self.style, self.rng, self.symbols)
        reward = float(self.rng.choice((0.0, 0.0, 0.0, 1.0, -1.0))) if valid else 0.0
        return self.render(), reward, False, make_info(False, valid, valid)

    def render(self):
        return self.text

    def legend(self):
        if getattr(self, "style", None) != "grid":  # before the first reset too
            return ""
        return "Legend: " + ", ".join(f"{s} {n}" for s, n in zip(self.symbols, self.names))

    def action_description(self):
        return " | ".join(self.actions)


def synthetic_tags(n_tags: int, seed: int = 0, first_world: int = 0) -> dict:
    """``n_tags`` tags of :class:`SyntheticEnv`, each with its own instruction sentence and world
    (``first_world`` onwards: the build's probe uses worlds the corpus has not)."""
    from envs.registry import parse_env_tags

    rng = random.Random(f"synthetic-tags/{seed}")
    return parse_env_tags({
        f"Synthetic{i}": {"env_type": ENV_TYPE, "max_actions_per_traj": 10,
                          "env_instruction": rng.choice(INSTRUCTIONS).format(w=_word(rng), v=_word(rng)),
                          "env_config": {"world": i}}
        for i in range(first_world, first_world + n_tags)
    })
