"""One step of the dense MLPerf points, priced term by term (docs/fidelity.md, "The dense points'
step, decomposed (r39)"): the cost model's GEMMs, LM head, prefill and decode attention,
all-reduce and per-step overhead for the step shape the measured run implies, beside the step
time it implies.

    python -m benchmarks.step_terms [--aisim-tables ENGINE=FILE,...] [--json OUT]

``--aisim-tables`` prices every step's dense GEMMs and LM head from its engine's AISimulate export
(``--calibration aisim:FILE``, as ``fidelity_mlperf --aisim-tables``), and adds each deployment's
GEMMs of every layer over a range of row counts, the catalog's curve beside the tables: where the
step the simulated server settles at differs from the real one, what the tables change there.
``--json OUT`` writes the figures printed.

A measured Server run's typical step: ``demand x TPOT p50`` tokens (demand: scheduled QPS per
replica x (mean prompt + mean output)), of which one decode per request in its decode phase
(QPS x output x TPOT) and the rest prefill chunks at the flags' chunk size; its time is the TPOT
p50 (at these rates nearly every decode step carries a chunk). An Offline run's steady step: the
whole token budget, with as many decodes as keep completions equal to admissions
(``budget x output / (prompt + output)``); its time is that many decodes / (samples/s x output).
Decode contexts are the mean prompt plus half the mean output; a chunk capped below the mean prompt
(vLLM's long-prefill threshold) sits midway through it, whole prompts start at context 0.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from benchmarks._common import save_results
from benchmarks.fidelity_mlperf import parse_tables, table_source
from tailserve.executors.simulated.cost_model import BatchShape
from tailserve.executors.simulated.deployment import Deployment, build_cost_model, kernel_engine


@dataclass(frozen=True)
class Step:
    label: str
    deployment: Deployment
    policy: str
    demand_tokens: int  # tokens of the step
    decodes: int
    chunk: int  # prefill tokens per chunk (the flags' per-request cap)
    context: int  # each decode's context
    chunk_context: int  # each chunk's context: a capped chunk sits midway through its prompt
    measured_ms: float  # the step time the measured run implies


def _server(label, dep, policy, qps, prompt, output, tpot_ms, chunk) -> Step:
    tokens = round(qps * (prompt + output) * tpot_ms / 1e3)
    decodes = round(qps * output * tpot_ms / 1e3)
    return Step(
        label, dep, policy, tokens, decodes, chunk, round(prompt + output / 2), _mid(prompt, chunk), tpot_ms
    )


def _offline(label, dep, policy, samples_per_s, prompt, output, budget, chunk) -> Step:
    decodes = round(budget * output / (prompt + output))
    return Step(
        label,
        dep,
        policy,
        budget,
        decodes,
        chunk,
        round(prompt + output / 2),
        _mid(prompt, chunk),
        decodes / (samples_per_s * output) * 1e3,
    )


def _mid(prompt: float, chunk: int) -> int:
    """The mean context of a ``chunk``-token piece of a ``prompt``-token prompt (0: whole prompts)."""
    return max(0, round((prompt - chunk) / 2))


RH = Deployment.of(model="Llama-3.1-8B", hardware="H100-SXM", tp=1, quantization="fp8")
RH_OFF = Deployment.of(
    model="Llama-3.1-8B", hardware="H100-SXM", tp=1, quantization="fp8", kv_cache_dtype="fp8"
)
B200 = Deployment.of(model="Llama-2-70B", hardware="B200", tp=1, quantization="nvfp4", kv_cache_dtype="fp8")
H200 = Deployment.of(model="Llama-2-70B", hardware="H200", tp=1, quantization="fp8", kv_cache_dtype="fp8")
# Per-replica rates, the datasets' mean prompts and the submissions' mean outputs
# (benchmarks/fidelity_mlperf.py): CNN-DailyMail 870.7 in / 128 out; OpenOrca 222.3 in / 274.4 (B200)
# and 292.7 (Cisco) out. TensorRT-LLM's chunks are whole prompts here (its chunk unit is the budget).
STEPS = (
    _server("Red Hat H100 Server", RH, "vllm", 39.64, 870.7, 128, 23.64, 256),
    _offline("Red Hat H100 Offline", RH_OFF, "vllm", 45.1334, 870.7, 128, 4096, 871),
    _server("NVIDIA B200 Llama-2-70B Server", B200, "trtllm", 363.79 / 8, 222.3, 274.4, 126.10, 223),
    _offline("NVIDIA B200 Llama-2-70B Offline", B200, "trtllm", 371.423 / 8, 222.3, 274.4, 3584, 223),
    _server("Cisco H200 Llama-2-70B Server", H200, "trtllm", 114.23 / 8, 222.3, 292.7, 172.93, 223),
)


def terms(step: Step) -> dict[str, float]:
    cm = build_cost_model(step.deployment, step.policy).cost_model
    prefill_tokens = step.demand_tokens - step.decodes
    chunks = [step.chunk] * (prefill_tokens // step.chunk) + (
        [prefill_tokens % step.chunk] if prefill_tokens % step.chunk else []
    )
    prefills = [(q, step.chunk_context) for q in chunks]
    decodes = [step.context] * step.decodes
    shape = BatchShape.of(prefills, decodes)
    gemms = cm.linear_time(shape.num_tokens, shape.num_logits)
    layers = cm.linear_time(shape.num_tokens, 0)
    out = {
        "GEMMs": layers,
        "LM head": gemms - layers,
        "prefill attention": cm.attention_time(BatchShape.of(prefills, [])),
        "decode attention": cm.attention_time(BatchShape.of([], decodes)),
        # what iteration_time adds beyond the rest (rounded: a difference of sums, 0 at TP 1)
        "all-reduce": round(
            cm.iteration_time(shape) - gemms - cm.attention_time(shape) - cm.efficiency.overhead, 9
        )
        + 0.0,
        "overhead": cm.efficiency.overhead,
    }
    total = cm.iteration_time(shape)
    assert abs(sum(out.values()) - total) < 1e-9, "the terms must add up to iteration_time"
    return {**out, "total": total}


# TensorRT-LLM's perf-overview (release 0.19, nvidia.github.io/TensorRT-LLM/0.19.0/performance/
# perf-overview.html): Llama-3.3-70B FP4 (Llama-3.1-70B's shape), B200, TP 1, ISL/OSL 128/128:
# 11,253.28 output tokens/s. Its steady step at a batch of B: B decodes (context 128 + 64) beside
# B prompt tokens (a prompt admitted for every request that finishes).
PERF_OVERVIEW = (
    Deployment.of(model="Llama-3.1-70B", hardware="B200", tp=1, quantization="nvfp4", kv_cache_dtype="fp8"),
    11253.28,
)


def calibrated(dep: Deployment, policy: str, tables: dict[str, str], what: str) -> Deployment:
    """``dep`` with its dense GEMMs priced from the policy's engine's export (none: as it is)."""
    if not tables:
        return dep
    source = table_source(tables, kernel_engine("auto", policy), dep.hardware, dep.model, what)
    return replace(dep, calibration=source)


def perf_overview_rows(tables: dict[str, str] | None = None) -> list[tuple[int, float]]:
    """(batch, output tokens/s) of the steady 128/128 step at batches 512, 1,024 and 2,048."""
    dep = calibrated(PERF_OVERVIEW[0], "trtllm", tables or {}, "the perf-overview row")
    cm = build_cost_model(dep, "trtllm").cost_model
    return [
        (b, b / cm.iteration_time(BatchShape.of([(128, 0)] * (b // 128), [192] * b)))
        for b in (512, 1024, 2048)
    ]


# Row counts of the GEMM sweep: single decodes up to the B200's Offline budget and beyond.
SWEEP_ROWS = (16, 128, 512, 1024, 1536, 2048, 2848, 4096)


def gemm_sweep(tables: dict[str, str]) -> list[dict]:
    """Each step deployment's dense GEMMs of every layer (``linear_time`` without the LM head: the
    KV writes included alike) at ``SWEEP_ROWS`` rows, in ms: the catalog's, then the tables'."""
    out, seen = [], set()
    for step in STEPS:
        dep = step.deployment
        key = (dep.model, dep.hardware, dep.quantization, step.policy)  # the KV format moves no GEMM
        if key in seen:
            continue
        seen.add(key)
        catalog = build_cost_model(dep, step.policy).cost_model
        table = build_cost_model(calibrated(dep, step.policy, tables, step.label), step.policy).cost_model
        out.append(
            {
                "deployment": f"{dep.model} {dep.quantization} on {dep.hardware} ({step.policy})",
                "rows": list(SWEEP_ROWS),
                "catalog_ms": [round(catalog.linear_time(m) * 1e3, 2) for m in SWEEP_ROWS],
                "table_ms": [round(table.linear_time(m) * 1e3, 2) for m in SWEEP_ROWS],
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--aisim-tables",
        metavar="ENGINE=FILE,...",
        help="price each step's dense GEMMs from its engine's AISimulate export (--calibration aisim:FILE)",
    )
    ap.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = ap.parse_args()
    try:
        tables = parse_tables(args.aisim_tables) if args.aisim_tables else {}
        steps = [replace(s, deployment=calibrated(s.deployment, s.policy, tables, s.label)) for s in STEPS]
    except ValueError as e:
        ap.error(str(e))
    for source in sorted({s.deployment.calibration for s in steps} if tables else ()):
        print(f"GEMMs priced from {source}")
    cols = ("GEMMs", "LM head", "prefill attention", "decode attention", "all-reduce", "overhead", "total")
    print("| step | tokens / requests | " + " | ".join(cols) + " | implied by the run | error |")
    print("|---|---:|" + "---:|" * (len(cols) + 2))
    results: dict = {"aisim_tables": tables, "steps": [], "perf_overview": []}
    for step in steps:
        t = terms(step)
        requests = step.decodes + -(-(step.demand_tokens - step.decodes) // step.chunk)
        err = t["total"] * 1e3 / step.measured_ms - 1
        cells = " | ".join(f"{t[c] * 1e3:.2f}" for c in cols)
        results["steps"].append(
            {"step": step.label, "tokens": step.demand_tokens, "requests": requests,
             **{f"{c} ms": round(t[c] * 1e3, 2) for c in cols}, "implied ms": step.measured_ms,
             "error": round(err, 4)}
        )  # fmt: skip
        print(
            f"| {step.label} | {step.demand_tokens:,} / {requests:,} | {cells} | {step.measured_ms:.1f} | {err:+.1%} |"
        )
    published = PERF_OVERVIEW[1]
    print(
        f"\nLlama-3.3-70B FP4 on B200, TP 1, 128/128 (TensorRT-LLM perf-overview 0.19: {published:,.0f} output tok/s)"
    )
    for batch, rate in perf_overview_rows(tables):
        print(f"  steady step at batch {batch:5,}: {rate:8,.0f} output tok/s ({rate / published - 1:+.1%})")
        results["perf_overview"].append({"batch": batch, "tokens_per_s": round(rate), "published": published})
    if tables:
        results["gemm_sweep"] = gemm_sweep(tables)
        print("\nGEMMs of every layer (no LM head), ms: catalog / tables (change)")
        print("| deployment | " + " | ".join(f"{m:,} rows" for m in SWEEP_ROWS) + " |")
        print("|---|" + "---:|" * len(SWEEP_ROWS))
        for row in results["gemm_sweep"]:
            cells = " | ".join(
                f"{a:.1f} / {b:.1f} ({b / a - 1:+.0%})" for a, b in zip(row["catalog_ms"], row["table_ms"])
            )
            print(f"| {row['deployment']} | {cells} |")
    if args.json:
        save_results(results, args.json, "step_terms.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
