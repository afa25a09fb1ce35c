"""The router's KV-event index against a live ``vllm serve`` (its CPU build): does the precise
``kv-aware`` view learn what vLLM cached, over vLLM's own ZeroMQ publisher?

Starts vLLM's OpenAI server on tailserve's tiny model with prefix caching, 32-token blocks (what
vLLM's CPU backend prefers; the router splits each into two 16-token keys) and
``--kv-events-config`` publishing on a local port; subscribes ``router.kv_events.KvEventIndex``
to it; sends a prompt of token ids (a 200-token system prompt + 40 more); then asks the index how
many leading 16-token blocks vLLM holds for that prompt, for the system prompt with another
ending, and for a fresh prompt, and checks them against what the prompt's length allows
(vLLM caches full blocks only). A functional check, not a timing: prints and saves the figures.

    python benchmarks/router_vllm_kv_events.py [--vllm-venv DIR] [--out FILE]

vLLM lives in ``${TAILSERVE_PEERS:-<repo>/.peers}/vllm`` (``scripts/setup-peers.sh vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _paths import default_out, missing_peer, peer_venv
from serve_vs_vllm import start_server, stop_server

from tailserve.cluster.routing import RouteRequest
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.router.kv_events import KvEventIndex

VLLM_BLOCK = 32
ROUTER_BLOCK = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-venv", default=str(peer_venv("vllm")))
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--events-port", type=int, default=5591)
    p.add_argument("--out", type=Path, default=default_out("router_vllm_kv_events.json"))
    args = p.parse_args()
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.exists():
        print(missing_peer("vllm", args.vllm_venv))
        return 2
    model = default_model_dir("tiny")  # created on first use
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
    config["endpoint"] = f"tcp://*:{args.events_port}"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", "tiny", "--port", str(args.port), "--max-model-len", "1024"]
    cmd += ["--block-size", str(VLLM_BLOCK), "--enable-prefix-caching", "--kv-events-config", json.dumps(config)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    url = f"http://127.0.0.1:{args.port}"
    log = Path(tempfile.gettempdir()) / "tailserve-router-vllm-kv-events.log"
    print(f"starting vLLM (log {log}) ...", flush=True)
    server = start_server(cmd, env, url, timeout=600, log=log)
    index = KvEventIndex([f"tcp://127.0.0.1:{args.events_port}"], topic="kv")
    try:
        time.sleep(1.0)  # ZeroMQ's slow joiner: a SUB misses what is sent before it has joined
        rng = random.Random(0)
        system = [rng.randrange(10, 900) for _ in range(200)]
        prompt = system + [rng.randrange(10, 900) for _ in range(40)]
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        reply.raise_for_status()
        deadline = time.monotonic() + 10
        while not index.num_batches[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        backend = index.backends[0]
        cases = {
            "the prompt sent": (prompt, (len(prompt) + 4) // VLLM_BLOCK * VLLM_BLOCK // ROUTER_BLOCK),
            "system prompt, another ending": (system + [5] * 30, len(system) // ROUTER_BLOCK),
            "a fresh prompt": ([rng.randrange(10, 900) for _ in range(100)], 0),
        }
        rows = {}
        ok = True
        for name, (tokens, expected) in cases.items():
            found = index.overlap(RouteRequest.from_tokens(name, tokens), 0)
            expected = min(expected, len(tokens) // ROUTER_BLOCK)
            rows[name] = {"prompt_tokens": len(tokens), "overlap_blocks": found, "expected_blocks": expected}
            ok &= found == expected
            print(f"  {name:32} {len(tokens):4} tokens: vLLM holds {found} leading 16-token blocks (expected {expected})")
        print(
            f"  {index.num_batches[0]} event batch(es); engine block size {backend.block_size}; "
            f"{len(backend.keys)} router keys; {backend.skipped_blocks} blocks skipped"
        )
    finally:
        index.close()
        stop_server(server)
    body = {
        "command": "python benchmarks/router_vllm_kv_events.py",
        "vllm_block_size": VLLM_BLOCK,
        "cases": rows,
        "event_batches": index.num_batches[0],
        "router_keys": len(backend.keys),
        "ok": ok,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(body, indent=1) + "\n")
    print(("agrees" if ok else "DISAGREES") + f" -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
