"""A server in a background thread on a free local port: `horizon agent --model` talks to one over
HTTP exactly as it would to a remote endpoint, and the tests drive one with the real SDKs."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """`with BackgroundServer(app) as srv: srv.url ...` (uvicorn in a daemon thread; stopped on exit)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning",
                 header_timeout_s: float = 10):
        from horizon.server.process import protocol_with_timeout

        self.app, self.host = app, host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level=log_level,
                                                    http=protocol_with_timeout(header_timeout_s)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
