"""``tailserve router``: the OpenAI-compatible proxy in front of several servers.

    tailserve router --backend URL [--backend URL ...] [--policy NAME[:flag=value,...]]
                     [--host 127.0.0.1] [--port 8080] [--scrape-interval S] [--health-interval S]
                     [--probe-timeout S] [--read-timeout S] [--api-key KEY] [--max-request-bytes N]
                     [--body-timeout S] [--body-min-rate B] [--limit-concurrency N]

``--policy`` is a router of ``tailserve.cluster`` (the simulator's own routing code):
round-robin, random, least-requests, least-kv, power-of-two, session, prefix-aware, kv-aware,
with their flags (``prefix-aware:cache_threshold=0.5``). Exit status: 0 after SIGINT/SIGTERM,
2 for bad arguments (one line naming the problem).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from tailserve.cli.listen import api_keys_from_env, bind_socket

DEFAULT_PORT = 8080


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "router",
        help="OpenAI-compatible proxy routing requests over several tailserve or vLLM servers "
        "with the cluster simulator's routers (docs/router.md)",
    )
    p.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="a server's base URL, e.g. http://127.0.0.1:8001 (repeat for each backend)",
    )
    p.add_argument(
        "--policy",
        default="round-robin",
        help="router NAME[:flag=value,...]: round-robin | random | least-requests | least-kv | "
        "power-of-two | session | prefix-aware | kv-aware | vllm-dp (default: %(default)s)",
    )
    p.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="(default: %(default)s; 0 picks a free port)"
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between reads of each backend's /metrics: the router's load is this stale "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        help="seconds between GET /health of each backend (default: %(default)s)",
    )
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=2.0,
        help="seconds to connect to a backend, and to answer /health or /metrics (default: %(default)s)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds a backend may send nothing on an accepted request before it gets a 504 "
        "(a plain request's whole generation; default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on the /v1 routes (repeat for several keys; default: "
        "$TAILSERVE_API_KEY, else $VLLM_API_KEY, else open); the header is forwarded to the backend",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body; larger get 413 (default: 4 MiB)",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=None,
        metavar="ENDPOINT",
        help="kv-aware only: a backend's KV-event endpoint (vLLM's ZeroMQ PUB, e.g. tcp://127.0.0.1:5557; "
        "'-' for none), one per --backend in the same order: the router learns their cached "
        "blocks from the events instead of its own tree",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        help="seconds a request body has to arrive after its head, plus 1 s per --body-min-rate bytes "
        "received; a slower one gets 408 and its connection closed (default: 10)",
    )
    p.add_argument(
        "--body-min-rate",
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="the byte-rate floor of a request body beyond --body-timeout (default: 16384)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="most requests in flight; beyond it a request gets 503 at once (/health and /metrics are "
        "always answered; default: no limit, each backend sheds its own excess)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(run=run_router)


def build_from_args(args: argparse.Namespace) -> Any:
    """The FastAPI app for parsed arguments (bad values raise ValueError with the flag's name)."""
    import httpx

    from tailserve.cluster import make_router
    from tailserve.router.app import build_router_app
    from tailserve.router.backends import BackendPool
    from tailserve.server.guards import DEFAULT_MAX_REQUEST_BYTES

    if not args.probe_timeout > 0:
        raise ValueError(f"--probe-timeout must be > 0 seconds, got {args.probe_timeout}")
    api_keys = api_keys_from_env(args.api_key, os.environ)
    max_bytes = DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None else args.max_request_bytes
    if max_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {max_bytes}")
    router = make_router(args.policy)
    kv_events = None
    if args.kv_events:
        if router.name != "kv-aware":
            raise ValueError(f"--kv-events is for --policy kv-aware, not {router.name}")
        if len(args.kv_events) != len(args.backend):
            raise ValueError(
                f"--kv-events: {len(args.kv_events)} endpoints for {len(args.backend)} backends "
                "(one per --backend, '-' for a backend without events)"
            )
        from tailserve.router.kv_events import KvEventIndex

        kv_events = KvEventIndex([None if e == "-" else e for e in args.kv_events])
        router.kv_index = kv_events
    # No pool limit: one backend connection per request in flight. Idle connections close
    # before uvicorn's 5 s keep-alive does, so a reused one is rarely found closed.
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    )
    try:
        pool = BackendPool(
            args.backend,
            client,
            health_interval=args.health_interval,
            scrape_interval=args.scrape_interval,
            probe_timeout=args.probe_timeout,
        )
        return build_router_app(
            pool,
            router,
            read_timeout=args.read_timeout,
            api_keys=api_keys,
            max_request_bytes=max_bytes,
            kv_events=kv_events,
            limit_concurrency=args.limit_concurrency,
        )
    except ValueError:
        import asyncio

        if kv_events is not None:
            kv_events.close()

        asyncio.run(client.aclose())
        raise


def run_router(args: argparse.Namespace) -> int:
    import uvicorn
    from prometheus_client import disable_created_metrics

    from tailserve.server.launch import (
        DEFAULT_BODY_MIN_RATE,
        DEFAULT_BODY_TIMEOUT_S,
        DEFAULT_HEADER_TIMEOUT_S,
        check_client_bounds,
        server_config,
    )

    disable_created_metrics()  # no *_created series, as vLLM's and tailserve serve's /metrics
    bounds = {
        "header_timeout": DEFAULT_HEADER_TIMEOUT_S,
        "body_timeout": DEFAULT_BODY_TIMEOUT_S if args.body_timeout is None else args.body_timeout,
        "body_min_rate": DEFAULT_BODY_MIN_RATE if args.body_min_rate is None else args.body_min_rate,
    }
    check_client_bounds(**bounds, limit_concurrency=args.limit_concurrency)  # one line, nothing built
    app = build_from_args(args)
    sock = bind_socket(args.host, args.port)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("httpx").setLevel(
        max(logging.WARNING, logging.getLogger().level)
    )  # no line per request
    config = server_config(app, host=args.host, port=args.port, log_level=args.log_level, **bounds)
    host, port = sock.getsockname()[:2]
    pool = app.state.pool
    print(
        f"tailserve router: {len(pool.backends)} backend(s) under {app.state.router.describe()}: "
        + ", ".join(b.url for b in pool.backends),
        file=sys.stderr,
    )
    print(
        f"tailserve router: listening on http://{host}:{port} (OpenAI API under /v1)",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(config)

    def on_signal(signum: int, frame: object) -> None:
        # uvicorn handles SIGINT/SIGTERM while it serves and raises the signal again once it has
        # shut down gracefully: then exit 0 (as tailserve serve). Before it serves, stop now.
        if not server.should_exit:
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
