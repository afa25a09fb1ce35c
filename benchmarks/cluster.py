"""Replicas, routers and P/D on the Mooncake conversation trace at its own rate.

Llama-3.1-8B on H100-SXM (TP 1), vLLM V1 with prefix caching on every replica, the whole trace
(12,031 requests over 59 min) unless --max-requests. Part 1: 1, 4, 8 and 16 replicas under each
router (one router at 1 replica: they all pick it). Part 2: P/D against aggregated replicas at
equal GPU count. Each row: prefix hit rate (tokens), TTFT p50/p99, TBT (ITL) p99, output
throughput, simulation wall time. Scrapes every 50 ms (the routers' view of load).

    python -m benchmarks.cluster [--trace PATH] [--max-requests N] [--replicas 1,4,8,16]
        [--routers round-robin,...] [--parts routers,pd,saturated,capacity] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks._common import check_trace, cpu_line, default_out, default_trace, simd_flags
from tailserve.cluster import ROUTERS
from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.cluster import ClusterRun, run_aggregated
from tailserve.cluster.disagg import make_pd_cluster
from tailserve.cluster.metrics import cluster_summary
from tailserve.cluster.spec import replicated
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

MODEL, GPU = "Llama-3.1-8B", "H100-SXM"
SCRAPE_INTERVAL = 0.05  # seconds
PD_SPLITS = ((8, ((4, 4), (6, 2))), (16, ((8, 8), (12, 4))))  # GPUs: (prefill, decode) splits
PD_ROUTERS = ("round-robin", "prefix-aware")  # aggregated baselines and the prefill side's router
# Part 3, SGLang's setting for its cache-aware router claim: many long shared prefixes, more of
# them than one replica's KV holds (64 x 2,048 tokens vs ~57,000 tokens of KV at 30% memory),
# offered faster than 8 replicas serve, so throughput is capacity.
SATURATED = {
    "num_requests": 1500,
    "rate": 200.0,
    "num_prefixes": 64,
    "prefix_len": 2048,
    "shared_fraction": 1.0,
}
SATURATED_FLAGS = {"gpu_memory_utilization": "0.3", "max_model_len": "16384"}
SATURATED_ROUTERS = ("round-robin", "random", "least-requests", "prefix-aware", "kv-aware")
# Part 4, capacity planning: 4 H100s, every layout, the first 1,000 requests of the trace.
PLAN = {"gpus": 4, "max_requests": 1000, "slo": "ttft_p99=8s,tbt_p99=100ms", "rel_tol": 0.2}


def row(label: str, run: ClusterRun, **extra: object) -> dict:
    s = cluster_summary(run)
    m = s["metrics"]
    out = {
        "label": label,
        **extra,
        "num_finished": s["num_finished"],
        "num_requests": s["num_requests"],
        "prefix_hit_rate_tokens": s["prefix_cache"]["hit_rate_tokens"],
        "ttft_p50_s": m["ttft_s"]["p50"],
        "ttft_p99_s": m["ttft_s"]["p99"],
        "tbt_p99_s": m["itl_s"]["p99"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "num_preemptions": s["num_preemptions"],
        "wall_s": run.wall_s,
        "cpu_s": run.cpu_s,
    }
    if "kv_transfer_s" in s:  # from when the KV could move (vLLM's pair: the decode side admitted it)
        out["kv_transfer_p50_s"] = s["kv_transfer_s"]["p50"]
    if "decode_admission_wait_s" in s:  # vLLM's pair: the prompt's KV waiting to be read
        out["decode_admission_wait_p50_s"] = s["decode_admission_wait_s"]["p50"]
        out["decode_admission_wait_p99_s"] = s["decode_admission_wait_s"]["p99"]
    print(
        f"{label:<34} hit {out['prefix_hit_rate_tokens']:6.1%}  TTFT p50 {out['ttft_p50_s']:8.3f} s  "
        f"p99 {out['ttft_p99_s']:8.3f} s  TBT p99 {out['tbt_p99_s'] * 1000:7.1f} ms  "
        f"{out['output_tokens_per_s']:7.0f} tok/s  wall {run.wall_s:6.2f} s (cpu {run.cpu_s:6.2f} s)",
        flush=True,
    )
    return out


def aggregated(wb: WorkloadBuilder, n: int, router: str) -> ClusterRun:
    specs = replicated(n, Deployment.of(MODEL, GPU, 1), PolicySpec.make("vllm", {}))
    stage = build_stage(specs, router, shares_prefixes=True, scrape_interval=SCRAPE_INTERVAL)
    return run_aggregated(stage, workload_requests(wb, specs))


def saturated(router: str, n: int = 8) -> ClusterRun:
    wb = WorkloadBuilder(WorkloadSpec("shared-prefix", **SATURATED))
    specs = replicated(n, Deployment.of(MODEL, GPU, 1), PolicySpec.make("vllm", SATURATED_FLAGS))
    stage = build_stage(specs, router, shares_prefixes=True, scrape_interval=SCRAPE_INTERVAL)
    return run_aggregated(stage, workload_requests(wb, specs))


def disaggregated(wb: WorkloadBuilder, p: int, d: int, router: str, link: str) -> ClusterRun:
    deployment = Deployment.of(MODEL, GPU, 1)
    prefill_specs = replicated(p, deployment, PolicySpec.make("vllm", {}))
    decode_specs = replicated(d, deployment, PolicySpec.make("vllm", {}))
    prefill = build_stage(
        prefill_specs,
        router,
        shares_prefixes=True,
        scrape_interval=SCRAPE_INTERVAL,
        name_prefix="p",
        pd_pair=True,
    )
    decode = build_stage(
        decode_specs,
        "least-kv",
        shares_prefixes=True,
        scrape_interval=SCRAPE_INTERVAL,
        name_prefix="d",
        pd_pair=True,
    )
    return make_pd_cluster(prefill, decode, link).run(workload_requests(wb, prefill_specs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(default_trace("mooncake_conversation.jsonl")))
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--replicas", default="1,4,8,16")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--link", default="ib-ndr")
    ap.add_argument("--parts", default="routers,pd,saturated,capacity", help="which parts to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    missing = check_trace(args.trace)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    wb = WorkloadBuilder(WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests))
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    started = time.time()
    results: dict = {
        "benchmark": "cluster",
        "model": MODEL,
        "hardware": GPU,
        "policy": "vllm (V1, prefix caching)",
        "trace": Path(args.trace).name,
        "max_requests": args.max_requests,
        "scrape_interval_s": SCRAPE_INTERVAL,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_before": os.getloadavg()},
        "routers": [],
        "pd": [],
    }
    parts = set(args.parts.split(","))
    results["saturated"] = []
    if "routers" in parts:
        print("part 1: replicas x routers")
    for n in (int(x) for x in args.replicas.split(",")) if "routers" in parts else ():
        for router in routers if n > 1 else routers[:1]:
            results["routers"].append(
                row(f"{n} x {GPU}, {router}", aggregated(wb, n, router), replicas=n, router=router)
            )
    if "pd" in parts:
        print(f"part 2: P/D vs aggregated at equal GPU count (KV over {args.link})")
        for gpus, splits in PD_SPLITS:
            for router in PD_ROUTERS:
                done = [r for r in results["routers"] if r["replicas"] == gpus and r["router"] == router]
                base = (
                    done[0]
                    if done
                    else row(
                        f"{gpus} aggregated, {router}",
                        aggregated(wb, gpus, router),
                        replicas=gpus,
                        router=router,
                    )
                )
                results["pd"].append({**base, "mode": "aggregated", "gpus": gpus})
                for p, d in splits:
                    run = disaggregated(wb, p, d, router, args.link)
                    label = f"{p}P+{d}D, prefill {router}"
                    results["pd"].append(
                        row(
                            label,
                            run,
                            mode="pd",
                            gpus=gpus,
                            prefill=p,
                            decode=d,
                            router=router,
                            link=args.link,
                        )
                    )
    if "saturated" in parts:
        print("part 3: 8 replicas, 64 shared 2,048-token prefixes, 1,500 requests offered at 200/s")
        for router in SATURATED_ROUTERS:
            run = saturated(router)
            results["saturated"].append(
                row(
                    f"8 x {GPU}, {router}",
                    run,
                    router=router,
                    requests_per_s=cluster_summary(run)["throughput"]["requests_per_s"],
                )
            )
    if "capacity" in parts:
        from tailserve.tune.capacity import parse_capacity_slo
        from tailserve.tune.cluster_plan import plan

        print(f"part 4: capacity of every layout of {PLAN['gpus']} GPUs, {PLAN['slo']}")
        spec = WorkloadSpec("trace", trace_path=args.trace, max_requests=PLAN["max_requests"])
        rows = plan(
            PLAN["gpus"],
            Deployment.of(MODEL, GPU, 1),
            PolicySpec.make("vllm", {}),
            spec,
            parse_capacity_slo(PLAN["slo"]),
            router="prefix-aware",
            link=args.link,
            rel_tol=PLAN["rel_tol"],
        )
        results["capacity"] = {
            "setting": PLAN,
            "layouts": [
                {"layout": r.layout.label, "requests_per_s": r.rate, "fails_at": r.upper} for r in rows
            ],
        }
        for r in rows:
            print(f"{r.layout.label:<24} meets the SLO up to {r.rate:.2f} req/s (misses at {r.upper})")
    results["host"]["load_after"] = os.getloadavg()
    results["elapsed_s"] = time.time() - started
    out = Path(args.out) if args.out else default_out("cluster.json")
    print(cpu_line())
    out.write_text(json.dumps({**results, "cpu_flags": simd_flags()}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
