"""Serve an env tag of this project as an OpenEnv server, for the ``openenv`` env tag of a training run (of this
project or another) and for any OpenEnv client.

    AGENT_TRAINER_ENV_KEY=<a secret> python -m agent_trainer.serve_env --envs-file config/envs.yaml --tag FrozenLake
        [--host 127.0.0.1] [--port 8000] [--max-sessions 256] [--key-env AGENT_TRAINER_ENV_KEY]

The server is ``openenv-core``'s own (``HTTPEnvServer``: ``/ws`` sessions, ``/reset``, ``/step``, ``/state``,
``/schema``, ``/health``); each WebSocket session builds the tag's env (``envs.make_env``), as an env actor does.
The action is ``{"text": <the model's action text>}``; the observation is the env's text with ``success``,
``action_is_valid``, ``action_is_effective``, the rest of the step's info (numbers, under ``info``) and, at reset,
the env's ``legend`` and ``action_description``: what the ``openenv`` env tag reads by default (envs/openenv_env.py).

It listens on 127.0.0.1 unless ``--host`` says otherwise, and answers only requests that send the key
(``Authorization: Bearer <key>``, HTTP 401 / a refused WebSocket otherwise) from the environment variable
``--key-env`` names; the key is never printed or logged. It refuses to start, in one line, without it.
"""

from __future__ import annotations

import argparse
import functools
import hmac
import logging
import os
import sys
from typing import Any, Sequence

from envs import BaseEnv, make_env
from envs.registry import load_env_tags

logger = logging.getLogger("agent_trainer.serve_env")

DEFAULT_KEY_ENV = "AGENT_TRAINER_ENV_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def wire_types():
    """The action and observation classes of the served envs (pydantic, openenv-core's ``Action`` and
    ``Observation``)."""
    from openenv.core.env_server.types import Action, Observation
    from pydantic import Field

    class TextAction(Action):
        """The model's action text, as the env's ``step`` takes it."""

        text: str = Field(default="", description="the action text (any string; the env parses it)")

    class TextObservation(Observation):
        """What the env's ``reset`` / ``step`` gave, in the env contract's terms."""

        text: str = Field(default="", description="the observation the model reads")
        success: bool = False
        action_is_valid: bool = True
        action_is_effective: bool = False
        info: dict[str, float] = Field(default_factory=dict, description="the step info's other numbers")
        legend: str = Field(default="", description="at reset: the env's legend")
        action_description: str = Field(default="", description="at reset: the valid actions")

    return TextAction, TextObservation


def served_env_class():
    """The OpenEnv ``Environment`` that plays one tag's env per session."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import State

    action_cls, observation_cls = wire_types()

    class ServedEnv(Environment):
        """One session's env: the tag's env built by ``envs.make_env``."""

        SUPPORTS_CONCURRENT_SESSIONS = True  # each session builds its own env

        def __init__(self, tag: str, tags: dict):
            super().__init__()
            self.env: BaseEnv = make_env(tag, tags)
            self._state = State(step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
            text = self.env.reset(seed=seed)
            self._state = State(episode_id=episode_id, step_count=0)
            return observation_cls(text=text, legend=str(self.env.legend()),
                                   action_description=str(self.env.action_description()))

        def step(self, action, timeout_s: float | None = None, **kwargs: Any):
            text, reward, done, info = self.env.step(action.text)
            self._state.step_count += 1
            info = dict(info)
            extra = {str(k): float(v) for k, v in info.items() if isinstance(v, (bool, int, float))
                     and k not in ("success", "action_is_valid", "action_is_effective")}
            return observation_cls(text=text, reward=float(reward), done=bool(done),
                                   success=bool(info.get("success", False)),
                                   action_is_valid=bool(info.get("action_is_valid", False)),
                                   action_is_effective=bool(info.get("action_is_effective", False)), info=extra)

        @property
        def state(self):
            return self._state

        def close(self) -> None:
            self.env.close()

    return ServedEnv, action_cls, observation_cls


class KeyCheck:
    """ASGI middleware: every HTTP request and WebSocket handshake must send ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str):
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(sent, self._expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # closing before accepting answers the handshake with HTTP 403
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"detail":"missing or wrong key: send Authorization: Bearer <key>"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def build_app(tag: str, tags: dict, key: str, max_sessions: int = 256):
    """The FastAPI app serving ``tag`` (openenv-core's ``create_fastapi_app``) behind the key check."""
    from openenv.core.env_server.http_server import create_fastapi_app

    served, action_cls, observation_cls = served_env_class()
    make_env(tag, tags).close()  # a tag that cannot be built is refused now, not at the first session
    app = create_fastapi_app(functools.partial(served, tag, tags), action_cls, observation_cls,
                             max_concurrent_envs=int(max_sessions))
    return KeyCheck(app, key)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agent_trainer.serve_env",
        description="Serve an env tag as an OpenEnv server (WebSocket sessions, one env each); only requests "
                    "with the key get an answer.",
        epilog="example: AGENT_TRAINER_ENV_KEY=... python -m agent_trainer.serve_env --envs-file config/envs.yaml "
               "--tag FrozenLake --port 8000 (docs/environments.md, \"Services\")")
    p.add_argument("--envs-file", required=True, metavar="F", help="a YAML file of env tags, like config/envs.yaml")
    p.add_argument("--tag", required=True, metavar="T", help="the tag to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-sessions", type=int, default=256, metavar="N",
                   help="sessions (episodes) open at once, each with its env (default 256)")
    p.add_argument("--key-env", default=DEFAULT_KEY_ENV, metavar="NAME",
                   help=f"the environment variable holding the key clients must send (default {DEFAULT_KEY_ENV})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key = os.environ.get(args.key_env, "")
    try:
        if not key:
            raise ValueError(f"--key-env names {args.key_env}, which is not set; set it to the key the clients send "
                             "(their env_config.api_key_env names the variable holding it)")
        if args.max_sessions < 1:
            raise ValueError(f"--max-sessions must be >= 1, got {args.max_sessions}")
        tags = load_env_tags(args.envs_file)
        if args.tag not in tags:
            raise ValueError(f"--tag {args.tag!r} is not a tag of {args.envs_file}; its tags: {sorted(tags)}")
        app = build_app(args.tag, tags, key, args.max_sessions)
    except (ValueError, ImportError, OSError) as err:
        print(f"serve_env: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    import uvicorn

    if args.host not in LOOPBACK:
        logger.warning("listening on %s: reachable from other machines; every request still needs the key", args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False)
    server = uvicorn.Server(config)
    logger.info("serving env tag %s of %s as an OpenEnv server on http://%s:%d (key from %s)", args.tag,
                args.envs_file, args.host, args.port, args.key_env)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
