"""The hashed block pool before and after batching (commit 49edcd9), side by side in one process.

Loads the previous ``kv/block_pool.py`` from git next to the current one and runs the same
cluster (Mooncake conversation trace, Llama-3.1-8B on H100, vLLM V1 on every replica) with
each, alternating, printing each run's CPU seconds and the figures that must agree.

    python benchmarks/block_pool_ab.py [--replicas 16] [--router round-robin] [--max-requests N] [--reps 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _paths import check_trace, default_trace

import tailserve.kv.hashed as hashed
from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.cluster import run_aggregated
from tailserve.cluster.metrics import cluster_summary
from tailserve.cluster.spec import replicated
from tailserve.policies.registry import PolicySpec
from tailserve.sim.deployment import Deployment
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

BEFORE = "49edcd9^"  # the commit before the batched pool


def previous_pool() -> type:
    repo = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{BEFORE}:src/tailserve/kv/block_pool.py"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "block_pool_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("block_pool_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Before(module.HashedBlockPool):  # the two calls the manager makes that it lacked
        def num_unreferenced(self, block_ids):
            return sum(1 for b in block_ids if self._ref_counts[b] == 0)

        def cache_full_blocks(self, block_ids, block_keys, parent_key=None):
            return super().cache_full_blocks(block_ids, block_keys)

    return Before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(default_trace("mooncake_conversation.jsonl")))
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    missing = check_trace(args.trace)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    wb = WorkloadBuilder(WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests))
    pools = {"before": previous_pool(), "batched": hashed.HashedBlockPool}
    print(f"load {os.getloadavg()[0]:.2f}; {args.replicas} replicas, {args.router}")
    for _ in range(args.reps):
        for name, cls in pools.items():
            hashed.HashedBlockPool = cls
            specs = replicated(
                args.replicas, Deployment.of("Llama-3.1-8B", "H100-SXM", 1), PolicySpec.make("vllm", {})
            )
            stage = build_stage(specs, args.router, shares_prefixes=True, scrape_interval=0.05)
            run = run_aggregated(stage, workload_requests(wb, specs))
            s = cluster_summary(run)
            print(
                f"{name:<8} cpu {run.cpu_s:6.2f} s  hit {s['prefix_cache']['hit_rate_tokens']:.6f}  "
                f"TTFT p99 {s['metrics']['ttft_s']['p99']:.6f} s  TBT p99 {s['metrics']['itl_s']['p99']:.6f} s",
                flush=True,
            )
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
