"""Every engine's policy side by side in the simulator, one part per question (``--parts``).

- ``hol``, ``azure``, ``pressure``: Llama-3-70B / A100-80GB / TP 4 (the seed essay's deployment,
  ``--calibration auto`` = seed): ``hol`` is ten decoding requests, then one 8,192-token prompt
  (the essay's example); ``azure`` the Azure LLM inference 2023 conversation trace (first
  ``--max-requests``); ``pressure`` the same trace at a higher rate with a small KV pool
  (``gpu_memory_utilization`` lowered), vLLM V0 with swap vs recompute preemption. One table per
  workload: TTFT p50/p99, TBT p99 and max, output tokens/s, preemptions.
- ``prefix``: prefix caching on the Mooncake conversation trace (``--prefix-trace``), Llama-3.1-8B
  (128K context) on one H100, the first ``--prefix-max-requests`` requests, time-scaled: vLLM V1
  (hashed blocks) with and without prefix caching; SGLang (radix tree) under fcfs, lpm, lpm with
  aging, and with the radix cache disabled. Hit rate (tokens and requests), prefill tokens saved,
  evicted tokens, TTFT p50/p99 (all, hit, miss), output throughput. Then LPM's starvation of
  cache-cold requests (SGLang #31954) and aging's fix.
- ``anyscale``: Anyscale's continuous-batching benchmark (June 2023). The claim: on a
  production-like workload, continuous batching gives ~8x and continuous batching with
  PagedAttention (vLLM) ~23x the throughput of static batching. Their setup, as published
  (docs/experiments.md quotes the sources): 1,000 prompts of 512 input tokens, each with a
  predetermined output length drawn from an exponential distribution and capped (32, 128, 512,
  1,536 tokens: the cap sets the length variance), EOS ignored, all submitted at once; OPT-13B on
  one A100 40 GB. Here ``static`` (batch size swept, best kept), ``orca:reserve_tokens=2048``
  (continuous batching with one contiguous max-length buffer per request, like servers before
  paged KV) and ``vllm`` (paged KV, V1's defaults for the A100).

Prints every table and saves everything as JSON, with the ratios (continuous batching / static)
side by side.

    python -m benchmarks.policy_matrix [--parts hol,azure,pressure,prefix,anyscale]
        [--trace PATH] [--max-requests N] [--prefix-trace PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks._common import check_trace, cpu_line, default_trace, save_results
from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.request import Request
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.metrics.summary import summarize
from tailserve.policies.registry import PolicySpec, parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

DEFAULT_TRACE = default_trace("azure_llm_2023_conv.csv")
PREFIX_TRACE = default_trace("mooncake_conversation.jsonl")
PARTS = ("hol", "azure", "pressure", "prefix", "anyscale")

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


PREFIX_POLICIES = (
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


def prefix_part(trace: str, max_requests: int, rate_scale: float) -> dict:
    """Prefix caching on the Mooncake conversation trace, with and without it, then starvation."""
    built = build_cost_model(Deployment("Llama-3.1-8B", "H100-SXM", 1, "none"))
    workload = WorkloadBuilder(
        WorkloadSpec("trace", trace_path=trace, max_requests=max_requests, rate_scale=rate_scale)
    )
    rows = []
    for spec in parse_policy_list(PREFIX_POLICIES):
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
        f"Mooncake conversation trace, first {max_requests} requests, rate x{rate_scale:g}; Llama-3.1-8B / H100"
    )
    for r in rows:
        print(
            f"  {r['label']:<58} hit {r['hit_rate_tokens'] * 100:5.1f}% tokens "
            f"({r['hit_rate_requests'] * 100:5.1f}% requests), saved {r['prefill_tokens_saved']:>10,} tokens, "
            f"TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.2f} s, {r['output_tokens_per_s']:.0f} tok/s"
        )
    return {"trace": Path(trace).name, "runs": rows, "starvation": starvation_case()}


CAPS = (32, 128, 512, 1536)
PROMPT = 512
MAX_LEN = 2048  # OPT-13B's context: 512 + 1,536
STATIC_BATCHES = (4, 8, 16, 32, 64)


def anyscale_requests(cap: int, mean: float, seed: int, n: int = 1000) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(f"r{i}", PROMPT, max(1, min(cap, round(rng.expovariate(1.0 / mean)))), 0.0) for i in range(n)
    ]


def anyscale_run(built, spec: PolicySpec, reqs: list[Request]) -> dict:
    # Bare lengths (no prefix sharing), no CPU swap pool: the paper's setup.
    options = BuildOptions(max_model_len=MAX_LEN, shares_prefixes=False, cpu_swap=False)
    assembled = build_engine(built, spec, "sim", options, source=ListSource(reqs))
    capacity = assembled.kv_size
    engine = assembled.engine
    engine.run()
    s = summarize(engine.requests)
    peak = max(engine.log.batch_size) if len(engine.log) else 0
    return {
        "output_tok_s": s["throughput"]["output_tokens_per_s"],
        "duration_s": s["duration_s"],
        "finished": s["num_finished"],
        "kv_tokens": capacity.num_tokens,
        "peak_batch": peak,
        "e2e_p50_s": s["metrics"]["e2e_s"]["p50"],
    }


def anyscale_part(mean: float, seed: int, hardware: str) -> dict:
    """Anyscale's continuous-batching benchmark: static, contiguous and paged continuous batching."""
    built = build_cost_model(Deployment("OPT-13B", hardware, 1, "none"))
    table = Table(
        title=f"OPT-13B on {hardware}: 1,000 x 512-token prompts, outputs ~Exp(mean {mean:g}) capped",
        title_justify="left",
    )
    for col in (
        "cap",
        "mean out",
        "static best (batch)",
        "cb contiguous",
        "vllm",
        "cb / static",
        "vllm / static",
        "peak batch s/c/v",
    ):
        table.add_column(col, justify="right")
    rows = []
    for cap in CAPS:
        reqs = functools.partial(anyscale_requests, cap, mean, seed)  # fresh requests per run
        mean_out = sum(r.max_tokens for r in reqs()) / 1000
        static = {}
        for b in STATIC_BATCHES:
            try:
                static[b] = anyscale_run(
                    built, parse_policy_list(f"static:batch_size={b},max_wait=0")[0], reqs()
                )
            except ValueError as e:
                static[b] = {"error": str(e)}
        ok = {b: r for b, r in static.items() if "error" not in r and r["finished"] == 1000}
        best_b = max(ok, key=lambda b: ok[b]["output_tok_s"])
        cb = anyscale_run(built, parse_policy_list(f"orca:reserve_tokens={MAX_LEN}")[0], reqs())
        vl = anyscale_run(built, parse_policy_list("vllm")[0], reqs())
        s = ok[best_b]["output_tok_s"]
        table.add_row(
            str(cap), f"{mean_out:.0f}", f"{s:,.0f} ({best_b})", f"{cb['output_tok_s']:,.0f}", f"{vl['output_tok_s']:,.0f}",
            f"{cb['output_tok_s'] / s:.1f}x", f"{vl['output_tok_s'] / s:.1f}x",
            f"{ok[best_b]['peak_batch']}/{cb['peak_batch']}/{vl['peak_batch']}",
        )  # fmt: skip
        rows.append(
            {
                "cap": cap,
                "mean_output": mean_out,
                "static": static,
                "static_best": best_b,
                "cb_contiguous": cb,
                "vllm": vl,
            }
        )
    Console(width=150).print(table)
    for row in rows:
        s = row["static"][row["static_best"]]["output_tok_s"]
        row["cb_contiguous_over_static"] = round(row["cb_contiguous"]["output_tok_s"] / s, 2)
        row["vllm_over_static"] = round(row["vllm"]["output_tok_s"] / s, 2)
    return {"mean": mean, "seed": seed, "hardware": hardware, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated, of: " + ", ".join(PARTS) + " (default: all)",
    )
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="the Azure trace (hol, azure, pressure)")
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--pressure-rate-scale", type=float, default=2.0)
    parser.add_argument(
        "--pressure-memory", type=float, default=0.5, help="gpu_memory_utilization under pressure"
    )
    parser.add_argument("--prefix-trace", default=str(PREFIX_TRACE), help="the Mooncake trace (prefix)")
    parser.add_argument("--prefix-max-requests", type=int, default=2000)
    parser.add_argument("--prefix-rate-scale", type=float, default=0.25)
    parser.add_argument(
        "--anyscale-mean", type=float, default=128.0, help="mean of the exponential before the cap"
    )
    parser.add_argument("--anyscale-seed", type=int, default=0)
    parser.add_argument("--anyscale-hardware", default="A100-40GB")
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/out/policy_matrix.json, git-ignored)"
    )
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if unknown := [p for p in parts if p not in PARTS]:
        raise SystemExit(
            f"policy_matrix: error: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}"
        )
    for needed, trace in ((("hol", "azure", "pressure"), args.trace), (("prefix",), args.prefix_trace)):
        if any(p in parts for p in needed) and (problem := check_trace(trace)) is not None:
            raise SystemExit(f"policy_matrix: error: {problem}")

    print(cpu_line())
    result: dict = {}
    if any(p in parts for p in ("hol", "azure", "pressure")):
        built = build_cost_model(Deployment())
        print(f"Llama-3-70B / A100-80GB / TP 4, calibration {built.calibration}")
        result.update(deployment="Llama-3-70B / A100-80GB / TP 4", calibration=built.calibration)
    if "hol" in parts:
        result["hol"] = run_matrix(
            "hol (10 decoding requests + one 8,192-token prompt)", built, POLICIES, WorkloadSpec("hol")
        )
    if "azure" in parts:
        result["azure"] = run_matrix(
            f"Azure conversation trace, first {args.max_requests} requests",
            built,
            POLICIES,
            WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests),
        )
    if "pressure" in parts:
        result["pressure"] = run_matrix(
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
        )
    if "prefix" in parts:
        print()
        result["prefix"] = prefix_part(args.prefix_trace, args.prefix_max_requests, args.prefix_rate_scale)
    if "anyscale" in parts:
        print()
        result["anyscale"] = anyscale_part(args.anyscale_mean, args.anyscale_seed, args.anyscale_hardware)
    save_results(result, args.out, "policy_matrix.json")


if __name__ == "__main__":
    main()
