"""The router proxy over mocked backends (httpx.MockTransport): pass-through, retries, errors,
health, metrics. The live test with real servers is tests/test_router_live.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from router_helpers import running_router, sse_events
from server_helpers import assert_openai_error, wait_until
from tailserve.cluster import RouteRequest
from tailserve.router.load import parse_load
from tailserve.router.route_keys import route_request

A, B, C = "http://a.test:1", "http://b.test:2", "http://c.test:3"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def completion(text: str = "hi") -> httpx.Response:
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return httpx.Response(200, json=body)


class Fakes:
    """Mocked backends by base URL: /health, /metrics and /v1/models answered here, the
    completion routes by ``handlers[url]``; ``down`` ones refuse connections."""

    def __init__(self, urls: list[str]) -> None:
        self.handlers: dict[str, Handler] = {url: self._ok for url in urls}
        self.down: set[str] = set()
        self.unhealthy: set[str] = set()
        self.load: dict[str, tuple[int, int, float]] = {url: (0, 0, 0.0) for url in urls}
        self.posts: list[tuple[str, httpx.Request, bytes]] = []

    @staticmethod
    async def _ok(request: httpx.Request) -> httpx.Response:
        return completion()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(503 if base in self.unhealthy else 200)
        if path == "/metrics":
            running, waiting, kv = self.load[base]
            text = (
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
            )
            return httpx.Response(200, text=text)
        if path == "/v1/models":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": "m", "object": "model", "root": base}]}
            )
        content = await request.aread()
        self.posts.append((base, request, content))
        return await self.handlers[base](request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def post(base_url: str, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=10.0, **kwargs)


def test_plain_request_passes_through_with_request_id_and_user() -> None:
    fakes = Fakes([A, B])
    with running_router([A, B], transport=fakes.transport()) as router:
        body = {"model": "m", "prompt": "hello", "max_tokens": 3, "user": "alice", "request_id": "r-7"}
        response = post(router.base_url, body, headers={"X-Request-Id": "client-42"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "hi"
    assert response.headers["x-request-id"] == "client-42"
    base, sent, content = fakes.posts[0]
    assert response.headers["x-tailserve-backend"] == base
    assert sent.headers["x-request-id"] == "client-42"
    assert json.loads(content) == body  # byte for byte: user, request_id and the rest


def test_chat_completions_are_forwarded_to_the_chat_route() -> None:
    fakes = Fakes([A])
    with running_router([A], transport=fakes.transport()) as router:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": False}
        response = post(router.base_url, body, path="/v1/chat/completions")
    assert response.status_code == 200
    assert fakes.posts[0][1].url.path == "/v1/chat/completions"


def test_round_robin_alternates_and_counts_per_backend() -> None:
    fakes = Fakes([A, B])
    with running_router([A, B], transport=fakes.transport()) as router:
        for _ in range(4):
            assert post(router.base_url, {"prompt": "x"}).status_code == 200
        metrics = httpx.get(f"{router.base_url}/metrics").text
    assert [base for base, _, _ in fakes.posts] == [A, B, A, B]
    for url in (A, B):
        assert f'tailserve_router_requests_total{{backend="{url}",outcome="ok"}} 2.0' in metrics
        assert (
            f'tailserve_router_routing_decisions_total{{backend="{url}",policy="round-robin"}} 2.0' in metrics
        )
        assert f'tailserve_router_requests_in_flight{{backend="{url}"}} 0.0' in metrics
        assert f'tailserve_router_backend_healthy{{backend="{url}"}} 1.0' in metrics


def test_backend_error_status_and_body_pass_through() -> None:
    fakes = Fakes([A])

    async def bad(request: httpx.Request) -> httpx.Response:
        error = {"error": {"message": "top_p must be in (0, 1], got 0.0.", "type": "BadRequestError",
                           "param": "top_p", "code": 400}}  # fmt: skip
        return httpx.Response(400, json=error)

    fakes.handlers[A] = bad
    with running_router([A], transport=fakes.transport()) as router:
        response = post(router.base_url, {"prompt": "x", "top_p": 0})
        metrics = httpx.get(f"{router.base_url}/metrics").text
    assert assert_openai_error(response, 400)["message"] == "top_p must be in (0, 1], got 0.0."
    assert f'tailserve_router_requests_total{{backend="{A}",outcome="client_error"}} 1.0' in metrics
    assert len(fakes.posts) == 1  # a 400 is an answer, not retried


def test_streaming_passes_each_chunk_through_as_it_comes() -> None:
    """The backend sends its second event only after the client has the first: a proxy that
    buffered would never deliver the first, and the test would time out."""
    fakes = Fakes([A])
    first_seen = threading.Event()
    events = [
        b'data: {"choices": [{"text": "a"}]}\n\n',
        b'data: {"choices": [{"text": "b"}]}\n\n',
        b"data: [DONE]\n\n",
    ]

    async def stream(request: httpx.Request) -> httpx.Response:
        async def body():
            yield events[0]
            deadline = time.monotonic() + 10
            while not first_seen.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            yield events[1]
            yield events[2]

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    fakes.handlers[A] = stream
    with running_router([A], transport=fakes.transport()) as router:
        received = b""
        start = time.monotonic()
        with httpx.stream(
            "POST", f"{router.base_url}/v1/completions", json={"prompt": "x", "stream": True}
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for chunk in r.iter_raw():
                if not received:
                    first_seen.set()
                received += chunk
        assert time.monotonic() - start < 5  # the gate opened from the client side, not the deadline
    assert received == b"".join(events)


def test_dead_backend_is_taken_out_and_the_request_retried() -> None:
    fakes = Fakes([A, B])
    with running_router([A, B], transport=fakes.transport(), health_interval=30) as router:
        fakes.down.add(A)  # dies after the first health check
        responses = [post(router.base_url, {"prompt": "x"}) for _ in range(3)]
        a = router.pool.backends[0]
        assert not a.healthy and "ConnectError" in a.last_error
        metrics = httpx.get(f"{router.base_url}/metrics").text
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [base for base, _, _ in fakes.posts] == [B, B, B]  # A refused the first, then was out
    assert f'tailserve_router_errors_total{{backend="{A}",kind="connect"}} 1.0' in metrics
    assert f'tailserve_router_retries_total{{backend="{A}"}} 1.0' in metrics
    assert f'tailserve_router_backend_healthy{{backend="{A}"}} 0.0' in metrics


def test_backend_put_back_when_its_health_check_passes() -> None:
    fakes = Fakes([A, B])
    with running_router([A, B], transport=fakes.transport(), health_interval=0.05) as router:
        fakes.unhealthy.add(A)
        wait_until(lambda: not router.pool.backends[0].healthy, 5)
        assert {post(router.base_url, {"prompt": "x"}).headers["x-tailserve-backend"] for _ in range(3)} == {
            B
        }
        assert httpx.get(f"{router.base_url}/health").status_code == 200
        fakes.unhealthy.discard(A)
        wait_until(lambda: router.pool.backends[0].healthy, 5)
        backends = {post(router.base_url, {"prompt": "x"}).headers["x-tailserve-backend"] for _ in range(2)}
    assert backends == {A, B}


def test_connection_lost_before_the_answer_is_retried_elsewhere() -> None:
    """A plain request's head comes when it is done: a backend dying mid-generation has given
    the client nothing yet, so the request is rerun on another backend."""
    fakes = Fakes([A, B])

    async def dies(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    fakes.handlers[A] = dies
    with running_router([A, B], transport=fakes.transport(), health_interval=30) as router:
        response = post(router.base_url, {"prompt": "x"})
        assert router.pool.backends[0].healthy  # the health check decides, not a broken connection
        assert [b.in_flight for b in router.pool.backends] == [0, 0]
    assert response.status_code == 200 and response.headers["x-tailserve-backend"] == B
    assert [base for base, _, _ in fakes.posts] == [A, B]


def test_503_before_acceptance_is_retried_elsewhere() -> None:
    fakes = Fakes([A, B])

    async def full(request: httpx.Request) -> httpx.Response:
        message = "the waiting queue is full: 4 requests are waiting (--max-queued-requests 4); retry later"
        return httpx.Response(503, json={"error": {"message": message, "type": "ServiceUnavailableError",
                                                   "param": None, "code": 503}})  # fmt: skip

    fakes.handlers[A] = full
    with running_router([A, B], transport=fakes.transport()) as router:
        response = post(router.base_url, {"prompt": "x"})
        assert router.pool.backends[0].healthy  # a full queue is not a dead backend
    assert response.status_code == 200 and response.headers["x-tailserve-backend"] == B
    assert [base for base, _, _ in fakes.posts] == [A, B]


def test_no_backend_accepting_is_one_503_naming_each() -> None:
    fakes = Fakes([A, B])
    with running_router([A, B], transport=fakes.transport(), health_interval=30) as router:
        fakes.down.update({A, B})
        response = post(router.base_url, {"prompt": "x"})
        again = post(router.base_url, {"prompt": "x"})  # both out now: nothing to try
        health = httpx.get(f"{router.base_url}/health")
    message = assert_openai_error(response, 503)["message"]
    assert message.startswith("no backend accepted the request:") and A in message and B in message
    assert "no backend is healthy" in assert_openai_error(again, 503)["message"]
    assert A in assert_openai_error(health, 503)["message"]


def test_backend_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    fakes = Fakes([A])

    async def dies(request: httpx.Request) -> httpx.Response:
        async def body():
            yield b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi'  # cut inside an event
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    fakes.handlers[A] = dies
    with running_router([A], transport=fakes.transport(), health_interval=30) as router:
        response = post(router.base_url, {"prompt": "x", "stream": True})
        assert not router.pool.backends[0].healthy
        metrics = httpx.get(f"{router.base_url}/metrics").text
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and A in error["message"] and "mid-response" in error["message"]
    assert f'tailserve_router_errors_total{{backend="{A}",kind="disconnect"}} 1.0' in metrics
    assert f'tailserve_router_requests_total{{backend="{A}",outcome="backend_error"}} 1.0' in metrics


def test_stream_lost_before_its_first_byte_moves_to_another_backend() -> None:
    """Accepted (the head came) but still waiting there when the backend died: the client has
    nothing yet, so the stream continues from another backend."""
    fakes = Fakes([A, B])

    async def dies(request: httpx.Request) -> httpx.Response:
        async def body():
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
            yield b""  # an async generator

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async def streams(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')  # fmt: skip

    fakes.handlers[A], fakes.handlers[B] = dies, streams
    with running_router([A, B], transport=fakes.transport(), health_interval=30) as router:
        response = post(router.base_url, {"prompt": "x", "stream": True})
        metrics = httpx.get(f"{router.base_url}/metrics").text
        assert [b.in_flight for b in router.pool.backends] == [0, 0]
    assert sse_events(response.text) == ['{"choices": [{"text": "b"}]}', "[DONE]"]
    assert [base for base, _, _ in fakes.posts] == [A, B]
    assert f'tailserve_router_retries_total{{backend="{A}"}} 1.0' in metrics
    assert f'tailserve_router_requests_total{{backend="{B}",outcome="ok"}} 1.0' in metrics


def test_backend_dying_mid_plain_response_is_a_502() -> None:
    fakes = Fakes([A])

    async def dies(request: httpx.Request) -> httpx.Response:
        async def body():
            yield b'{"id": "cmpl-1", '
            raise httpx.ReadError("connection reset by peer")

        return httpx.Response(200, headers={"content-type": "application/json"}, content=body())

    fakes.handlers[A] = dies
    with running_router([A], transport=fakes.transport(), health_interval=30) as router:
        response = post(router.base_url, {"prompt": "x"})
    assert A in assert_openai_error(response, 502)["message"]


def test_silent_backend_times_out_with_a_504() -> None:
    fakes = Fakes([A])

    async def silent(request: httpx.Request) -> httpx.Response:
        async def body():
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            raise httpx.ReadTimeout("timed out")  # what httpx raises after read_timeout

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    fakes.handlers[A] = silent
    with running_router([A], transport=fakes.transport(), read_timeout=0.5) as router:
        response = post(router.base_url, {"prompt": "x", "stream": True})
        assert router.pool.backends[0].in_flight == 0
    error = json.loads(sse_events(response.text)[-2])["error"]
    assert error["code"] == 504 and "--read-timeout" in error["message"]


def test_read_timeout_is_real_against_a_backend_that_never_answers() -> None:
    """A live socket that accepts and never answers: the router gives up after --read-timeout."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with running_router([url], health_interval=30, read_timeout=0.5, probe_timeout=0.3) as router:
            router.pool.backends[0].healthy = True  # its /health never answered either
            start = time.monotonic()
            response = post(router.base_url, {"prompt": "x"})
            elapsed = time.monotonic() - start
    finally:
        listener.close()
    message = assert_openai_error(response, 504)["message"]
    assert url in message and "--read-timeout" in message
    assert elapsed < 5


