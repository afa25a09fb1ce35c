"""Every engine's policy on the same deployment and traffic, side by side, in one process.

Llama-3-70B / A100-80GB / TP 4 (the seed essay's deployment, ``--calibration auto`` = seed),
three workloads:
  1. ``hol``: ten decoding requests, then one 8,192-token prompt (the essay's example);
  2. the Azure LLM inference 2023 conversation trace (first N requests);
  3. memory pressure: the same trace at a higher rate with a small KV pool
     (``gpu_memory_utilization`` lowered), vLLM V0 with swap vs recompute preemption.
Prints one table per workload (TTFT p50/p99, TBT p99 and max, output tokens/s, preemptions)
and saves everything as JSON.

    python benchmarks/policy_matrix.py [--trace PATH] [--max-requests N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _paths import check_trace, default_out, default_trace

from tailserve.policies.registry import parse_policy_list
from tailserve.sim.deployment import Deployment, build_cost_model
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = default_trace("azure_llm_2023_conv.csv")

POLICIES = (
    "static,orca,vllm-v0,vllm-v0:enable_chunked_prefill=true,vllm,vllm:max_num_batched_tokens=8192,"
    "sarathi,sglang,sglang:enable_mixed_chunk=true,tgi,tgi:prefill_chunking=false"
)
PRESSURE = (
    "vllm-v0:preemption_mode=recompute:gpu_memory_utilization={u},"
    "vllm-v0:preemption_mode=swap:gpu_memory_utilization={u},"
    "vllm:gpu_memory_utilization={u},sglang:gpu_memory_utilization={u},tgi:gpu_memory_utilization={u}"
)


def _row(label: str, s: dict, wall: float) -> dict:
    m = s["metrics"]
    return {
        "label": label,
        "ttft_p50_ms": _ms(m["ttft_s"]["p50"]),
        "ttft_p99_ms": _ms(m["ttft_s"]["p99"]),
        "tbt_p99_ms": _ms(m["itl_s"]["p99"]),
        "tbt_max_ms": _ms(m["itl_s"]["max"]),
        "output_tokens_per_s": round(s["throughput"]["output_tokens_per_s"], 1),
        "preemptions": s["num_preemptions"],
        "finished": s["num_finished"],
        "rejected": s["num_rejected"],
        "aborted": s["num_aborted"],
        "sim_wall_s": round(wall, 2),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 1)


def run_matrix(title: str, built, policies: str, workload: WorkloadSpec) -> list[dict]:
    builder = WorkloadBuilder(workload)
    rows = []
    for spec in parse_policy_list(policies):
        t0 = time.perf_counter()
        run = run_policy(built, spec, builder)
        rows.append(_row(run.label, run.summary(), time.perf_counter() - t0))
    print(f"\n{title}")
    header = (
        f"{'policy':<58}{'TTFT p50':>10}{'TTFT p99':>11}{'TBT p99':>9}{'TBT max':>9}{'tok/s':>8}"
        f"{'preempt':>8}{'done':>6}{'rej':>5}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['label']:<58}{_fmt(r['ttft_p50_ms']):>10}{_fmt(r['ttft_p99_ms']):>11}{_fmt(r['tbt_p99_ms']):>9}"
            f"{_fmt(r['tbt_max_ms']):>9}{r['output_tokens_per_s']:>8.0f}{r['preemptions']:>8}{r['finished']:>6}"
            f"{r['rejected'] + r['aborted']:>5}"
        )
    return rows


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--pressure-rate-scale", type=float, default=2.0)
    parser.add_argument(
        "--pressure-memory", type=float, default=0.5, help="gpu_memory_utilization under pressure"
    )
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/out/policy_matrix.json, git-ignored)"
    )
    args = parser.parse_args()
    args.out = args.out or str(default_out("policy_matrix.json"))
    if (problem := check_trace(args.trace)) is not None:
        raise SystemExit(f"policy_matrix: error: {problem}")

    built = build_cost_model(Deployment())
    print(f"Llama-3-70B / A100-80GB / TP 4, calibration {built.calibration}")
    result = {
        "deployment": "Llama-3-70B / A100-80GB / TP 4",
        "calibration": built.calibration,
        "hol": run_matrix(
            "hol (10 decoding requests + one 8,192-token prompt)", built, POLICIES, WorkloadSpec("hol")
        ),
        "azure": run_matrix(
            f"Azure conversation trace, first {args.max_requests} requests",
            built,
            POLICIES,
            WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests),
        ),
        "pressure": run_matrix(
            f"memory pressure: Azure trace x{args.pressure_rate_scale:g} rate, gpu_memory_utilization "
            f"{args.pressure_memory}",
            built,
            PRESSURE.format(u=args.pressure_memory),
            WorkloadSpec(
                "trace",
                trace_path=args.trace,
                max_requests=args.max_requests,
                rate_scale=args.pressure_rate_scale,
            ),
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
