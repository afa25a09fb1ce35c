"""Run the app under uvicorn with a graceful shutdown that says why a request ended.

On SIGINT/SIGTERM uvicorn closes its sockets and then waits for open responses; a streaming
response would either run to its end or be cut off without a word. ``GracefulServer`` drains
the engine first, while connections are still open: new requests get 503 ("shutting down"),
in-flight ones have ``drain_timeout`` seconds to finish, and the rest are aborted — each stream
ends with an error event naming the reason, each plain request with a 503 — before uvicorn's own
shutdown runs.

Slow clients are bounded too: a connection must send a complete request head within
``header_timeout`` seconds of connecting (or of its previous response) or it is closed — uvicorn
itself only times out idle keep-alive connections, so a client trickling header bytes would hold
a socket forever — and ``limit_concurrency`` caps open connections plus tasks (uvicorn answers
503 beyond it).

When the engine thread dies (``AsyncEngine.on_fatal``), the server stops and ``exit_code`` is 1,
so ``tailserve serve`` exits non-zero and a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from tailserve.server.async_engine import AsyncEngine

logger = logging.getLogger("tailserve.server")
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_LIMIT_CONCURRENCY = 1024


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    ``config.header_timeout`` seconds (``make_server`` sets that attribute)."""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head is due in as long

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        timeout = getattr(self.config, "header_timeout", None)
        if timeout and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(timeout, self._on_header_timeout, self.cycle)

    def _on_header_timeout(self, previous: object) -> None:
        # A new cycle means a request head arrived after the timer was armed.
        if self.cycle is previous and not self.transport.is_closing():
            self.transport.close()


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout  # seconds
        self.exit_code = 0
        engine.on_fatal = self._on_engine_fatal

    def _on_engine_fatal(self, error: BaseException) -> None:
        logger.critical("stopping the server: the engine died (exit status 1)")
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.engine.drain(self.drain_timeout)
        await super().shutdown(sockets)


def make_server(
    app: FastAPI,
    engine: AsyncEngine,
    *,
    host: str,
    port: int,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
) -> GracefulServer:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    if drain_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {drain_timeout}")
    if not header_timeout > 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {header_timeout}")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {limit_concurrency}")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=HeaderTimeoutProtocol,
        log_level=log_level,
        timeout_graceful_shutdown=5,  # after the drain only finished responses remain to flush
        access_log=log_level == "debug",
        limit_concurrency=limit_concurrency,
    )
    config.header_timeout = header_timeout  # read by HeaderTimeoutProtocol
    return GracefulServer(config, engine, drain_timeout)


class ServerThread:
    """A ``GracefulServer`` on its own thread and event loop, for tests, notebooks and benchmarks:

        with ServerThread(make_server(app, engine, host="127.0.0.1", port=0)) as running:
            httpx.get(f"{running.base_url}/health")

    ``port=0`` picks a free port; ``base_url`` has the real one. Leaving the block drains the
    engine (``drain_timeout``) and stops the server.
    """

    def __init__(self, server: GracefulServer, start_timeout: float = 60.0) -> None:
        self.server = server
        self.start_timeout = start_timeout  # seconds
        config = server.config
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind((config.host, config.port))
        self.base_url = f"http://{config.host}:{self.socket.getsockname()[1]}"
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self.socket]}, name="tailserve-http", daemon=True
        )

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.base_url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.socket.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()
