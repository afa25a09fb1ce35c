"""Run the app under uvicorn with a graceful shutdown that says why a request ended.

On SIGINT/SIGTERM uvicorn closes its sockets and then waits for open responses; a streaming
response would either run to its end or be cut off without a word. ``GracefulServer`` drains
the engine first, while connections are still open: new requests get 503 ("shutting down"),
in-flight ones have ``drain_timeout`` seconds to finish, and the rest are aborted — each stream
ends with an error event naming the reason, each plain request with a 503 — before uvicorn's own
shutdown runs.

Clients are bounded as a reverse proxy in front would bound them (``ClientTimeoutProtocol``):

- a connection must send a complete request head within ``header_timeout`` seconds of connecting
  (or of its previous response) or it is closed — uvicorn itself only times out idle keep-alive
  connections, so a client trickling header bytes would hold a socket forever;
- a request body must arrive within ``body_timeout`` seconds of its head plus one second per
  ``body_min_rate`` bytes received (Apache's ``mod_reqtimeout`` ``body=S,MinRate=R``; nginx's
  ``client_body_timeout``): a slower client gets a 408 in OpenAI's error shape and its connection
  is closed, so a body trickled a byte at a time holds a connection for ``body_timeout`` seconds,
  not for as long as the client likes;
- uvicorn's ``limit_concurrency`` is off: it counted open connections and answered in plain
  text, so 1,100 simultaneous requests against a limit of 1,024 were all refused. The app caps
  the requests in flight instead (``guards.ConcurrencyLimit``, ``--limit-concurrency``) and
  answers the excess of a burst with OpenAI-shaped 503s;
- every accepted connection has ``TCP_NODELAY``: uvicorn writes a response's head and body
  separately, and with Nagle's algorithm the body waited for the client's delayed ACK (40 ms on
  Linux) on every kept-alive connection. asyncio sets it only on sockets made with
  ``proto=IPPROTO_TCP``, which a socket passed in (``cli.listen.bind_socket``) was not.

When the engine thread dies (``AsyncEngine.on_fatal``), the server stops and ``exit_code`` is 1,
so ``tailserve serve`` exits non-zero and a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from tailserve.server.async_engine import AsyncEngine
from tailserve.server.protocol import error_body

logger = logging.getLogger("tailserve.server")
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_BODY_MIN_RATE = 16 * 1024  # bytes/s: 128 kbit/s; a 4 MiB body (the limit) may take 266 s
BODY_TIMEOUT_JITTER = 0.1  # a body's timeout is drawn in [1, 1.1] x body_timeout


def set_nodelay(sock: Any) -> None:
    """``TCP_NODELAY`` on a TCP socket (a ``socket.socket`` or asyncio's ``TransportSocket``)."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ClientTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with ``TCP_NODELAY``, a header timeout and a body timeout with a
    byte-rate floor (``config.header_timeout``, ``config.body_timeout``, ``config.body_min_rate``:
    ``server_config`` sets them)."""

    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _body_cycle: object = None  # the request whose body is being timed
    _body_started = 0.0  # loop time its head was complete
    _body_bytes = 0  # bytes received since (framing included)
    _body_grace = 0.0  # seconds it has before the rate floor counts: body_timeout, jittered

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        set_nodelay(transport.get_extra_info("socket"))
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_body(len(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        self._arm()  # the next request's head is due in as long
        self._track_body(0)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        timeout = getattr(self.config, "header_timeout", None)
        if timeout and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(timeout, self._on_header_timeout, self.cycle)

    def _on_header_timeout(self, previous: object) -> None:
        # A new cycle means a request head arrived after the timer was armed; a state other than
        # IDLE, that a pipelined request's head was complete when the timer was armed.
        if self.cycle is previous and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def _track_body(self, received: int) -> None:
        """Start timing a body when a request's head is complete, count its bytes, stop at its end."""
        if self.conn.their_state is not h11.SEND_BODY or self.cycle is None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            return
        if self.cycle is self._body_cycle:
            self._body_bytes += received
            return
        timeout = getattr(self.config, "body_timeout", None)
        if not timeout or self.transport.is_closing():
            return
        self._body_cycle = self.cycle
        self._body_started = self.loop.time()
        self._body_bytes = 0
        # Up to 10% more for some: connections opened together are not all closed in one iteration.
        self._body_grace = timeout * (1.0 + BODY_TIMEOUT_JITTER * random.random())
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(self._body_grace, self._on_body_timeout)

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        now = self.loop.time()
        timeout = self.config.body_timeout
        rate = getattr(self.config, "body_min_rate", None)
        due = self._body_started + self._body_grace + (self._body_bytes / rate if rate else 0.0)
        if self.flow.read_paused:  # the server stopped reading (a full buffer), not the client
            due = max(due, now + timeout)
        if now < due:
            self._body_timer = self.loop.call_later(due - now, self._on_body_timeout)
            return
        self._refuse_slow_body(timeout, rate)

    def _refuse_slow_body(self, timeout: float, rate: float | None) -> None:
        """A 408 (when no response has started) and the connection closed; cheap, for a thousand
        slow connections opened together time out within a second of each other."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            self.transport.write(_slow_body_response(timeout, rate))  # h11 is done with: closing
        if cycle is not None:  # the app's receive() answers http.disconnect, its send() is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


@functools.lru_cache(maxsize=8)
def _slow_body_response(timeout: float, rate: float | None) -> bytes:
    floor = f" plus 1 s per {rate:g} bytes received" if rate else ""
    message = (
        f"the request body did not arrive in time: a body must arrive within {timeout:g} s of the "
        f"request's head{floor} (--body-timeout, --body-min-rate)"
    )
    body = json.dumps(error_body(message, 408)).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


HeaderTimeoutProtocol = ClientTimeoutProtocol  # its former name


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


def check_client_bounds(
    header_timeout: float, body_timeout: float, body_min_rate: float, limit_concurrency: int | None = None
) -> None:
    """A ValueError naming the flag of the first bad value."""
    if not header_timeout > 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {header_timeout}")
    if not body_timeout > 0:
        raise ValueError(f"--body-timeout must be > 0 seconds, got {body_timeout}")
    if not body_min_rate > 0:
        raise ValueError(f"--body-min-rate must be > 0 bytes per second, got {body_min_rate}")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {limit_concurrency}")


def server_config(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    body_min_rate: float = DEFAULT_BODY_MIN_RATE,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the client bounds above (``tailserve serve``, ``router``);
    the app has its own ``guards.ConcurrencyLimit``."""
    check_client_bounds(header_timeout, body_timeout, body_min_rate)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=ClientTimeoutProtocol,
        log_level=log_level,
        access_log=log_level == "debug",
        limit_concurrency=None,  # guards.ConcurrencyLimit instead: uvicorn's counts connections
        **options,
    )
    config.header_timeout = header_timeout  # read by ClientTimeoutProtocol
    config.body_timeout = body_timeout
    config.body_min_rate = body_min_rate
    return config


def make_server(
    app: FastAPI,
    engine: AsyncEngine,
    *,
    host: str,
    port: int,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    body_min_rate: float = DEFAULT_BODY_MIN_RATE,
) -> GracefulServer:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    if drain_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {drain_timeout}")
    config = server_config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        body_min_rate=body_min_rate,
        timeout_graceful_shutdown=5,  # after the drain only finished responses remain to flush
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
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        set_nodelay(self.socket)
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
