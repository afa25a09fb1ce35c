"""Where vLLM's CPU server spends the host's cores: its processes' CPU (API server, the
EngineCore scheduler, the Worker running the model) with one stream at a time and with 16 at
once (issue 33: is the twin's calibration, taken one request at a time, missing CPU the API
server takes under concurrent streams?).

Starts ``vllm serve`` from its peer venv (``scripts/setup-peers.sh vllm``) on the closed loop's
tiny model at the closed loop's first setting, alternates 1 and 16 concurrent greedy streams of
96 tokens over 200-token prompts, and reads each process's CPU from ``/proc/PID/stat`` around
each phase; prints and saves the cores each process kept busy and the streams' median gap.

    python -m benchmarks.vllm_process_cpu [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

from benchmarks._closed_loop_engines import SETTINGS, Engine
from benchmarks._common import cpu_line, missing_peer, peer_venv, save_results
from benchmarks.serve_vs_vllm import start_server, stop_server

TICK = os.sysconf("SC_CLK_TCK")
MODEL = Path.home() / ".cache" / "tailserve" / "models" / "tiny"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def tree(pid: int) -> list[int]:
    out = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            out += tree(int(kid))
    return out


def label(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    return (
        cmd.split()[0] if cmd.startswith("VLLM::") else ("api server" if "entrypoints" in cmd else cmd[:40])
    )


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> list[float]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    gaps, last = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps[len(gaps) // 4 : 3 * len(gaps) // 4]


async def _phase(url: str, streams: int, rounds: int, tokens: int = 96) -> float:
    gaps: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:
        for r in range(rounds):
            prompts = [[1] + [5 + (i * 7 + r * 13 + s) % 3000 for i in range(200)] for s in range(streams)]
            for g in await asyncio.gather(*[_stream(client, url, p, tokens) for p in prompts]):
                gaps += g
    gaps.sort()
    return gaps[len(gaps) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8077)
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/out/vllm_process_cpu.json)")
    args = p.parse_args()
    venv = peer_venv("vllm")
    if not (venv / "bin" / "python").exists():
        print(missing_peer("vllm", venv), file=sys.stderr)
        return 2
    if not (MODEL / "config.json").exists():
        print(
            f"vllm_process_cpu: error: no model at {MODEL} (tailserve model init --preset tiny)",
            file=sys.stderr,
        )
        return 2
    print(cpu_line())
    engine = Engine("vllm", str(venv / "bin" / "python"), MODEL, "tiny", "float32", 2048, 600)
    url = f"http://127.0.0.1:{args.port}"
    log = Path("benchmarks/out/vllm_process_cpu.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = start_server(engine.command(SETTINGS[0], args.port), engine.env("2"), url, 600, log)
    rows = []
    try:
        time.sleep(3)  # the worker processes are up once /health answers; their children too now
        pids = tree(proc.pid)
        names = {pid: label(pid) for pid in pids}
        asyncio.run(_phase(url, 1, 1))  # warm-up
        for streams, rounds in ((1, 6), (16, 3), (1, 6), (16, 3)):
            before, t0 = {pid: cpu_s(pid) for pid in pids}, time.perf_counter()
            itl = asyncio.run(_phase(url, streams, rounds))
            wall = time.perf_counter() - t0
            cores = {names[pid]: round((cpu_s(pid) - before[pid]) / wall, 3) for pid in pids}
            rows.append(
                {
                    "streams": streams,
                    "wall_s": round(wall, 2),
                    "median_itl_ms": round(itl * 1e3, 2),
                    "cores": cores,
                }
            )
            print(f"{streams:2d} streams: median ITL {itl * 1e3:5.1f} ms; cores busy: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in cores.items() if v >= 0.005), flush=True)  # fmt: skip
    finally:
        stop_server(proc)
    save_results({"benchmark": "vllm_process_cpu", "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows,
                  "load_average": os.getloadavg()}, args.out, "vllm_process_cpu.json")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
