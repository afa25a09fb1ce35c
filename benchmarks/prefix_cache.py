"""Prefix caching on the Mooncake conversation trace, with and without it, one process.

vLLM V1 (hashed blocks) with and without prefix caching; SGLang (radix tree) under fcfs, lpm, lpm
with aging, and with the radix cache disabled.

Llama-3.1-8B (128K context) on one H100, the first N requests of the trace, time-scaled.
Prints and saves the prefix-cache hit rate (tokens and requests), prefill tokens saved, evicted
tokens, TTFT p50/p99 (all, hit, miss) and output throughput for each run.

    python benchmarks/prefix_cache.py [--trace PATH] [--max-requests N] [--rate-scale X]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _paths import check_trace, default_out, default_trace

from tailserve.policies.registry import parse_policy_list
from tailserve.sim.deployment import Deployment, build_cost_model
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = default_trace("mooncake_conversation.jsonl")
POLICIES = (
    "vllm,vllm:enable_prefix_caching=false,sglang,sglang:schedule_policy=lpm,"
    "sglang:schedule_policy=lpm:lpm_aging_rate=1000,sglang:disable_radix_cache=true"
)


STARVATION = "sglang,sglang:schedule_policy=lpm,sglang:schedule_policy=lpm:lpm_aging_rate=2000"


def starvation_case() -> list[dict]:
    """LPM starves cache-cold requests (SGLang #31954) and aging fixes it: 96% of requests share
    one 2,048-token system prompt, 4% are cold; Llama-3-8B on an L4 with a queue building up."""
    built = build_cost_model(Deployment("Llama-3-8B", "L4", 1, "none"))
    workload = WorkloadBuilder(
        WorkloadSpec(
            "shared-prefix", num_requests=400, rate=3.0, num_prefixes=1, prefix_len=2048, shared_fraction=0.96
        )
    )
    rows = []
    print("starvation: shared-prefix, 96% hot (one 2,048-token prompt), 4% cold; Llama-3-8B / L4, 3 req/s")
    for spec in parse_policy_list(STARVATION):
        s = run_policy(built, spec, workload).summary()
        pc = s["prefix_cache"]
        row = {
            "label": spec.label,
            "hit_rate_tokens": pc["hit_rate_tokens"],
            "ttft_hot_p50_s": pc["ttft_s"]["hit"]["p50"],
            "ttft_cold_p50_s": pc["ttft_s"]["miss"]["p50"],
            "ttft_cold_max_s": pc["ttft_s"]["miss"]["max"],
            "ttft_p99_s": s["metrics"]["ttft_s"]["p99"],
        }
        rows.append(row)
        print(
            f"  {row['label']:<58} TTFT p50 hot {row['ttft_hot_p50_s']:6.1f} s, cold {row['ttft_cold_p50_s']:6.1f} s "
            f"(max {row['ttft_cold_max_s']:6.1f} s), all p99 {row['ttft_p99_s']:6.1f} s"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--rate-scale", type=float, default=0.25)
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/out/prefix_cache.json, git-ignored)"
    )
    args = parser.parse_args()
    args.out = args.out or str(default_out("prefix_cache.json"))
    if (problem := check_trace(args.trace)) is not None:
        raise SystemExit(f"prefix_cache: error: {problem}")

    built = build_cost_model(Deployment("Llama-3.1-8B", "H100-SXM", 1, "none"))
    workload = WorkloadBuilder(
        WorkloadSpec(
            "trace", trace_path=args.trace, max_requests=args.max_requests, rate_scale=args.rate_scale
        )
    )
    rows = []
    for spec in parse_policy_list(POLICIES):
        run = run_policy(built, spec, workload)
        s = run.summary()
        pc = s.get("prefix_cache")
        rows.append(
            {
                "label": run.label,
                "prefix_caching": run.config["prefix_caching"],
                "ttft_mean_s": s["metrics"]["ttft_s"]["mean"],
                "hit_rate_tokens": pc["hit_rate_tokens"] if pc else 0.0,
                "hit_rate_requests": pc["hit_rate_requests"] if pc else 0.0,
                "prefill_tokens_saved": pc["prefill_tokens_saved"] if pc else 0,
                "evicted_tokens": pc["evicted_tokens"] if pc else 0,
                "ttft_p50_s": s["metrics"]["ttft_s"]["p50"],
                "ttft_p99_s": s["metrics"]["ttft_s"]["p99"],
                "ttft_hit_p50_s": pc["ttft_s"]["hit"]["p50"] if pc else None,
                "ttft_miss_p50_s": pc["ttft_s"]["miss"]["p50"] if pc else None,
                "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
                "num_kv_blocks": run.config["num_kv_blocks"],
                "wall_s": run.wall_s,
            }
        )
    print(
        f"Mooncake conversation trace, first {args.max_requests} requests, rate x{args.rate_scale:g}; Llama-3.1-8B / H100"
    )
    for r in rows:
        print(
            f"  {r['label']:<58} hit {r['hit_rate_tokens'] * 100:5.1f}% tokens "
            f"({r['hit_rate_requests'] * 100:5.1f}% requests), saved {r['prefill_tokens_saved']:>10,} tokens, "
            f"TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.2f} s, {r['output_tokens_per_s']:.0f} tok/s"
        )
    starvation = starvation_case()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"trace": Path(args.trace).name, "runs": rows, "starvation": starvation}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
