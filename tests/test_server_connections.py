"""Connections under hostile and bursty clients (issue 30, items 2-4), on 127.0.0.1 only:
``TCP_NODELAY`` on every socket the server listens or serves on, a body timeout with a byte-rate
floor, and admission that sheds only the excess of a burst, with OpenAI-shaped errors, while
``/health`` and ``/metrics`` stay answered."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import MICRO, assert_openai_error, running_server, wait_until
from tailserve.executors.pytorch.init_model import init_model

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


def _port(running: Any) -> int:
    return int(running.base_url.rsplit(":", 1)[1])


def _request(method: str, path: str, body: bytes | None = None, length: int | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\n"
    if body is not None or length is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body or b'') if length is None else length}\r\n"
    return head.encode() + b"\r\n" + (body or b"")


def _completion(max_tokens: int = 1, **extra: Any) -> bytes:
    return json.dumps(
        {"prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True, **extra}
    ).encode()


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response read from ``sock`` (which must have a timeout)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    body = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def _openai_error(status: int, body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, body
    return error


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# ---- TCP_NODELAY (item 3) -------------------------------------------------------------------------
def test_bind_socket_makes_a_tcp_socket_whose_connections_have_nodelay() -> None:
    from tailserve.cli.listen import bind_socket

    with bind_socket(HOST, 0) as listener:
        # asyncio sets TCP_NODELAY only on connections accepted from a socket of proto IPPROTO_TCP.
        assert listener.proto == socket.IPPROTO_TCP
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        # already listening: a client connecting while the app starts waits instead of being refused
        with socket.create_connection(listener.getsockname()[:2], timeout=5):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_kept_alive_connections_are_not_delayed(micro_model: Path) -> None:
    with running_server(micro_model, "sim") as running:
        conn = http.client.HTTPConnection(HOST, _port(running), timeout=30)
        times = []
        for _ in range(16):
            started = time.perf_counter()
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            assert response.status == 200 and response.read()
            times.append(time.perf_counter() - started)
        served = list(running.server.server_state.connections)
        assert served and all(
            p.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for p in served
        )
        conn.close()
    # Without TCP_NODELAY the body waited for the client's delayed ACK: 40 ms at least, each time.
    assert statistics.median(times[1:]) < 0.030, [round(t * 1000, 1) for t in times]


def test_the_start_up_heap_is_frozen_once_the_engine_is_up(micro_model: Path) -> None:
    """Full GC passes over the start-up heap stalled /health for 58-197 ms under 1,023 slow
    clients: the server freezes that heap (gc.freeze) when its lifespan starts."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with running_server(micro_model, "sim") as running:
        conn = http.client.HTTPConnection(HOST, _port(running), timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        assert gc.get_freeze_count() > 1000
    gc.unfreeze()


# ---- admission (item 4) ---------------------------------------------------------------------------
def test_a_burst_of_twice_the_limit_serves_the_limit_and_sheds_the_rest(micro_model: Path) -> None:
    limit = 4
    with running_server(micro_model, "sim", app_options={"limit_concurrency": limit}) as running:
        socks = [socket.create_connection((HOST, _port(running)), timeout=60) for _ in range(2 * limit)]
        try:
            wait_until(lambda: len(running.server.server_state.connections) == 2 * limit)
            for sock in socks:  # every connection open first, then every request at once
                sock.sendall(_request("POST", "/v1/completions", _completion(20)))
            answers = [_response(sock) for sock in socks]
        finally:
            for sock in socks:
                sock.close()
    served = [a for a in answers if a[0] == 200]
    shed = [a for a in answers if a[0] != 200]
    assert len(served) >= limit, [a[:1] + a[2:] for a in answers]
    for status, headers, body in shed:
        assert status == 503 and headers["retry-after"] == "1" and headers["x-request-id"]
        assert "--limit-concurrency" in _openai_error(503, body)["message"]


def test_slow_bodies_holding_every_slot_lock_out_no_one(micro_model: Path) -> None:
    limit = 4
    head = _request("POST", "/v1/completions", length=1000) + b"{"
    with running_server(micro_model, "sim", app_options={"limit_concurrency": limit}) as running:
        slow = [socket.create_connection((HOST, _port(running)), timeout=30) for _ in range(limit)]
        try:
            for sock in slow:
                sock.sendall(head)  # and nothing more: each holds a request in flight
            wait_until(lambda: len(running.server.server_state.tasks) == limit)
            with httpx.Client(base_url=running.base_url, timeout=10) as client:
                assert client.get("/health").status_code == 200
                assert client.get("/metrics").status_code == 200
                assert client.get("/version").status_code == 200
                full = client.post("/v1/completions", json=json.loads(_completion()))
                assert_openai_error(full, 503)
                assert full.headers["retry-after"] == "1" and full.headers["x-request-id"]
        finally:
            for sock in slow:
                sock.close()
        # The slots come back with the connections.
        url = f"{running.base_url}/v1/completions"
        json_type = {"content-type": "application/json"}
        wait_until(lambda: httpx.post(url, content=_completion(), headers=json_type).status_code == 200)


def test_concurrency_limit_counts_requests_not_monitoring() -> None:
    from tailserve.server.guards import ConcurrencyLimit

    release = asyncio.Event()

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["path"] == "/v1/completions":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict:
        return {"type": "http", "method": method, "path": path, "headers": headers or []}

    async def call(limited: ConcurrencyLimit, s: dict) -> tuple[int, dict, bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await limited(s, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    async def main() -> None:
        limited = ConcurrencyLimit(app, limit=1)
        first = asyncio.create_task(call(limited, scope("POST", "/v1/completions")))
        await asyncio.sleep(0)
        assert limited.in_flight == 1
        status, headers, body = await call(limited, scope("POST", "/v1/completions"))
        assert status == 503 and headers[b"retry-after"] == b"1"
        assert "limit of 1 concurrent requests" in _openai_error(503, body)["message"]
        for path in ("/health", "/metrics", "/version"):
            assert (await call(limited, scope("GET", path)))[0] == 200
        # Only a GET without a body is monitoring: anything else counts.
        assert (await call(limited, scope("POST", "/health")))[0] == 503
        assert (await call(limited, scope("GET", "/health", [(b"content-length", b"9")])))[0] == 503
        assert (await call(limited, scope("GET", "/health", [(b"content-length", b"0")])))[0] == 200
        release.set()
        assert (await first)[0] == 200
        assert limited.in_flight == 0 and limited.shed == 3
        assert (await call(limited, scope("POST", "/v1/completions")))[0] == 200

    asyncio.run(main())
    with pytest.raises(ValueError, match="--limit-concurrency must be >= 1"):
        ConcurrencyLimit(app, limit=0)


# ---- body timeout and byte-rate floor (item 2) ----------------------------------------------------
@pytest.fixture(scope="module")
def body_server(micro_model: Path) -> Iterator[Any]:
    options = {"body_timeout": 0.5, "body_min_rate": 100}
    with running_server(micro_model, "sim", server_options=options) as running:
        yield running


def test_a_body_trickled_a_byte_at_a_time_gets_408_and_is_closed(body_server: Any) -> None:
    with socket.create_connection((HOST, _port(body_server)), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(_request("POST", "/v1/completions", length=100) + b"{")
        status, headers, body = _response(sock)
        took = time.monotonic() - started
        assert status == 408 and headers["connection"] == "close"
        assert "--body-timeout" in _openai_error(408, body)["message"]
        assert _closed(sock)
    assert 0.45 <= took < 5.0  # body_timeout 0.5 s (up to 10% later), not forever
    assert httpx.get(f"{body_server.base_url}/health").status_code == 200


def test_the_byte_rate_floor_extends_the_timeout_for_a_body_still_coming(body_server: Any) -> None:
    pad = 1500 - len(json.dumps({"prompt": [5, 6], "max_tokens": 1, "pad": ""}))
    body = json.dumps({"prompt": [5, 6], "max_tokens": 1, "pad": "x" * pad}).encode()
    assert len(body) == 1500
    with socket.create_connection((HOST, _port(body_server)), timeout=10) as sock:
        # 1,000 bytes/s, over the 100 bytes/s floor: 1.5 s, three times the body timeout.
        sock.sendall(_request("POST", "/v1/completions", length=len(body)))
        started = time.monotonic()
        for i in range(0, len(body), 100):
            sock.sendall(body[i : i + 100])
            time.sleep(0.1)
        status, _, answer = _response(sock)
        assert status == 200, answer
        assert time.monotonic() - started > 1.0
    with socket.create_connection((HOST, _port(body_server)), timeout=10) as sock:
        # 50 bytes in 0.5 s, then nothing: 0.5 s plus 1 s per 100 bytes, i.e. closed near 1 s.
        sock.sendall(_request("POST", "/v1/completions", length=len(body)))
        started = time.monotonic()
        for i in range(0, 50, 10):
            ready, _, _ = select.select([sock], [], [], 0.1)
            if ready:
                break
            sock.sendall(body[i : i + 10])
        status, _, answer = _response(sock)
        took = time.monotonic() - started
        assert status == 408 and "1 s per 100 bytes" in _openai_error(408, answer)["message"]
        assert 0.85 <= took < 5.0


def test_a_pipelined_request_is_not_cut_by_the_header_timeout(micro_model: Path) -> None:
    with (
        running_server(micro_model, "sim", server_options={"header_timeout": 0.3}) as running,
        socket.create_connection((HOST, _port(running)), timeout=30) as sock,
    ):
        # Both requests in one write: the second one's head is complete before the first
        # response, and its generation outlasts the header timeout armed after that response.
        sock.sendall(_request("GET", "/health") + _request("POST", "/v1/completions", _completion(200)))
        assert _response(sock)[0] == 200
        status, _, body = _response(sock)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 200


# ---- the flags --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--body-timeout", "0"], "--body-timeout must be > 0 seconds"),
        (["--body-min-rate", "-1"], "--body-min-rate must be > 0 bytes per second"),
        (["--limit-concurrency", "0"], "--limit-concurrency must be >= 1"),
    ],
)
def test_bad_bounds_are_one_line_errors(
    micro_model: Path, flag: list[str], message: str, capsys: Any
) -> None:
    from tailserve.cli.app import main

    for command in (
        ["serve", "--model", str(micro_model), "--executor", "sim", "--port", "0"],
        ["router", "--backend", "http://127.0.0.1:1", "--port", "0"],
    ):
        assert main([*command, *flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tailserve: error:") and message in err and err.count("\n") == 1, err


def test_router_command_serves_with_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from tailserve.cli.app import main
    from tailserve.server.guards import ConcurrencyLimit
    from tailserve.server.launch import ClientTimeoutProtocol

    configs: list[Any] = []

    def run(server: uvicorn.Server, sockets: list[socket.socket]) -> None:
        configs.append(server.config)
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    flags = ["--body-timeout", "3", "--body-min-rate", "1000", "--limit-concurrency", "64"]
    assert main(["router", "--backend", "http://127.0.0.1:1", "--port", "0", *flags]) == 0
    (config,) = configs
    assert config.http is ClientTimeoutProtocol and config.limit_concurrency is None  # uvicorn's is off
    assert (config.header_timeout, config.body_timeout, config.body_min_rate) == (10.0, 3.0, 1000.0)
    limits = [m.kwargs for m in config.app.user_middleware if m.cls is ConcurrencyLimit]
    assert limits == [{"limit": 64}]
