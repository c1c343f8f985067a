"""`horizon serve`'s process: uvicorn with a drain on SIGTERM and a deadline on reading request headers.

- **Drain** (`DrainingServer`): on SIGTERM or Ctrl-C the server stops accepting connections and the engine
  takes no new requests (503 with Retry-After); running requests go on for up to `drain_timeout_s`; then each
  one still running ends with an API-level ending (an error event, then `[DONE]` or the end of the
  Anthropic / Responses stream), and the process exits 0. A second Ctrl-C forces the exit.
- **Header deadline** (`TimedH11Protocol`): uvicorn times only idle keep-alive connections, so a client that
  connects and sends its headers a byte at a time (slowloris) holds a connection forever. A connection
  whose request headers are not complete `header_timeout_s` after it opened, or after its previous response
  ended, is closed. Body reads have their own deadline (`horizon.server.app.BodyGuard`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import h11
import uvicorn
from uvicorn.config import LOG_LEVELS
from uvicorn.logging import DefaultFormatter
from uvicorn.protocols.http.h11_impl import H11Protocol

from horizon.serving import ModelService

log = logging.getLogger("horizon.server")


class TimedH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # set per server by `protocol_with_timeout`

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        # h11 leaves their_state IDLE until a request's headers are complete
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_with_timeout(header_timeout_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: ModelService, drain_timeout_s: float):
        super().__init__(config)
        self.service, self.drain_timeout_s = service, drain_timeout_s
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if not self.draining:
            self.draining = True
            log.warning("horizon serve: draining (up to %.0f s for running requests)", self.drain_timeout_s)
            # a thread, not here: a signal handler may interrupt the event loop while it holds the engine's lock
            threading.Thread(target=self.service.drain, args=(self.drain_timeout_s,), daemon=True).start()
        super().handle_exit(sig, frame)


def log_like_uvicorn(level: str) -> None:
    """Print Horizon's own log records (`horizon.*`: the engine's compile progress, failed requests) at the
    server's --log-level and in uvicorn's format; without a handler only warnings reached stderr, unformatted."""
    logger = logging.getLogger("horizon")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(LOG_LEVELS.get(level.lower(), logging.INFO))


def serve(app, service: ModelService, host: str, port: int, log_level: str = "info", drain_timeout_s: float = 30,
          header_timeout_s: float = 10) -> None:
    """Run until SIGTERM / Ctrl-C, drain (module docstring), return."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=protocol_with_timeout(header_timeout_s),
                            # uvicorn's own deadline only backs ours up: every stream has ended by then
                            timeout_graceful_shutdown=drain_timeout_s + 10)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler makes that a clean exit (0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    DrainingServer(config, service, drain_timeout_s).run()
