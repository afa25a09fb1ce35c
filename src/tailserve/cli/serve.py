"""``tailserve serve``: the OpenAI-compatible server over the PyTorch or the simulated executor.

    tailserve serve [--model DIR] [--executor torch|sim] [--policy P] [P's flags, engine names]
                    [--hardware H --sim-model M --tp N] [--host 127.0.0.1] [--port 8000]
                    [--max-queued-requests N] [--served-model-name NAME] [--api-key KEY]
                    [--allowed-origins ORIGIN ...] [--max-request-bytes N] [--header-timeout S]
                    [--body-timeout S] [--body-min-rate B] [--limit-concurrency N]
                    [--kv-events-config JSON]

Policy flags follow the policy with the engine's own names, as in ``tailserve simulate``
(``--max-num-batched-tokens 512 --scheduling-policy priority``). The listening socket is bound
before the engine loads, so a port in use is one clear error line rather than a traceback.

Exit status: 0 after a graceful shutdown (SIGINT/SIGTERM), 1 when the engine died (the log says
why), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from tailserve.cli.base import default_of
from tailserve.cli.listen import api_keys_from_env, bind_socket
from tailserve.cli.policy_flags import add_policy_flags
from tailserve.llm.engine_args import DTYPE_HELP, DTYPES, EXECUTORS, EngineArgs

DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUED_REQUESTS = 1024  # waiting requests before a 503: bounded memory, bounded waits


def _arg(name: str) -> Any:
    return default_of(EngineArgs, name)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics) over the "
        "real or the simulated executor; policy flags follow with the engine's names",
    )
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory (default: the tiny model tailserve creates once in its cache)",
    )
    p.add_argument("--executor", choices=EXECUTORS, default=_arg("executor"), help="(default: %(default)s)")
    p.add_argument("--dtype", default=_arg("dtype"), choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", default=_arg("device"), help="torch device (default: %(default)s)")
    p.add_argument("--seed", type=int, default=_arg("seed"), help="sampling seed (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument(
        "--kv-cache-memory-gib", type=float, default=None, help="torch: KV cache size (default: 2 GiB on CPU)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch: CPU threads (default: the free cores, revisited)"
    )
    g = p.add_argument_group("simulated executor (--executor sim)")
    g.add_argument("--hardware", default=_arg("hardware"), help="GPU from the catalog (default: %(default)s)")
    g.add_argument(
        "--sim-model", default=_arg("sim_model"), help="model whose speed to simulate (default: %(default)s)"
    )
    g.add_argument(
        "--tp",
        type=int,
        default=_arg("tensor_parallel_size"),
        help="tensor-parallel size (default: %(default)s)",
    )
    g.add_argument(
        "--calibration",
        default=_arg("calibration"),
        help="the cost model's calibration, as for simulate: auto | none | generic | a preset | "
        "FILE.json | vidur:DIR | gemm:FILE | aisim:FILE[:GPU] (default: %(default)s)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    g.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="(default: %(default)s; 0 picks a free port)"
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the model's; with --executor sim the simulated model's)",
    )
    g.add_argument(
        "--kv-events-config",
        metavar="JSON",
        default=None,
        help="vLLM's KV events: publish the blocks the prefix cache stores and evicts over ZeroMQ, "
        """e.g. '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}' """
        "(docs/router.md)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="answer 503 when this many requests wait already; 0: no limit (default: %(default)s)",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version "
        "(repeat for several keys; default: $TAILSERVE_API_KEY, else $VLLM_API_KEY, else open)",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        help="CORS: origins browsers may call from, e.g. http://localhost:3000 or '*' (default: none, CORS off)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body; larger ones get 413 (default: 4 MiB)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        help="seconds a connection has to send a complete request head (default: 10)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        help="seconds a request body has to arrive after its head, plus 1 s per --body-min-rate bytes "
        "received; a slower one gets 408 and its connection closed (default: 10)",
    )
    g.add_argument(
        "--body-min-rate",
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="the byte-rate floor of a request body beyond --body-timeout (default: 16384)",
    )
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="most requests in flight; beyond it a request gets 503 at once (/health, /metrics and "
        "/version are always answered; default: 1024)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are aborted "
        "(default: %(default)s)",
    )
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(run=run_serve)
    add_policy_flags(p, default_policy=_arg("policy"))


def _or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def run_serve(args: argparse.Namespace) -> int:
    from tailserve.server.guards import DEFAULT_LIMIT_CONCURRENCY, DEFAULT_MAX_REQUEST_BYTES
    from tailserve.server.launch import (
        DEFAULT_BODY_MIN_RATE,
        DEFAULT_BODY_TIMEOUT_S,
        DEFAULT_HEADER_TIMEOUT_S,
        check_client_bounds,
    )

    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    api_keys = api_keys_from_env(args.api_key, os.environ)
    max_request_bytes = _or_default(args.max_request_bytes, DEFAULT_MAX_REQUEST_BYTES)
    bounds = {
        "header_timeout": _or_default(args.header_timeout, DEFAULT_HEADER_TIMEOUT_S),
        "body_timeout": _or_default(args.body_timeout, DEFAULT_BODY_TIMEOUT_S),
        "body_min_rate": _or_default(args.body_min_rate, DEFAULT_BODY_MIN_RATE),
    }
    limit_concurrency = _or_default(args.limit_concurrency, DEFAULT_LIMIT_CONCURRENCY)
    check_client_bounds(**bounds, limit_concurrency=limit_concurrency)  # before the model loads
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    kv_events_config = None
    if args.kv_events_config is not None:
        from tailserve.server.kv_events import KvEventsConfig

        kv_events_config = KvEventsConfig.parse(args.kv_events_config)
    sock = bind_socket(args.host, args.port)
    server = None
    kv_events = None

    def on_signal(signum: int, frame: object) -> None:
        # uvicorn handles SIGINT/SIGTERM while it serves and raises the signal again once it
        # has shut down gracefully: then exit 0. Before it serves (the model loading), stop.
        if server is None or not server.should_exit:
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    from prometheus_client import disable_created_metrics

    from tailserve.executors.pytorch.init_model import default_model_dir
    from tailserve.llm import LLMEngine
    from tailserve.server.app import build_app
    from tailserve.server.async_engine import AsyncEngine
    from tailserve.server.launch import make_server
    from tailserve.server.prometheus import ServerMetrics

    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        disable_created_metrics()  # vLLM's /metrics has no *_created series either
        model_dir = str(args.model) if args.model else str(default_model_dir())
        engine = LLMEngine.from_args(
            model_dir,
            executor=args.executor,
            policy=args.policy,
            policy_flags=args.policy_flags,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            hardware=args.hardware,
            sim_model=args.sim_model,
            tensor_parallel_size=args.tp,
            calibration=args.calibration,
            max_model_len=args.max_model_len,
            kv_cache_memory_gib=args.kv_cache_memory_gib,
            threads=args.threads,
            served_model_name=args.served_model_name,
        )
        # A stand-in server is named after what it simulates, not after the tokenizer's model.
        simulated = engine.deployment["model"] if engine.deployment else None
        name = args.served_model_name or simulated or engine.model_name
        engine.model_name = name
        metrics = ServerMetrics(name)
        if kv_events_config is not None and kv_events_config.publishes:
            kv_events = _kv_events_publisher(kv_events_config, engine)
        async_engine = AsyncEngine(
            engine, max_queued_requests=args.max_queued_requests or None, metrics=metrics, kv_events=kv_events
        )
        app = build_app(
            async_engine,
            served_model_name=name,
            model_root=model_dir,
            metrics=metrics,
            api_keys=api_keys,
            allowed_origins=args.allowed_origins,
            max_request_bytes=max_request_bytes,
            limit_concurrency=limit_concurrency,
        )
        server = make_server(
            app,
            async_engine,
            host=args.host,
            port=args.port,
            drain_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            **bounds,
        )
        host, port = sock.getsockname()[:2]
        print(f"tailserve: serving {name!r}: {engine.description}", file=sys.stderr)
        auth = f", API key required ({len(api_keys)})" if api_keys else ""
        print(
            f"tailserve: listening on http://{host}:{port} (OpenAI API under /v1{auth})",
            file=sys.stderr,
            flush=True,
        )
        server.run(sockets=[sock])
    finally:
        sock.close()
        if kv_events is not None:
            kv_events.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.exit_code:
        print("tailserve: error: the engine died (see the log above); exiting with status 1", file=sys.stderr)
    return server.exit_code


def _kv_events_publisher(config: Any, engine: Any) -> Any:
    """The ZeroMQ publisher, or a clear error when this engine has no hashed prefix cache."""
    from tailserve.server.kv_events import ZmqKvEventPublisher

    kv = engine.scheduler.kv_cache
    if not kv.prefix_caching:
        raise ValueError(
            "--kv-events-config needs vLLM-style prefix caching (a hashed block pool), "
            "which this policy does not use (vllm, vllm-v0 and slo have it with prefix caching on)"
        )
    try:
        publisher = ZmqKvEventPublisher(config, kv.block_size)
    except Exception as error:  # zmq.ZMQError: address in use, bad endpoint
        raise ValueError(f"--kv-events-config: cannot open {config.endpoint}: {error}") from None
    print(f"tailserve: KV events on {publisher.endpoint} (topic {config.topic!r})", file=sys.stderr)
    return publisher