def test_client_leaving_mid_stream_closes_the_backend_stream() -> None:
    fakes = Fakes([A])
    closed = threading.Event()

    async def endless(request: httpx.Request) -> httpx.Response:
        async def body():
            try:
                while True:
                    yield b'data: {"choices": [{"text": "a"}]}\n\n'
                    await asyncio.sleep(0.01)
            finally:
                closed.set()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    fakes.handlers[A] = endless
    with running_router([A], transport=fakes.transport()) as router:
        with httpx.stream(
            "POST", f"{router.base_url}/v1/completions", json={"prompt": "x", "stream": True}
        ) as r:
            next(r.iter_raw())
        assert closed.wait(5)
        wait_until(lambda: router.pool.backends[0].in_flight == 0, 5)
        assert router.router.inflight.count(0) == 0


def test_a_router_bug_is_an_openai_500_and_leaves_nothing_in_flight() -> None:
    fakes = Fakes([A])
    with running_router([A], transport=fakes.transport()) as router:

        def broken(*args: object) -> int:
            raise RuntimeError("boom")

        router.router.route = broken  # type: ignore[method-assign]
        response = post(router.base_url, {"prompt": "x"})
        assert router.pool.backends[0].in_flight == 0
    message = assert_openai_error(response, 500)["message"]
    assert "boom" not in message and "router logged" in message


