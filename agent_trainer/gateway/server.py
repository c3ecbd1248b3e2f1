"""Run a gateway app with uvicorn in a background thread, on 127.0.0.1 by default."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import uvicorn

DEFAULT_HOST = "127.0.0.1"


def new_api_key() -> str:
    """A fresh per-run key (URL-safe, 256 bits)."""
    return secrets.token_urlsafe(32)


def session_url(host: str, port: int, session_id: str) -> str:
    """The ``openai`` client's ``base_url`` of one session of the gateway on ``host:port``."""
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/sessions/{session_id}/v1"


class GatewayServer:
    """uvicorn serving ``app`` in a daemon thread; ``port=0`` takes a free port (read it from ``.port``)."""

    def __init__(self, app, host: str = DEFAULT_HOST, port: int = 0, start_timeout_s: float = 30.0):
        self.host = host
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name=f"gateway-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._socket.close()
                raise RuntimeError(f"the gateway did not start on {host}:{self.port} within {start_timeout_s:g} s")
            time.sleep(0.01)

    def base_url(self, session_id: str) -> str:
        """The ``openai`` client's ``base_url`` of one session."""
        return session_url(self.host, self.port, session_id)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> GatewayServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
