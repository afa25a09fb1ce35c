"""Soak ``tailserve serve``: many requests at bounded concurrency, memory sampled as they go, then
what one 10 MB request does to everyone else.

For each executor (``sim``: the stand-in GPU server; ``torch``: the tiny model on CPU) the script
starts ``tailserve serve`` as a child process on a free port and:

1. sends ``--num-requests`` requests, at most ``--concurrency`` in flight: completions (half of
   them streamed, some of those hung up on after the first token), chat completions, and invalid
   bodies that must get a 400; it counts every status and samples the server's RSS (its own and
   its tokenizer worker's, from ``/proc``) at the start and after every ``--rss-every`` requests;
2. with one stream running, sends a 10 MB text to ``/tokenize`` (tokenized in the worker
   process) and a 10 MB prompt to ``/v1/completions`` (refused by size before tokenizing), while
   polling ``/health`` every 10 ms: it reports ``/health`` p50/p99 and the stream's largest gap
   between tokens before and during each big request.

Prints a summary and writes JSON (``benchmarks/out/server_soak.json``, git-ignored, unless
``--out``). Targets (issue 12): RSS growth < 5% after the warm-up (the first ``--rss-every``
requests) and no 5xx.

    python -m benchmarks.server_soak [--executors sim torch] [--num-requests 10000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks._common import cpu_line, default_out, simd_flags

BIG_BYTES = 10 * 10**6  # the "10 MB request"
BODY_LIMIT = 16 * 2**20  # the soak server takes 10 MB bodies (the default limit is 4 MiB)


def rss_mib(pid: int) -> float:
    """Resident memory of one process in MiB (VmRSS), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def memory(pid: int) -> dict[str, float]:
    """The server's RSS and its children's (the tokenizer worker), MiB."""
    kids = children(pid)
    return {"server_mib": round(rss_mib(pid), 1), "workers_mib": round(sum(rss_mib(k) for k in kids), 1)}


def start_server(executor: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "tailserve.cli", "serve", "--executor", executor, "--port", "0"]
    cmd += ["--max-request-bytes", str(BODY_LIMIT), "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(f"  [{executor}] {line}")
        if "listening on " in line:
            url = line.split("listening on ")[1].split()[0]
            break
    else:
        raise SystemExit(f"server_soak: `{' '.join(cmd)}` exited with {proc.wait()} before listening")
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"server_soak: {url}/health never answered 200")