def test_models_health_and_bad_bodies() -> None:
    fakes = Fakes([A, B])
    with running_router([A, B], transport=fakes.transport()) as router:
        models = httpx.get(f"{router.base_url}/v1/models").json()
        health = httpx.get(f"{router.base_url}/health")
        not_json = httpx.post(f"{router.base_url}/v1/completions", content=b"{nope", timeout=5)
        unknown = httpx.get(f"{router.base_url}/v2/nothing")
    assert models["object"] == "list" and [card["id"] for card in models["data"]] == ["m"]
    assert health.status_code == 200
    assert "not a JSON object" in assert_openai_error(not_json, 400)["message"]
    assert_openai_error(unknown, 404)
    assert not fakes.posts


def test_api_key_guards_the_v1_routes() -> None:
    fakes = Fakes([A])
    with running_router([A], transport=fakes.transport(), app_options={"api_keys": ["k1"]}) as router:
        refused = post(router.base_url, {"prompt": "x"})
        allowed = post(router.base_url, {"prompt": "x"}, headers={"Authorization": "Bearer k1"})
        health = httpx.get(f"{router.base_url}/health")
    assert_openai_error(refused, 401)
    assert allowed.status_code == 200 and health.status_code == 200
    assert fakes.posts[0][1].headers["authorization"] == "Bearer k1"  # forwarded to the backend


