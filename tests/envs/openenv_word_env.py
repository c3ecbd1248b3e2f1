"""An OpenEnv server written with ``openenv-core`` alone, as a third party would (its own Action and Observation
types, ``create_fastapi_app``; nothing of this project): say the secret word. The tests train and play on it
through the ``openenv`` env tag (tests/envs/test_openenv_env.py, tests/e2e/test_openenv_e2e.py).

    python tests/envs/openenv_word_env.py --port 8000

The action is ``{"word": str}``; the observation has ``prompt`` and ``heard`` (no ``success``, no key): reward 1 and
done when the word is the seed's secret (``left`` for even seeds, ``down`` for odd ones, any case), else 0; the
episode ends after ``TURNS`` words.
"""

from __future__ import annotations

import argparse

import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TURNS = 3


class WordAction(Action):
    word: str = Field(min_length=1, max_length=40)


class WordObservation(Observation):
    prompt: str = ""
    heard: str = ""


class WordEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.secret = "left"

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.secret = "left" if (seed or 0) % 2 == 0 else "down"
        self._state = State(episode_id=episode_id, step_count=0)
        return WordObservation(prompt=f"Say the secret word ({len(self.secret)} letters, a direction).")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        right = action.word.strip().lower() == self.secret
        return WordObservation(prompt="Right!" if right else "Not that one. Say another direction.",
                               heard=action.word, reward=1.0 if right else 0.0,
                               done=right or self._state.step_count >= TURNS)

    @property
    def state(self):
        return self._state


app = create_fastapi_app(WordEnv, WordAction, WordObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="info")
