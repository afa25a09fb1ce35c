"""A ``tailserve router`` app on 127.0.0.1 in a thread, over real or mocked backends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from tailserve.cluster import make_router
from tailserve.router.app import build_router_app
from tailserve.router.backends import BackendPool
from tailserve.server.launch import ServerThread


@contextmanager
def running_router(
    backends: list[str],
    policy: str = "round-robin",
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    read_timeout: float = 30.0,
    health_interval: float = 0.2,
    scrape_interval: float = 0.2,
    probe_timeout: float = 1.0,
    app_options: dict[str, Any] | None = None,
    kv_endpoints: list[str | None] | None = None,
) -> Iterator[Any]:
    """The router on a free port; ``.base_url``, ``.pool``, ``.metrics``, ``.router``; with
    ``kv_endpoints`` (kv-aware), subscribed to those backends' KV events (``.kv_events``)."""
    client = httpx.AsyncClient(transport=transport) if transport is not None else httpx.AsyncClient()
    pool = BackendPool(
        backends,
        client,
        health_interval=health_interval,
        scrape_interval=scrape_interval,
        probe_timeout=probe_timeout,
    )
    router = make_router(policy)
    kv_events = None
    if kv_endpoints is not None:
        from tailserve.router.kv_events import KvEventIndex

        kv_events = router.kv_index = KvEventIndex(kv_endpoints)
    app = build_router_app(
        pool, router, read_timeout=read_timeout, kv_events=kv_events, **(app_options or {})
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2)
    with ServerThread(uvicorn.Server(config)) as running:  # type: ignore[arg-type]
        running.pool = pool
        running.metrics = app.state.metrics
        running.router = router
        running.kv_events = kv_events
        yield running


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[5:].strip() for line in body.splitlines() if line.startswith("data:")]


@contextmanager
def sim_server(model: str, kv_events: bool = False, **engine_args: Any) -> Iterator[Any]:
    """An in-process ``tailserve serve --executor sim`` on a free port (``engine_args`` go to
    ``LLMEngine.from_args``, e.g. hardware, sim_model, max_model_len, policy_flags); with
    ``kv_events``, publishing them on a free port (``.kv_endpoint``)."""
    from tailserve.llm import LLMEngine
    from tailserve.server.app import build_app
    from tailserve.server.async_engine import AsyncEngine
    from tailserve.server.launch import make_server
    from tailserve.server.prometheus import ServerMetrics

    engine = LLMEngine.from_args(model, executor="sim", **engine_args)
    name = engine.deployment["model"]
    engine.model_name = name
    metrics = ServerMetrics(name)
    publisher = None
    if kv_events:
        from tailserve.server.kv_events import KvEventsConfig, ZmqKvEventPublisher

        config = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
        publisher = ZmqKvEventPublisher(config, engine.scheduler.kv_cache.block_size)
    async_engine = AsyncEngine(engine, metrics=metrics, kv_events=publisher)
    app = build_app(async_engine, served_model_name=name, model_root=model, metrics=metrics)
    server = make_server(app, async_engine, host="127.0.0.1", port=0, drain_timeout=2.0, log_level="warning")
    try:
        with ServerThread(server) as running:
            running.engine = engine
            running.kv_endpoint = publisher.endpoint if publisher is not None else None
            yield running
    finally:
        if publisher is not None:
            publisher.close()