def test_scraped_load_reaches_the_router() -> None:
    fakes = Fakes([A, B])
    fakes.load[A] = (7, 5, 0.9)  # A is busy
    with running_router([A, B], "least-requests", transport=fakes.transport()) as router:
        wait_until(lambda: router.pool.backends[0].load is not None, 5)
        chosen = {post(router.base_url, {"prompt": "x"}).headers["x-tailserve-backend"] for _ in range(3)}
        metrics = httpx.get(f"{router.base_url}/metrics").text
        state = router.pool.states()[0]
    assert chosen == {B}
    assert (state.num_running, state.num_waiting, state.kv_usage) == (7, 5, 0.9) and state.scraped_at > 0
    assert f'tailserve_router_backend_num_requests_waiting{{backend="{A}"}} 5.0' in metrics
    assert f'tailserve_router_backend_kv_cache_usage_perc{{backend="{A}"}} 0.9' in metrics


def test_prefix_aware_sends_a_shared_prefix_to_one_backend() -> None:
    fakes = Fakes([A, B, C])
    prefixes = [list(range(1000 * p, 1000 * p + 256)) for p in range(3)]
    with running_router([A, B, C], "prefix-aware", transport=fakes.transport()) as router:
        by_prefix: dict[int, set[str]] = {}
        for i in range(12):
            p = i % 3
            response = post(router.base_url, {"prompt": [*prefixes[p], 50_000 + i]})
            by_prefix.setdefault(p, set()).add(response.headers["x-tailserve-backend"])
    assert all(len(backends) == 1 for backends in by_prefix.values())
    assert len(set().union(*by_prefix.values())) == 3  # each prefix its own backend