def stop_server(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def request_kind(i: int) -> str:
    """A fixed mix, the same for every run: 45% plain, 35% streamed (5% hung up on), 10% chat,
    10% invalid."""
    slot = i % 20
    if slot < 9:
        return "plain"
    if slot < 15:
        return "stream"
    if slot == 15:
        return "hangup"
    if slot < 18:
        return "chat"
    return "invalid"


async def one_request(client: httpx.AsyncClient, i: int, max_tokens: int) -> str:
    """Send request ``i``; returns its outcome as a status (or ``hangup``)."""
    kind = request_kind(i)
    prompt = [5 + (i * 7 + k) % 900 for k in range(16 + i % 48)]  # varied lengths, some sharing
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if kind == "chat":
        chat = {
            "messages": [{"role": "user", "content": f"request {i}: say something"}],
            "max_tokens": max_tokens,
        }
        response = await client.post("/v1/chat/completions", json=chat)
        return str(response.status_code)
    if kind == "invalid":
        response = await client.post("/v1/completions", json={**body, "top_p": 0})
        return str(response.status_code)
    if kind == "plain":
        response = await client.post("/v1/completions", json=body)
        return str(response.status_code)
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        status = str(response.status_code)
        async for line in response.aiter_lines():
            if kind == "hangup" and line.startswith("data: "):
                return "hangup"
            if line.startswith('data: {"error"'):
                return f"{status}+error-event"
    return status


async def soak(
    url: str, pid: int, n: int, concurrency: int, rss_every: int, max_tokens: int
) -> dict[str, Any]:
    statuses: Counter[str] = Counter()
    samples = [{"requests": 0, **memory(pid)}]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)
        done = 0
        started = time.perf_counter()

        async def run(i: int) -> None:
            nonlocal done
            async with gate:
                try:
                    statuses[await one_request(client, i, max_tokens)] += 1
                except httpx.HTTPError as error:
                    statuses[f"client error: {type(error).__name__}"] += 1
            done += 1
            if done % rss_every == 0:
                samples.append(
                    {"requests": done, "seconds": round(time.perf_counter() - started, 1), **memory(pid)}
                )
                print(f"    {done:>6} requests  RSS {samples[-1]}", file=sys.stderr)

        await asyncio.gather(*(run(i) for i in range(n)))
        elapsed = time.perf_counter() - started
    base = samples[1]["server_mib"] if len(samples) > 1 else samples[0]["server_mib"]
    growth = (samples[-1]["server_mib"] - base) / base if base else None
    mid = samples[len(samples) // 2]["server_mib"]
    return {
        "requests": n,
        "concurrency": concurrency,
        "seconds": round(elapsed, 1),
        "requests_per_s": round(n / elapsed, 1),
        "statuses": dict(sorted(statuses.items())),
        "num_5xx": sum(v for k, v in statuses.items() if k[:1] == "5"),
        "rss": samples,
        "rss_growth_after_warmup": None if growth is None else round(growth, 4),
        "rss_growth_second_half": round((samples[-1]["server_mib"] - mid) / mid, 4) if mid else None,
    }


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else None


async def big_request(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One 10 MB request while a stream runs and /health is polled every 10 ms."""
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    health: list[float] = []
    window = {"on": False}
    # No max_tokens: the rest of the context, longer than the measurement; it is hung up on.
    stream_body = {"prompt": [5, 6, 7], "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        stop = asyncio.Event()

        async def stream() -> None:
            last = None
            async with client.stream("POST", "/v1/completions", json=stream_body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        (gaps_during if window["on"] else gaps_before).append(now - last)
                    last = now
                    if stop.is_set():
                        return

        async def poll() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await client.get("/health")
                if window["on"]:
                    health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(stream()), asyncio.create_task(poll())]
        await asyncio.sleep(2.0)  # the stream's pace before
        window["on"] = True
        t0 = time.perf_counter()
        response = await client.post(
            path, content=json.dumps(body), headers={"content-type": "application/json"}
        )
        took = time.perf_counter() - t0
        window["on"] = False
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "path": path,
        "status": response.status_code,
        "seconds": round(took, 2),
        "health_polls": len(health),
        "health_p50_ms": _pct(health, 50),
        "health_p99_ms": _pct(health, 99),
        "stream_max_gap_before_ms": _pct(gaps_before, 100),
        "stream_p50_gap_before_ms": _pct(gaps_before, 50),
        "stream_max_gap_during_ms": _pct(gaps_during, 100),
        "stream_p50_gap_during_ms": _pct(gaps_during, 50),
        "stream_tokens_during": len(gaps_during),
    }


def run_executor(executor: str, args: argparse.Namespace) -> dict[str, Any]:
    extra = ["--model", args.model] if args.model else []
    proc, url = start_server(executor, extra)
    try:
        print(f"  {executor}: soak at {url}", file=sys.stderr)
        result = asyncio.run(
            soak(url, proc.pid, args.num_requests, args.concurrency, args.rss_every, args.max_tokens)
        )
        text = ("the quick brown fox jumps over the lazy dog. " * (BIG_BYTES // 45 + 1))[:BIG_BYTES]
        result["big_tokenize"] = asyncio.run(big_request(url, "/tokenize", {"prompt": text}))
        result["big_completion"] = asyncio.run(
            big_request(url, "/v1/completions", {"prompt": text, "max_tokens": 1})
        )
        result["rss_after_big"] = memory(proc.pid)
    finally:
        result_code = stop_server(proc)
    result["exit_status"] = result_code
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executors", nargs="+", default=["sim", "torch"], choices=("sim", "torch"))
    p.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rss-every", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file (default: benchmarks/out/server_soak.json)"
    )
    args = p.parse_args()
    if args.num_requests < args.rss_every:
        p.error("--num-requests must be at least --rss-every")
    load = os.getloadavg()
    report: dict[str, Any] = {"load_average_start": [round(x, 2) for x in load], "runs": {}}
    for executor in args.executors:
        report["runs"][executor] = run_executor(executor, args)
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out = args.out or default_out("server_soak.json")
    print(cpu_line())
    out.write_text(json.dumps({**report, "cpu_flags": simd_flags()}, indent=2))
    for executor, run in report["runs"].items():
        rss = ", ".join(f"{s['server_mib']:.0f}" for s in run["rss"])
        growth = run["rss_growth_after_warmup"]
        print(
            f"{executor}: {run['requests']} requests in {run['seconds']} s ({run['requests_per_s']}/s), "
            f"statuses {run['statuses']}, 5xx {run['num_5xx']}; RSS MiB every {args.rss_every}: {rss} "
            f"(growth after warm-up {growth:+.2%}, over the second half {run['rss_growth_second_half']:+.2%}); "
            f"exit {run['exit_status']}"
        )
        for key in ("big_tokenize", "big_completion"):
            big = run[key]
            print(
                f"  10 MB {big['path']}: {big['status']} in {big['seconds']} s; /health p50 "
                f"{big['health_p50_ms']} ms p99 {big['health_p99_ms']} ms; stream gap max "
                f"{big['stream_max_gap_before_ms']} ms before, {big['stream_max_gap_during_ms']} ms during"
            )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
