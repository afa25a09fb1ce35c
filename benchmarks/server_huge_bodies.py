"""Legal but huge request bodies against ``tailserve serve`` (issue 30, item 5): does one client's
4 MB body stall everyone else?

For each executor the script starts ``tailserve serve`` (the cached tiny model; ``--executor sim``
simulates Llama-3-8B, an 8,192-token context) on a free port, then for each attack below polls
``GET /health`` every 5 ms on its own connection and times one 64-token stream started with the
attack, and reports ``/health``'s worst and median latency, the stream's time (against the same
stream alone) and the attack's answers:

- ``stop 400k``: 400,000 ``stop`` strings (3.9 MB), 64 tokens asked for;
- ``ids 2M`` and ``ids 2M x8``: a prompt of 2,000,000 token ids (4.0 MB), once and 8 at once;
- ``messages 140k``: 140,000 empty chat messages (4.1 MB);
- ``junk messages``: 1,000,000 ``{}`` then one message (4 MB) ;
- ``unknown field``: a valid 2-token request padded with an unknown field of 2M ints (ignored).

Every loop is bounded (one request per attack, 8 for the parallel one); loopback only. Target:
``/health`` within 100 ms throughout. Prints a table and writes JSON
(``benchmarks/out/server_huge_bodies.json``, git-ignored, unless ``--out``).

    python benchmarks/server_huge_bodies.py [--executors sim torch] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
from _paths import save_results

COMPACT = (",", ":")


def bodies() -> dict[str, tuple[str, bytes, int]]:
    """name -> (route, body, how many at once)."""
    stop = {
        "prompt": "hi",
        "max_tokens": 64,
        "ignore_eos": True,
        "stop": [f"q{i:05d}" for i in range(400_000)],
    }
    ids = {"prompt": [5] * 2_000_000, "max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": ""}] * 140_000}
    junk = b'{"messages":[' + b",".join([b"{}"] * 1_000_000) + b',{"role":"user","content":"hi"}]}'
    padded = {"prompt": "hi", "max_tokens": 2, "unread": [1] * 2_000_000}
    enc = lambda body: json.dumps(body, separators=COMPACT).encode()  # noqa: E731
    return {
        "stop 400k": ("/v1/completions", enc(stop), 1),
        "ids 2M": ("/v1/completions", enc(ids), 1),
        "ids 2M x8": ("/v1/completions", enc(ids), 8),
        "messages 140k": ("/v1/chat/completions", enc(chat), 1),
        "junk messages": ("/v1/chat/completions", junk, 1),
        "unknown field": ("/v1/completions", enc(padded), 1),
    }


def start_server(executor: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "tailserve.cli", "serve", "--executor", executor, "--port", "0"]
    cmd += ["--log-level", "warning"]
    if executor == "torch":
        cmd += ["--dtype", "float32", "--kv-cache-memory-gib", "0.05", "--threads", "1"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "listening on " in line:
            url = line.split("listening on ")[1].split()[0]
            break
    else:
        raise SystemExit(f"server_huge_bodies: `{' '.join(cmd)}` exited with {proc.wait()} before listening")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining its log
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"server_huge_bodies: {url}/health never answered 200")


def stream_seconds(url: str) -> float:
    body = {"prompt": "hi", "max_tokens": 64, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as reply:
        for _ in reply.iter_lines():
            pass
    return time.perf_counter() - started


def attack(url: str, route: str, body: bytes, parallel: int) -> dict[str, Any]:
    stop, latencies = threading.Event(), []

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get(f"{url}/health")
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    answers: list[tuple[int, float, str]] = []

    def send() -> None:
        started = time.perf_counter()
        reply = httpx.post(
            f"{url}{route}", content=body, headers={"content-type": "application/json"}, timeout=300
        )
        answers.append((reply.status_code, round(time.perf_counter() - started, 3), reply.text[:160]))

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    streamed: list[float] = []
    threads = [threading.Thread(target=send) for _ in range(parallel)]
    threads.append(threading.Thread(target=lambda: streamed.append(stream_seconds(url))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(0.1)
    stop.set()
    poller.join()
    latencies.sort()
    return {
        "bytes": len(body),
        "parallel": parallel,
        "health_worst_ms": round(latencies[-1] * 1000, 1),
        "health_p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
        "health_polls": len(latencies),
        "stream_s": round(streamed[0], 3),
        "answers": sorted(answers),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--executors", nargs="+", default=["sim", "torch"], choices=["sim", "torch"])
    parser.add_argument("--out", help="results JSON (default: benchmarks/out/server_huge_bodies.json)")
    args = parser.parse_args()
    cases = bodies()
    results: dict[str, Any] = {}
    for executor in args.executors:
        proc, url = start_server(executor)
        try:
            alone = stream_seconds(url)
            runs = {name: attack(url, route, body, n) for name, (route, body, n) in cases.items()}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        results[executor] = {"stream_alone_s": round(alone, 3), "attacks": runs}
        print(f"\n{executor}: a 64-token stream alone {alone:.2f} s")
        print(f"  {'attack':15} {'MB':>5} {'/health worst':>14} {'p50':>7} {'stream':>8}  answers")
        for name, run in runs.items():
            codes = ",".join(str(code) for code, _, _ in run["answers"])
            slowest = max(t for _, t, _ in run["answers"])
            print(
                f"  {name:15} {run['bytes'] / 1e6:5.1f} {run['health_worst_ms']:11.0f} ms "
                f"{run['health_p50_ms']:5.1f} ms {run['stream_s']:6.2f} s  {codes} in <= {slowest:.2f} s"
            )
    save_results(results, args.out, "server_huge_bodies.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