# ---- what the router reads ----------------------------------------------------------------
def test_parse_load_reads_vllm_names_old_and_new_and_sglang() -> None:
    new = 'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_waiting{engine="0"} 2\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n'
    old = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.25\n"
    two_engines = 'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
    sglang = "sglang:num_running_reqs 4\nsglang:num_queue_reqs 6\nsglang:token_usage 0.75\n"
    assert (load := parse_load(new)) and (load.num_running, load.num_waiting, load.kv_usage) == (3, 2, 0.5)
    assert (load := parse_load(old)) and (load.num_running, load.kv_usage) == (1, 0.25)
    assert (load := parse_load(two_engines)) and load.num_running == 3
    assert (load := parse_load(sglang)) and (load.num_running, load.num_waiting, load.kv_usage) == (
        4,
        6,
        0.75,
    )
    assert parse_load("process_cpu_seconds_total 1.0\n") is None
    with pytest.raises(ValueError):
        parse_load("this is { not prometheus")


def test_route_request_from_tokens_text_and_chat() -> None:
    tokens = route_request("/v1/completions", {"prompt": list(range(40)), "user": "u1"}, "r1")
    assert tokens == RouteRequest.from_tokens("r1", list(range(40)), session_id="u1")
    text = "x" * 256
    a = route_request("/v1/completions", {"prompt": text + "tail one"}, "r2")
    b = route_request("/v1/completions", {"prompt": [text + "another"]}, "r3")
    assert a.prompt_len == -(-len(text + "tail one") // 4) and len(a.block_keys) == 4
    assert a.block_keys == b.block_keys  # same leading 256 bytes: same keys
    chat = {"messages": [{"role": "system", "content": "s" * 100}, {"role": "user", "content": [{"type": "text", "text": "q"}]}],
            "session_id": "conv-9"}  # fmt: skip
    routed = route_request("/v1/chat/completions", chat, "r4", {"x-session-id": "ignored"})
    assert routed.session_id == "conv-9" and routed.block_keys
    assert route_request("/v1/completions", {}, "r5", {"x-session-id": "h"}).session_id == "h"
    assert route_request("/v1/completions", {"prompt": None}, "r6").prompt_len == 1  # the backend's 400


def test_prefix_repetition_dataset_is_vllms() -> None:
    from tailserve.bench.datasets import prefix_repetition_requests

    class Vocab:
        path = "fake"

        def normal_ids(self) -> list[int]:
            return list(range(100, 600))

    requests = prefix_repetition_requests(
        10,
        Vocab(),
        prefix_len=20,
        suffix_len=5,
        num_prefixes=3,
        output_len=7,
        seed=1,  # type: ignore[arg-type]
    )
    assert len(requests) == 9  # 10 // 3 per prefix, as vLLM
    assert all(r.prompt_len == 25 == len(r.prompt) and r.output_len == 7 for r in requests)
    groups: dict[tuple[int, ...], int] = {}
    for r in requests:
        groups[tuple(r.prompt[:20])] = groups.get(tuple(r.prompt[:20]), 0) + 1
    assert sorted(groups.values()) == [3, 3, 3]
    assert requests == prefix_repetition_requests(10, Vocab(), prefix_len=20, suffix_len=5, num_prefixes=3,
                                                  output_len=7, seed=1)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(ValueError, match="num-prefixes"):
        prefix_repetition_requests(2, Vocab(), num_prefixes=3)  # type: ignore[arg-type]


def test_bad_router_arguments_are_one_line_errors() -> None:
    from tailserve.router.backends import BackendPool

    client = httpx.AsyncClient()
    with pytest.raises(ValueError, match="at least one --backend"):
        BackendPool([], client)
    with pytest.raises(ValueError, match="given twice"):
        BackendPool([A, A + "/"], client)
    with pytest.raises(ValueError, match="http"):
        BackendPool(["ftp://x"], client)
    with pytest.raises(ValueError, match="--scrape-interval"):
        BackendPool([A], client, scrape_interval=0)
    assert BackendPool([A + "/v1/"], client).backends[0].url == A
