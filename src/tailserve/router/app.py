"""The router's HTTP API (FastAPI): the OpenAI routes forwarded to a backend, the rest its own.

| route | what |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | forwarded (``proxy.Proxy``), streaming or not |
| ``GET /v1/models`` | the healthy backends' model cards, each model once |
| ``GET /health`` | 200 while at least one backend is in service, else 503 naming why each is out |
| ``GET /metrics`` | the router's own Prometheus text (``metrics.RouterMetrics``) |

``recorder`` (``--record-trace FILE``): every completion request written as a line of a
recorded trace (``recording.py``).

``--api-key`` guards every route but ``/health`` and ``/metrics`` (``server.guards``, as
``tailserve serve``); the client's ``Authorization`` header is forwarded to the backend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tailserve import __version__
from tailserve.cluster.routing import Router
from tailserve.router.backends import BackendPool
from tailserve.router.metrics import RouterMetrics
from tailserve.router.proxy import Proxy
from tailserve.router.responses import error_response, forwarded_models
from tailserve.server.guards import DEFAULT_MAX_REQUEST_BYTES, ApiKeyGuard, BodyLimit, ConcurrencyLimit

logger = logging.getLogger("tailserve.router")


def build_router_app(
    pool: BackendPool,
    router: Router,
    *,
    read_timeout: float = 600.0,
    api_keys: list[str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics: RouterMetrics | None = None,
    kv_events: Any = None,
    limit_concurrency: int | None = None,
    recorder: Any = None,
) -> FastAPI:
    """The app; its lifespan runs a first health check and scrape, then the loops, and closes
    the pool's client (and the KV-event subscriptions, ``router/kv_events.py``) at the end."""
    metrics = metrics or RouterMetrics([b.url for b in pool.backends], router.describe())
    previous = pool.on_change
    pool.on_change = metrics.observe_backend if previous is None else (
        lambda b: (previous(b), metrics.observe_backend(b))
    )  # fmt: skip
    proxy = Proxy(pool, router, metrics, read_timeout=read_timeout, recorder=recorder)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.refresh()
        pool.start()
        try:
            yield
        finally:
            await pool.stop()
            await pool.client.aclose()
            if kv_events is not None:
                kv_events.close()
            if recorder is not None:
                recorder.close()

    app = FastAPI(title="tailserve router", version=__version__, lifespan=lifespan)
    app.state.pool = pool
    app.state.router = router
    app.state.metrics = metrics
    app.state.kv_events = kv_events
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_keys:
        app.add_middleware(ApiKeyGuard, api_keys=list(api_keys))
    if limit_concurrency is not None:  # requests beyond it: a 503 at once (/health, /metrics pass)
        app.add_middleware(ConcurrencyLimit, limit=limit_concurrency)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(str(error.detail), error.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, error: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response("internal router error (the router logged the details)", 500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        healthy = [b for b in pool.backends if b.healthy]
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

        async def cards(url: str) -> list[Any]:
            try:
                response = await pool.client.get(f"{url}/v1/models", headers=auth, timeout=pool.probe_timeout)
                response.raise_for_status()
                data = response.json().get("data")
            except (httpx.HTTPError, ValueError, AttributeError):
                return []
            return data if isinstance(data, list) else []

        found = await asyncio.gather(*(cards(b.url) for b in healthy))
        listed = forwarded_models([card for group in found for card in group])
        if not listed["data"]:
            return error_response("no healthy backend listed a model", 503)
        return JSONResponse(listed)

    @app.get("/health")
    async def health() -> Response:
        if any(b.healthy for b in pool.backends):
            return Response(status_code=200)
        reasons = "; ".join(f"{b.url}: {b.last_error or 'not checked yet'}" for b in pool.backends)
        return error_response(f"no backend is in service ({reasons})", 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
