"""An environment served over HTTP by an OpenEnv server (the ``openenv-core`` package's protocol).

The tag names the server (``env_config.base_url``); each episode is a session of its own on it: ``reset`` opens
a WebSocket session (``/ws``, the protocol's stateful transport: the stateless ``/reset`` and ``/step`` routes
build a fresh environment for every call) and sends ``reset`` with the seed, ``step`` sends the action and
reads the observation, reward and done. The client is ``openenv-core``'s own (``GenericEnvClient`` and its
synchronous wrapper); an ``Authorization: Bearer`` key is sent when ``api_key_env`` names an environment
variable that holds it (the key itself is never in the config, a log or a checkpoint).

The observation maps onto the env contract: the text the model reads is the observation's ``observation_field``
(the whole observation as JSON when it has none), ``success`` and ``action_is_valid`` are its ``success_field``
and ``valid_field`` (a server without them: success when the episode ends with a reward of at least
``success_reward``, every action the server took is valid), numbers under ``info_field`` join the step's info. The
action is the model's text under ``action_field`` (``action_format: text``), or the model's text read as a JSON
object of the action's fields (``action_format: json``: text that is no JSON object is an invalid action, the
server is not called). An action the server's schema refuses is an invalid action; the session goes on.

A server of this project (``python -m agent_trainer.serve_env``) sends exactly these fields, and its env's legend
and action list at each reset. Faults: a server that cannot be reached, drops the connection or does not answer
within ``step_timeout_s`` raises :class:`~envs.base.ServiceError` (the rollout counts the episode and leaves it out
of training); a reset retries ``retries`` times on a fresh session first (the server restarted, a connection
lost between episodes). An exception inside the served env is the env's own error, as in-process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from envs.base import BaseEnv, ServiceError, make_info

INSTALL = "pip install 'agent-trainer[openenv]' (the openenv-core package)"
MAX_INFO_KEYS = 32
"""The numbers of an observation's ``info_field`` kept as info (each becomes a metric): the server is untrusted."""
MAX_INFO_KEY_CHARS = 64


@dataclass
class OpenEnvConfig:
    """Where the OpenEnv server is and how its observations and actions map onto the env contract."""

    base_url: str = ""
    """The server's address, ``http://host:port`` (``ws://`` works too); required."""
    api_key_env: str | None = None
    """The name of an environment variable holding the key the server checks, sent as ``Authorization: Bearer``
    (None: no key). The variable must be set where the env actors run (a local run: where you start it)."""
    connect_timeout_s: float = 10.0
    """How long opening a session may take."""
    step_timeout_s: float = 30.0
    """How long a reset or step may take before the episode ends as a service failure; keep it below
    ``es_manager.env_step_timeout_s`` so that only the episode ends, not its env actor's calls."""
    retries: int = 2
    """Further tries of a reset that could not reach the server, each on a fresh session."""
    retry_backoff_s: float = 1.0
    """Seconds before the first retry, doubled before each next one."""
    action_format: str = "text"
    """``text``: the action is the model's text under ``action_field``; ``json``: the model's text is a JSON object
    of the action's fields."""
    action_field: str = "text"
    """The action field that holds the model's text (``action_format: text``)."""
    observation_field: str | None = "text"
    """The observation field the model reads; None, or a field the observation lacks: the whole observation as
    JSON."""
    success_field: str = "success"
    """The observation field that says the task is solved."""
    success_reward: float | None = None
    """When the observation has no ``success_field``: success is an episode that ends with a step reward of at
    least this (None: never)."""
    valid_field: str = "action_is_valid"
    """The observation field that says the action parsed (absent: every action the server took is valid)."""
    info_field: str = "info"
    """The observation field whose numbers join the step's info (``env/<tag>/<key>`` metrics)."""
    action_description: str = ""
    """The valid actions as the model is told them (``Left | Down | Right | Up``); empty: what the server sends at
    reset in ``action_description``."""
    legend: str = ""
    """Text explaining the observation's symbols; empty: what the server sends at reset in ``legend``."""

    def __post_init__(self):
        url = urlparse(str(self.base_url))
        if url.scheme not in ("http", "https", "ws", "wss") or not url.hostname:
            raise ValueError(f"base_url must be the server's address, http://host:port, got {self.base_url!r}")
        if self.action_format not in ("text", "json"):
            raise ValueError(f"action_format must be 'text' or 'json', got {self.action_format!r}")
        for name in ("connect_timeout_s", "step_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        if not float(self.retry_backoff_s) >= 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s!r}")
        if self.api_key_env is not None and not str(self.api_key_env).strip():
            raise ValueError("api_key_env must name an environment variable, or be null for no key")


