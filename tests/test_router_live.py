"""The router live: three ``tailserve serve --executor sim`` processes on 127.0.0.1, the router
in front, the bench client through it.

- On vLLM's ``prefix_repetition`` workload (12 prefixes of 1,024 tokens, each backend's KV cache
  holding about 4.4 of them), ``prefix-aware`` routing keeps each prefix on one backend and gets
  a higher prefix-cache hit rate (the backends' own ``vllm:prefix_cache_*`` counters) and a lower
  TTFT p50 than ``round-robin``, which makes every backend cache every prefix.
- A backend killed (SIGKILL) mid-run loses no request: each one either completes or ends with an
  OpenAI error naming the dead backend, and the router's books balance.

Each backend simulates Llama-3-8B on an A40 in real time (a 1,056-token prompt ~144 ms to
prefill, ~30 ms with its 1,024-token prefix cached), so the timing contrast stays above this
shared machine's scheduling noise; the two routers run at the same time so both see the same load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from router_helpers import running_router, sim_server
from tailserve.bench.client import BenchConfig, RequestResult, run_benchmark, send_times
from tailserve.bench.datasets import prefix_repetition_requests
from tailserve.bench.tokenizer import load_tokenizer
from test_server import micro_model  # noqa: F401  (fixture)

# The same deployment as ENGINE_ARGS below, as a command line.
BACKEND_FLAGS = ["--executor", "sim", "--hardware", "A40", "--sim-model", "Llama-3-8B",
                 "--max-model-len", "2048", "--gpu-memory-utilization", "0.373"]  # fmt: skip
NUM_PREFIXES = 12
PREFIX_LEN = 1024


@contextmanager
def sim_backend(model: Path) -> Iterator[dict[str, Any]]:
    cmd = [sys.executable, "-m", "tailserve.cli", "serve", "--model", str(model), *BACKEND_FLAGS,
           "--port", "0", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    backend: dict[str, Any] = {"proc": proc, "url": None, "ready": threading.Event(), "log": []}

    def read() -> None:  # keeps the pipe drained for the life of the process
        assert proc.stderr is not None
        for line in proc.stderr:
            backend["log"].append(line)
            if "listening on " in line and backend["url"] is None:
                backend["url"] = line.split("listening on ")[1].split()[0]
                backend["ready"].set()
        backend["ready"].set()

    threading.Thread(target=read, daemon=True).start()
    try:
        yield backend
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def sim_backends(model: Path, count: int) -> Iterator[list[dict[str, Any]]]:
    """``count`` backends started at once (their start-ups overlap)."""
    with ExitStack() as stack:
        backends = [stack.enter_context(sim_backend(model)) for _ in range(count)]
        for b in backends:
            assert b["ready"].wait(120) and b["url"], f"a backend printed no address: {''.join(b['log'])}"
        for b in backends:
            deadline = time.monotonic() + 60
            while not _healthy(b["url"]):
                assert time.monotonic() < deadline, f"{b['url']} never became healthy"
                time.sleep(0.05)
        yield backends


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """Prefix-cache (hits, queries) in tokens, summed over the backends' own /metrics."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def bench(base_url: str, requests: list[Any], rate: float, on_done: Any = None) -> list[RequestResult]:
    config = BenchConfig(api_url=f"{base_url}/v1/completions", model="Llama-3-8B", timeout_s=60.0)
    times = send_times(requests, rate, 1.0, seed=0)
    results, _ = asyncio.run(run_benchmark(requests, times, config, on_done=on_done))
    return results


@pytest.fixture(scope="module")
def workload(micro_model: Path) -> list[Any]:  # noqa: F811
    tokenizer = load_tokenizer(micro_model)
    return prefix_repetition_requests(
        NUM_PREFIXES * 6, tokenizer, prefix_len=PREFIX_LEN, suffix_len=32, num_prefixes=NUM_PREFIXES,
        output_len=4, seed=0,
    )  # fmt: skip


# Llama-3-8B on an A40 at gpu_memory_utilization 0.373: 291 blocks of 16 = 4,656 tokens of KV.
ENGINE_ARGS = {"hardware": "A40", "sim_model": "Llama-3-8B", "max_model_len": 2048,
               "policy_flags": {"gpu_memory_utilization": 0.373}}  # fmt: skip


def test_prefix_aware_beats_round_robin_on_shared_prefixes(micro_model: Path, workload: list[Any]) -> None:  # noqa: F811
    """Both routers at once, each over its own three fresh backends, on the same requests at
    the same times: they share this machine's load, so the comparison is side by side."""
    policies = ("round-robin", "prefix-aware")
    with ExitStack() as stack:
        servers = [stack.enter_context(sim_server(str(micro_model), **ENGINE_ARGS)) for _ in range(6)]
        urls = [[s.base_url for s in servers[:3]], [s.base_url for s in servers[3:]]]
        routers = [stack.enter_context(running_router(u, p)) for u, p in zip(urls, policies)]

        async def both() -> list[list[RequestResult]]:
            config = [
                BenchConfig(f"{r.base_url}/v1/completions", "Llama-3-8B", timeout_s=60.0) for r in routers
            ]
            times = send_times(workload, 12.0, 1.0, seed=0)
            runs = await asyncio.gather(*(run_benchmark(workload, times, c) for c in config))
            return [results for results, _ in runs]

        outcomes = asyncio.run(both())
        counters = [prefix_counters(u) for u in urls]
    found = {}
    for policy, results, (hits, queries) in zip(policies, outcomes, counters):
        assert all(r.success for r in results), [r.error for r in results if not r.success][:3]
        ttft = [r.ttft for r in results]
        found[policy] = {"hit_rate": hits / queries, "ttft_p50": float(np.median(ttft)),
                         "ttft_p99": float(np.percentile(ttft, 99))}  # fmt: skip
        print(f"\n{policy}: {found[policy]}")
    rr, pa = found["round-robin"], found["prefix-aware"]
    assert pa["hit_rate"] > rr["hit_rate"] + 0.2
    assert pa["ttft_p50"] < rr["ttft_p50"]


