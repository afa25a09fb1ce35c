"""How steady a weight-streaming step is on this CPU, by the size of the weights against the L3.

A decode step of the ``tiny`` model streams its 34 MB of bf16 weights once; this VM's L3 is
32 MB and, on a multi-tenant host, shared with cores this VM does not see. Here two stand-in
steps over buffers of each size — ``x @ W.T`` for one row over a bf16 ``W`` (gemv), and a copy
of ``W`` into another buffer (copy: the memory system alone) — repeated back to back for a few
seconds on one thread, are timed on the thread's CPU clock, call by call. Per size: the median time, the
effective bandwidth, the spread between consecutive calls (median |t_i / t_(i-1) - 1|: what
noise alone does), the spread of 25-call medians about the overall median (what a drift of the
machine does: the unit of one of ``fidelity_cpu_instances.py``'s probes), and the lag-1
autocorrelation of the per-call times.

    OMP_NUM_THREADS=1 python benchmarks/fidelity_cpu_l3.py [--sizes-mb 4,16,34,64,256] [--seconds 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np


def series(mb: float, seconds: float, kind: str = "gemv") -> np.ndarray:
    """Per-call thread CPU seconds of one step over ``mb`` MB: ``gemv`` (one row times a bf16
    weight matrix) or ``copy`` (a buffer copied into another: bound by the memory system alone)."""
    import torch

    k = 512  # the tiny model's hidden size: one row of K inputs, N outputs
    n = max(1, round(mb * 2**20 / (2 * k)))
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(1, k).to(torch.bfloat16)
    dst = torch.empty_like(w)
    step = (lambda: x @ w.T) if kind == "gemv" else (lambda: dst.copy_(w))
    for _ in range(3):
        step()
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.thread_time()
        step()
        out.append(time.thread_time() - t)
    return np.array(out)


def describe(t: np.ndarray, mb: float, kind: str, block: int = 25) -> dict:
    step = np.abs(t[1:] / t[:-1] - 1.0)
    blocks = np.array([np.median(t[i : i + block]) for i in range(0, len(t) - block + 1, block)])
    lag = np.log(t) - np.log(t).mean()
    return {
        "kind": kind,
        "mb": mb,
        "calls": len(t),
        "median_ms": float(np.median(t) * 1e3),
        "gb_per_s": float(mb * 2**20 * (2 if kind == "copy" else 1) / np.median(t) / 1e9),
        "call_to_call": float(np.median(step)),
        "block_spread": float(np.median(np.abs(blocks / np.median(t) - 1.0))),
        "block_range": [float(blocks.min() / np.median(t)), float(blocks.max() / np.median(t))],
        "lag1": float(np.sum(lag[:-1] * lag[1:]) / np.sum(lag * lag)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="4,16,34,64,256")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--kinds", default="gemv,copy", help="gemv, copy (comma-separated)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    try:
        sizes = [float(x) for x in args.sizes_mb.split(",") if x]
    except ValueError:
        ap.error(f"--sizes-mb {args.sizes_mb!r}: comma-separated numbers expected")
    if not sizes or min(sizes) <= 0:
        ap.error("--sizes-mb: at least one size > 0")
    import torch

    torch.set_num_threads(1)
    up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - {"gemv", "copy"}:
        ap.error(f"--kinds {args.kinds!r}: gemv and/or copy")
    rows = [describe(series(mb, args.seconds, kind), mb, kind) for kind in kinds for mb in sizes]
    up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"{'kind':>5} {'MB':>6} {'calls':>6} {'ms':>7} {'GB/s':>6} {'call-to-call':>12} {'25-call medians':>16} {'range':>12} {'lag-1':>6}"
    )
    for r in rows:
        lo, hi = r["block_range"]
        print(
            f"{r['kind']:>5} {r['mb']:6g} {r['calls']:6d} {r['median_ms']:7.3f} {r['gb_per_s']:6.1f} {r['call_to_call']:12.1%} "
            f"{r['block_spread']:16.1%} {lo:5.2f}-{hi:4.2f} {r['lag1']:6.2f}"
        )
    print(f"uptime before: {up0}\nuptime after: {up1}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "uptime_before": up0, "uptime_after": up1}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