class ActionRefused(Exception):
    """The server's schema refused the action (its session goes on)."""


class ServedEnvError(RuntimeError):
    """The served env raised (the server's ``EXECUTION_ERROR``): the env's own error, as in-process."""


def _lost_connection_errors() -> tuple[type[BaseException], ...]:
    """What a call raises when the session is gone: no answer in time, the socket closed or refused."""
    from websockets.exceptions import WebSocketException

    return TimeoutError, OSError, EOFError, WebSocketException


def api_key(config: OpenEnvConfig) -> str | None:
    """The key from the environment variable ``api_key_env`` names (None without one); a variable that is not set
    raises ServiceError naming it (never the key)."""
    if config.api_key_env is None:
        return None
    key = os.environ.get(config.api_key_env, "")
    if not key:
        raise ServiceError(f"env_config.api_key_env names {config.api_key_env}, which is not set in this process; "
                           "set it to the server's key where the run starts")
    return key


def auth_headers(config: OpenEnvConfig) -> dict[str, str]:
    """The headers every request sends: the key, when ``api_key_env`` names one."""
    key = api_key(config)
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_url(base_url: str) -> str:
    """``base_url`` as http(s):// (the health check's address)."""
    url = base_url.rstrip("/")
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(ws):
            return http + url[len(ws):]
    return url


def probe(config: OpenEnvConfig) -> None:
    """Ask the server's ``/health`` once (with the key); raises ServiceError saying what answered, or nothing."""
    import httpx

    url = http_url(config.base_url) + "/health"
    try:
        response = httpx.get(url, headers=auth_headers(config), timeout=config.connect_timeout_s)
    except httpx.HTTPError as err:
        raise ServiceError(f"no OpenEnv server answers at {url} ({type(err).__name__}: {err})") from None
    if response.status_code in (401, 403):
        raise ServiceError(f"the OpenEnv server at {url} refused the key (HTTP {response.status_code}); set "
                           "env_config.api_key_env to the variable holding the key the server was started with")
    if response.status_code != 200:
        raise ServiceError(f"the OpenEnv server at {url} answered HTTP {response.status_code} to its health check")


def _client_class():
    """``GenericEnvClient`` with the key header on its WebSocket, and a schema refusal told apart from a fault."""
    try:
        from openenv.core.generic_client import GenericEnvClient
        from websockets.asyncio.client import connect as ws_connect
    except ImportError as err:
        raise ImportError(f"env_type openenv needs the openenv-core package ({err}); {INSTALL}") from err
    client_log = logging.getLogger("websockets.client")  # at DEBUG it logs the handshake's headers: the key
    client_log.setLevel(max(client_log.level, logging.INFO))

    class KeyedClient(GenericEnvClient):
        """openenv-core's dict client; connects with ``headers`` and a short close handshake."""

        headers: dict[str, str] = {}

        async def connect(self):
            if self._ws is None:
                loopback = urlparse(self._ws_url).hostname in ("127.0.0.1", "localhost", "::1")
                try:
                    self._ws = await ws_connect(self._ws_url, open_timeout=self._connect_timeout,
                                                max_size=self._max_message_size, additional_headers=self.headers,
                                                close_timeout=1.0, **({"proxy": None} if loopback else {}))
                except Exception as err:  # refused, timed out, HTTP 401/403 instead of the upgrade
                    raise ConnectionError(f"cannot open a session at {self._ws_url}: {type(err).__name__}: "
                                          f"{err}") from None
            return self

        async def _send_and_receive(self, message: dict) -> dict:
            await self._send(message)
            response = await self._receive()
            if response.get("type") == "error":
                data = response.get("data") or {}
                code, text = data.get("code", "UNKNOWN"), data.get("message", "unknown error")
                if code == "VALIDATION_ERROR":
                    raise ActionRefused(f"{text}: {data.get('errors', '')}")
                if code == "EXECUTION_ERROR":
                    raise ServedEnvError(f"the served environment raised: {text}")
                raise ServiceError(f"the OpenEnv server answered {code}: {text}")
            return response

    return KeyedClient


