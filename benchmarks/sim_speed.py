"""How fast does the simulator run a real trace? Exact fast path vs plain stepping, one process.

Simulates the whole Azure LLM inference 2023 conversation trace (19,366 requests) with the
``vllm`` policy on Llama-3-8B / H100-SXM, twice: with the exact decode fast path (the default)
and stepping every iteration. Prints and saves wall seconds, simulated requests and iterations
per wall second, their ratio, and whether the two runs produced the same results.

Reference (``shared/reference/simulators.md``): Vidur simulates ~700-1,500 requests and
~4,000-8,500 iterations per wall second on this machine class.

    python benchmarks/sim_speed.py [--trace PATH] [--max-requests N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from _paths import check_trace, default_out, default_trace

from tailserve.core.engine import EngineOptions
from tailserve.policies.registry import parse_policy_list
from tailserve.simulation import Deployment, WorkloadBuilder, WorkloadSpec, build_cost_model, run_policy

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = default_trace("azure_llm_2023_conv.csv")
VIDUR_REQUESTS_PER_S = (700, 1500)
VIDUR_ITERATIONS_PER_S = (4000, 8500)


def one_run(built, workload: WorkloadBuilder, fast: bool) -> dict:
    t0 = time.perf_counter()
    run = run_policy(built, parse_policy_list("vllm")[0], workload, options=EngineOptions(fast_forward=fast))
    summary = run.summary()
    wall = time.perf_counter() - t0  # simulation + metrics, the whole job after loading
    return {
        "mode": "fast path" if fast else "step by step",
        "wall_s": wall,
        "simulate_s": run.wall_s,
        "requests": summary["num_requests"],
        "iterations": summary["num_iterations"],
        "requests_per_wall_s": summary["num_requests"] / wall,
        "iterations_per_wall_s": summary["num_iterations"] / wall,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/out/sim_speed.json, git-ignored)"
    )
    args = parser.parse_args()
    args.out = args.out or str(default_out("sim_speed.json"))
    if (problem := check_trace(args.trace)) is not None:
        raise SystemExit(f"sim_speed: error: {problem}")

    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    spec = WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests)
    workload = WorkloadBuilder(spec)
    t0 = time.perf_counter()
    workload.build(built.cost_model)  # parse the trace once, outside the timed runs
    load_s = time.perf_counter() - t0

    fast = one_run(built, workload, fast=True)
    slow = one_run(built, workload, fast=False)
    identical = json.dumps(fast["summary"], sort_keys=True) == json.dumps(slow["summary"], sort_keys=True)
    result = {
        "trace": Path(args.trace).name,
        "deployment": "Llama-3-8B / H100-SXM / TP 1, policy vllm (defaults: budget 8192, max_num_seqs 1024)",
        "trace_load_s": load_s,
        "runs": [{k: v for k, v in r.items() if k != "summary"} for r in (fast, slow)],
        "speedup_fast_vs_step": slow["wall_s"] / fast["wall_s"],
        "identical_results": identical,
        "vs_vidur_requests_per_s": [fast["requests_per_wall_s"] / v for v in VIDUR_REQUESTS_PER_S],
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "metrics": {k: fast["summary"]["metrics"][k] for k in ("ttft_s", "itl_s")},
    }
    print(
        f"trace {result['trace']}: {fast['requests']} requests, {fast['iterations']:,} iterations (load {load_s:.2f} s)"
    )
    for r in (fast, slow):
        print(
            f"  {r['mode']:>12}: {r['wall_s']:6.2f} s wall, {r['requests_per_wall_s']:8,.0f} requests/s, "
            f"{r['iterations_per_wall_s']:9,.0f} iterations/s"
        )
    lo, hi = result["vs_vidur_requests_per_s"]
    print(
        f"  fast path is {result['speedup_fast_vs_step']:.1f}x plain stepping; results identical: {identical}"
    )
    print(f"  vs Vidur's 700-1,500 requests/s: {hi:.1f}x-{lo:.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