def test_killing_a_backend_mid_run_loses_no_request(micro_model: Path, workload: list[Any]) -> None:  # noqa: F811
    """One backend is a real process, killed with SIGKILL while it streams several requests;
    the other two run in this process."""
    requests = [dataclasses.replace(r, output_len=32) for r in workload[:60]]  # ~1 s each
    with sim_backends(micro_model, 1) as (victim,), ExitStack() as stack:
        others = [stack.enter_context(sim_server(str(micro_model), **ENGINE_ARGS)) for _ in range(2)]
        urls = [victim["url"], *(s.base_url for s in others)]
        done: list[RequestResult] = []
        killed_at: list[float] = []  # time.perf_counter, the bench client's clock

        def on_done(result: RequestResult) -> None:
            done.append(result)
            if len(done) == 10:  # a sixth of the way in, with requests streaming on each backend
                victim["proc"].send_signal(signal.SIGKILL)
                killed_at.append(time.perf_counter())

        # A generous probe timeout: the dead backend is taken out by its refused connection at
        # once, while on a loaded machine the two live in-process backends can answer /health
        # late (with the helper's 1 s they were all taken out once at load ~7).
        with running_router(urls, "round-robin", health_interval=0.2, probe_timeout=5.0) as router:
            results = bench(router.base_url, requests, rate=20.0, on_done=on_done)
            metrics = httpx.get(f"{router.base_url}/metrics", timeout=5).text
            in_flight = [b.in_flight for b in router.pool.backends]
            taken_out = not router.pool.backends[0].healthy
    failed = [r for r in results if not r.success]
    print(f"\n{len(results)} sent, {len(results) - len(failed)} completed, {len(failed)} ended with an error")
    assert len(results) == len(requests)  # every request came back: none hangs, none is dropped
    assert victim["proc"].poll() is not None and taken_out
    assert failed, "the kill should have caught requests streaming on the victim"
    for r in failed:  # a clean error naming the dead backend, never a bare disconnect
        assert victim["url"] in r.error and "mid-response" in r.error, r.error
    # Only requests whose tokens had started flowing were lost; every one sent after the kill
    # completed (those that met the dead backend before the router knew were retried elsewhere,
    # and those still waiting in its queue moved to another backend).
    assert all(r.start_time < killed_at[0] and r.ttft > 0 for r in failed)
    assert all(r.success for r in results if r.start_time > killed_at[0])
    assert in_flight == [0, 0, 0]

    def total(outcome: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("tailserve_router_requests_total{") and f'outcome="{outcome}"' in line
        )

    # Requests handed on from the victim count there as backend_error too, then ok elsewhere.
    assert total("ok") == len(results) - len(failed) and total("backend_error") >= len(failed)


def test_router_command_in_front_of_two_backends_with_bench(micro_model: Path, capsys: Any) -> None:  # noqa: F811
    """``tailserve router`` as a process, ``tailserve bench --dataset prefix_repetition`` through it."""
    from tailserve.cli.app import main

    with ExitStack() as stack:
        urls = [stack.enter_context(sim_server(str(micro_model), **ENGINE_ARGS)).base_url for _ in range(2)]
        cmd = [sys.executable, "-m", "tailserve.cli", "router", "--port", "0", "--policy", "prefix-aware",
               "--scrape-interval", "0.2", "--log-level", "warning"]  # fmt: skip
        for url in urls:
            cmd += ["--backend", url]
        proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        try:
            lines = []
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                if "listening on " in line:
                    break
            assert "2 backend(s) under prefix-aware" in lines[0], lines
            base = lines[-1].split("listening on ")[1].split()[0]
            deadline = time.monotonic() + 30
            while not _healthy(base):
                assert time.monotonic() < deadline, "the router never became healthy"
                time.sleep(0.05)
            capsys.readouterr()
            argv = ["bench", "--base-url", base, "--tokenizer", str(micro_model), "--dataset", "prefix_repetition",
                    "--num-prompts", "8", "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len",
                    "256", "--prefix-repetition-suffix-len", "16", "--prefix-repetition-output-len", "4",
                    "--request-rate", "20", "--no-progress"]  # fmt: skip
            assert main(argv) == 0
            out = capsys.readouterr().out
            metrics = httpx.get(f"{base}/metrics", timeout=5).text
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
    assert "Successful requests" in out and "8" in out
    decisions = [
        line for line in metrics.splitlines() if line.startswith("tailserve_router_routing_decisions_total")
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in decisions) == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "ftp://x"], "expected an http(s)://HOST:PORT URL"),
        (["--backend", "http://127.0.0.1:1", "--policy", "fastest"], "unknown router 'fastest'"),
        (
            ["--backend", "http://127.0.0.1:1", "--policy", "prefix-aware:cache_threshold=2"],
            "cache_threshold",
        ),
        (["--backend", "http://127.0.0.1:1", "--scrape-interval", "0"], "--scrape-interval must be > 0"),
        (["--backend", "http://127.0.0.1:1", "--port", "70000"], "--port must be in 0..65535"),
    ],
)
def test_router_command_bad_arguments_are_one_line(argv: list[str], message: str, capsys: Any) -> None:
    from tailserve.cli.app import main

    assert main(["router", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailserve: error:") and message in err and err.count("\n") == 1, err
