"""The hashed block pool of an earlier commit and the current one, side by side in one process.

Loads ``kv/block_pool.py``, ``kv/block_index.py`` and the Mooncake key function of
``kv/prefix.py`` of ``--before`` (default e2e8cca: one index entry per block, every key chained
in Python; 49edcd9^ is the pool before batching) from git next to today's (Mooncake keys indexed
per trace block, kv/trace_block_index.py, and mixed from one chained key per trace block) and
runs the same cluster
(Mooncake conversation trace, Llama-3.1-8B on H100, vLLM V1 on every replica) with each,
alternating, printing each run's CPU seconds and the figures that must agree; exits 1 when they
differ.

    python benchmarks/block_pool_ab.py [--replicas 16] [--router round-robin] [--max-requests N]
        [--reps 1] [--before COMMIT] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from _paths import check_trace, default_trace

import tailserve.cluster.cluster as cluster
import tailserve.core.scheduler as scheduler
import tailserve.kv.hashed as hashed
from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.cluster import run_aggregated
from tailserve.cluster.metrics import cluster_summary
from tailserve.cluster.spec import replicated
from tailserve.policies.registry import PolicySpec
from tailserve.sim.deployment import Deployment
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

BEFORE = "e2e8cca"  # the start of the session that indexed Mooncake keys per trace block


def previous_kv(commit: str) -> tuple[type, Callable]:
    """That commit's hashed block pool and its Mooncake key function."""
    repo = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp())

    def load(name: str, rewrite: tuple[str, str] | None = None):
        source = subprocess.run(
            ["git", "show", f"{commit}:src/tailserve/kv/{name}.py"],
            cwd=repo,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        if rewrite is not None:
            source = source.replace(*rewrite)
        path = folder / f"{name}_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"{name}_before", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"{name}_before"] = module
        spec.loader.exec_module(module)
        return module

    has_index = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}:src/tailserve/kv/block_index.py"], cwd=repo, capture_output=True
    )
    rewrite = None
    if has_index.returncode == 0:  # that commit's own key index, not today's
        load("block_index")
        rewrite = ("from tailserve.kv.block_index import", "from block_index_before import")
    module = load("block_pool", rewrite)
    keys_fn = load("prefix").keys_from_hash_ids

    class Before(module.HashedBlockPool):  # the calls today's manager makes, in that pool's terms
        def num_unreferenced(self, block_ids):
            return sum(1 for b in block_ids if self._ref_counts[b] == 0)

        def cache_full_blocks(self, block_ids, block_keys, parent_key=None, start=0):
            keys = list(block_keys[start : start + len(block_ids)])
            try:
                return super().cache_full_blocks(block_ids, keys, parent_key)
            except TypeError:  # before 49edcd9: no parent key
                return super().cache_full_blocks(block_ids, keys)

    if hasattr(module.HashedBlockPool, "num_unreferenced"):
        del Before.num_unreferenced
    return Before, keys_fn


def use(pool: type, keys_fn: Callable) -> None:
    """Make the cluster's engines use this pool and these Mooncake keys (router and scheduler)."""
    hashed.HashedBlockPool = pool
    scheduler.keys_from_hash_ids = keys_fn
    cluster.keys_from_hash_ids = keys_fn


def digest(run) -> str:
    """Every request's outcome, as clients and the prefix cache saw it: equal digests mean the
    two pools made the same decisions (hits, evictions, hence every token time)."""
    h = hashlib.sha256()
    for r in run.requests:
        h.update(
            repr(
                (r.request_id, r.num_cached_tokens, r.num_preemptions, r.token_times, r.finish_time)
            ).encode()
        )
    for replica in run.replicas:
        stats = replica.engine.scheduler.kv_cache.prefix_cache_stats
        h.update(
            repr(
                (stats.num_lookups, stats.num_query_tokens, stats.num_hit_tokens, stats.num_evicted_tokens)
            ).encode()
        )
    return h.hexdigest()


def cpu_flags() -> str:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return "unknown"
    have = set(flags.split(":", 1)[1].split())
    return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in have) or "none"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(default_trace("mooncake_conversation.jsonl")))
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument(
        "--before", default=BEFORE, help=f"commit whose pool runs beside today's (default {BEFORE})"
    )
    ap.add_argument("--out", default=None, help="write the runs as JSON here")
    args = ap.parse_args()
    missing = check_trace(args.trace)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    wb = WorkloadBuilder(WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests))
    current = (hashed.HashedBlockPool, scheduler.keys_from_hash_ids)
    pools = {"before": previous_kv(args.before), "now": current}
    load_before = os.getloadavg()[0]
    flags = cpu_flags()
    print(
        f"load {load_before:.2f}; {args.replicas} replicas, {args.router}; before = {args.before}; cpu {flags}"
    )
    runs: list[dict] = []
    for rep in range(args.reps):
        for name, kv in pools.items():
            use(*kv)
            specs = replicated(
                args.replicas, Deployment.of("Llama-3.1-8B", "H100-SXM", 1), PolicySpec.make("vllm", {})
            )
            stage = build_stage(specs, args.router, shares_prefixes=True, scrape_interval=0.05)
            run = run_aggregated(stage, workload_requests(wb, specs))
            s = cluster_summary(run)
            row = {
                "pool": name,
                "rep": rep,
                "cpu_s": run.cpu_s,
                "wall_s": run.wall_s,
                "hit_rate_tokens": s["prefix_cache"]["hit_rate_tokens"],
                "ttft_p99_s": s["metrics"]["ttft_s"]["p99"],
                "itl_p99_s": s["metrics"]["itl_s"]["p99"],
                "digest": digest(run),
                "load": os.getloadavg()[0],
            }
            runs.append(row)
            print(
                f"{name:<7} cpu {run.cpu_s:6.2f} s  hit {row['hit_rate_tokens']:.6f}  TTFT p99 "
                f"{row['ttft_p99_s']:.6f} s  TBT p99 {row['itl_p99_s']:.6f} s  {row['digest'][:12]}  "
                f"load {row['load']:.2f}",
                flush=True,
            )
    use(*current)
    same = len({r["digest"] for r in runs}) == 1
    best = {name: min(r["cpu_s"] for r in runs if r["pool"] == name) for name in pools}
    print(
        f"min cpu: before {best['before']:.2f} s, now {best['now']:.2f} s ({best['now'] / best['before']:.2f}x); "
        f"decisions {'identical' if same else 'DIFFER'}; load {os.getloadavg()[0]:.2f}"
    )
    if args.out:
        info = {"replicas": args.replicas, "router": args.router, "max_requests": args.max_requests}
        info |= {"before": args.before, "cpu_flags": flags, "load_before": load_before}
        Path(args.out).write_text(
            json.dumps({"config": info, "runs": runs, "identical": same}, indent=1) + "\n"
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
