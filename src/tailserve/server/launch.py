"""Run the app under uvicorn with a graceful shutdown that says why a request ended.

On SIGINT/SIGTERM uvicorn closes its sockets and then waits for open responses; a streaming
response would either run to its end or be cut off without a word. ``GracefulServer`` drains
the engine first, while connections are still open: new requests get 503 ("shutting down"),
in-flight ones have ``drain_timeout`` seconds to finish, and the rest are aborted — each stream
ends with an error event naming the reason, each plain request with a 503 — before uvicorn's own
shutdown runs.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from tailserve.server.async_engine import AsyncEngine


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout  # seconds

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
) -> GracefulServer:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    if drain_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {drain_timeout}")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,  # after the drain only finished responses remain to flush
        access_log=log_level == "debug",
    )
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