class OpenEnvEnv(BaseEnv):
    """An episode is a session on an OpenEnv server (module docstring)."""

    config_cls = OpenEnvConfig

    def __init__(self, config: OpenEnvConfig | None = None):
        super().__init__(config)
        self._client = None
        self._observation = ""
        self._served_legend = ""
        self._served_actions = ""
        self._done = True

    # ---------------------------------------------------------------- the session
    def _open(self):
        """A new session (the old one closed first): openenv-core's client, synchronous."""
        self._close_session()
        cls = _client_class()
        client = cls(base_url=self.config.base_url, connect_timeout_s=float(self.config.connect_timeout_s),
                     message_timeout_s=float(self.config.step_timeout_s))
        client.headers = auth_headers(self.config)
        self._client = client.sync()
        self._client.connect()
        return self._client

    def _close_session(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - the session is gone either way
                pass

    def _call(self, what: str, fn):
        """``fn()``; a lost connection or a missed deadline closes the session and raises ServiceError."""
        try:
            return fn()
        except (ActionRefused, ServedEnvError):
            raise
        except ServiceError:
            self._close_session()
            raise
        except _lost_connection_errors() as err:
            self._close_session()
            raise ServiceError(f"{what} at {self.config.base_url} failed: {type(err).__name__}: {err}") from None

    # ---------------------------------------------------------------- the env contract
    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """A fresh session, reset with ``seed``; retried ``retries`` times when the server cannot be reached."""
        data = {} if seed is None else {"seed": int(seed)}
        delay, attempts = float(self.config.retry_backoff_s), int(self.config.retries) + 1
        for attempt in range(attempts):
            try:
                result = self._call("reset", lambda: self._open().reset(**data))
                break
            except ServiceError:
                self._close_session()
                if attempt == attempts - 1:
                    raise
                time.sleep(delay)
                delay *= 2
        obs = result.observation if isinstance(result.observation, dict) else {}
        self._served_legend = str(obs.get("legend") or "")
        self._served_actions = str(obs.get("action_description") or "")
        self._observation = self._text(obs)
        self._done = bool(result.done)
        return self._observation

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Send the action; an action that is no JSON object (``action_format: json``) or that the server's schema
        refuses is invalid: the observation stays, reward 0."""
        if self._client is None or self._done:
            return self._observation, 0.0, True, make_info(False, False, False)
        payload = self._payload(action)
        if payload is None:
            return self._observation, 0.0, False, make_info(False, False, False)
        try:
            result = self._call("step", lambda: self._client.step(payload))
        except ActionRefused:
            return self._observation, 0.0, False, make_info(False, False, False)
        obs = result.observation if isinstance(result.observation, dict) else {}
        reward = _number(result.reward)
        done = bool(result.done)
        self._observation, self._done = self._text(obs), done
        if self.config.success_field in obs:
            success = bool(obs[self.config.success_field])
        else:
            success = done and self.config.success_reward is not None and reward >= float(self.config.success_reward)
        valid = bool(obs.get(self.config.valid_field, True))
        extra = obs.get(self.config.info_field)
        extra = {str(k)[:MAX_INFO_KEY_CHARS]: v for k, v in list(extra.items())[:MAX_INFO_KEYS]
                 if isinstance(v, (bool, int, float)) and math.isfinite(v)} if isinstance(extra, dict) else {}
        for key in ("success", "action_is_valid", "action_is_effective"):
            extra.pop(key, None)
        effective = bool(obs.get("action_is_effective", valid))
        return self._observation, reward, done, make_info(success, valid, effective, **extra)

    def _payload(self, action: str) -> dict | None:
        if self.config.action_format == "text":
            return {self.config.action_field: action if isinstance(action, str) else ""}
        try:
            fields = json.loads(action)
        except (TypeError, ValueError, RecursionError):
            return None
        return fields if isinstance(fields, dict) else None

    def _text(self, obs: dict) -> str:
        field = self.config.observation_field
        if field is not None and isinstance(obs.get(field), str):
            return obs[field]
        return json.dumps(obs, sort_keys=True, default=str)

    def render(self) -> str:
        """The last observation's text."""
        return self._observation

    def action_description(self) -> str:
        """The tag's ``action_description``, else the server's (sent at reset)."""
        return self.config.action_description or self._served_actions or "(the server's action fields, as JSON)"

    def legend(self) -> str:
        """The tag's ``legend``, else the server's (sent at reset)."""
        return self.config.legend or self._served_legend

    def close(self) -> None:
        """End the session (the server then drops its env)."""
        self._close_session()


def _number(value: Any) -> float:
    """The server's reward as a float (None, the protocol's "no reward": 0); anything but a number raises TypeError
    (the episode ends with that env error); the rollout screens a non-finite one."""
    if value is None:
        return 0.0
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"the server sent a reward of type {type(value).__name__}; the protocol's reward is a number")
