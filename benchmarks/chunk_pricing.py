"""What a prefill chunk costs a decode beside it: tailserve's cost model against AISimulate's.

`sim_speed` runs both simulators on the same requests and they agree on TTFT and TPOT within a
few percent under vLLM at a 4,096-token budget, SGLang and TensorRT-LLM, but not at a 512-token
budget (Sarathi-Serve's chunking rule): there AISimulate's TTFT p99 is twice tailserve's. This
probe isolates why with two requests on Llama-3-8B / one A100, vLLM's rule, synchronous:

- A: a 128-token prompt decoding 400 tokens, from t = 0;
- B: a 4,096-token prompt (2 output tokens) arriving at t = 1 s, while A decodes.

Under each budget B's prompt runs in budget-sized chunks, each in one iteration with A's decode.
Reported per budget and per tool: B's TTFT alone and beside A, A's largest inter-token gap (the step that carried a
chunk, or B's whole prompt) and A's end-to-end latency; then, from tailserve's cost model, the
prices of one such iteration's parts: the chunk alone, the decode alone and both in one forward.
A mixed iteration priced as one forward over every token reads the weights once; priced as a
prefill forward plus a decode forward (the sum) it reads them twice.

    python -m benchmarks.chunk_pricing [--budgets 512,1024,2048,4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import default_out, missing_peer, peer_venv
from benchmarks.sim_speed import Case, aisimulate_config, write_both
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.deployment import BuiltCostModel, Deployment, build_cost_model
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

PROMPT_A, OUTPUT_A = 128, 400
PROMPT_B, OUTPUT_B, ARRIVAL_B_MS = 4096, 2, 1000


def write_traces(folder: Path, with_a: bool = True) -> tuple[Path, Path]:
    """The two requests (B alone without ``with_a``) as tailserve JSONL and as Mooncake JSONL
    (unique hash ids: no reuse)."""
    name = "ab" if with_a else "b"
    ours, theirs = folder / f"tailserve_{name}.jsonl", folder / f"mooncake_{name}.jsonl"
    rows = [(0, PROMPT_A, OUTPUT_A)] if with_a else []
    rows.append((ARRIVAL_B_MS, PROMPT_B, OUTPUT_B))
    write_both(rows, ours, theirs)
    return ours, theirs


def tailserve_run(built: BuiltCostModel, trace: Path, budget: int) -> dict:
    flags = f"max_num_batched_tokens={budget},max_num_seqs=256,async_scheduling=false"
    spec = parse_policy_list(f"vllm:{flags}")[0]
    run = run_policy(built, spec, WorkloadBuilder(WorkloadSpec("trace", trace_path=str(trace))))
    if len(run.requests) == 1:  # B alone
        (b,) = run.requests
        return {"b_ttft_ms": (b.token_times[0] - b.arrival_time) * 1000}
    a, b = sorted(run.requests, key=lambda r: r.arrival_time)
    gaps = [t1 - t0 for t0, t1 in zip(a.token_times, a.token_times[1:])]
    return {
        "b_ttft_ms": (b.token_times[0] - b.arrival_time) * 1000,
        "a_max_itl_ms": max(gaps) * 1000,
        "a_e2e_ms": (a.finish_time - a.arrival_time) * 1000,
    }


def aisimulate_run(exe: Path, trace: Path, budget: int, folder: Path) -> dict:
    config = aisimulate_config(Case(f"vllm-{budget}", "", "vllm", budget), trace, folder)
    cmd = [str(exe), "predict", "-c", str(config), "--format", "json"]
    cmd += ["--output-dir", str(config.with_suffix(".out")), "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"chunk_pricing: error: aisimulate exited {proc.returncode}: {proc.stderr[-2000:]}")
    r = json.loads(proc.stdout[proc.stdout.index("{") :])
    if r["num_requests"] == 1:  # B alone
        return {"b_ttft_ms": r["max_ttft_ms"]}
    # Two requests: B's TTFT is the larger one (A's first token comes from a 128-token prefill);
    # A's end-to-end the larger one (B finishes within a step of its prompt); the largest gap
    # between two tokens is A's (B's one gap is a plain decode step).
    return {
        "b_ttft_ms": r["max_ttft_ms"],
        "a_max_itl_ms": r["max_itl_ms"],
        "a_e2e_ms": r["max_e2e_latency_ms"],
    }


def iteration_prices(cm: CostModel, budget: int) -> dict:
    """tailserve's prices of B's first chunk beside A's decode (A ~1 s in: ~200 tokens held)."""
    chunk = min(budget - 1, PROMPT_B)  # vLLM's budget holds A's decode token first
    context = PROMPT_A + 80
    alone = cm.iteration_time(BatchShape.of([(chunk, 0)], [])) * 1000
    decode = cm.iteration_time(BatchShape.of([], [context])) * 1000
    fused = cm.iteration_time(BatchShape.of([(chunk, 0)], [context])) * 1000
    return {
        "chunk_tokens": chunk,
        "chunk_alone_ms": alone,
        "decode_alone_ms": decode,
        "one_forward_ms": fused,
        "sum_ms": alone + decode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="512,1024,2048,4096", help="token budgets, comma-separated")
    parser.add_argument("--aisimulate-venv", default=str(peer_venv("aisimulate")))
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/out/chunk_pricing.json)"
    )
    args = parser.parse_args()
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        raise SystemExit(
            f"chunk_pricing: error: --budgets must be integers separated by commas, got {args.budgets!r}"
        ) from None
    if any(b < 2 for b in budgets):
        raise SystemExit("chunk_pricing: error: every budget must be >= 2 (a decode token and a chunk token)")
    exe = Path(args.aisimulate_venv) / "bin" / "aisimulate"
    if not exe.exists():
        print(
            f"AISimulate absent: {missing_peer('aisimulate', args.aisimulate_venv)} Pricing tailserve alone."
        )
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="chunk_pricing_") as tmp:
        ours, theirs = write_traces(Path(tmp))
        ours_b, theirs_b = write_traces(Path(tmp), with_a=False)
        for budget in budgets:
            row = {
                "budget": budget,
                "tailserve": tailserve_run(built, ours, budget),
                "tailserve_prices": iteration_prices(built.cost_model, budget),
            }
            # B's TTFT without A: its chunks' own price, the mixed steps' baseline.
            row["tailserve"]["b_alone_ttft_ms"] = tailserve_run(built, ours_b, budget)["b_ttft_ms"]
            if exe.exists():
                row["aisimulate"] = aisimulate_run(exe, theirs, budget, Path(tmp))
                row["aisimulate"]["b_alone_ttft_ms"] = aisimulate_run(exe, theirs_b, budget, Path(tmp))[
                    "b_ttft_ms"
                ]
            rows.append(row)
    print(
        f"A: {PROMPT_A}-token prompt, {OUTPUT_A} output tokens from t=0; B: {PROMPT_B}-token prompt at t={ARRIVAL_B_MS / 1000:g} s"
    )
    print("Llama-3-8B / A100-80GB, vLLM's rule, synchronous; ms, tailserve / AISimulate")
    print(
        f"{'budget':>6}  {'B alone TTFT':>15}  {'B TTFT':>15}  {'A max ITL':>15}  {'A e2e':>17}  | tailserve: chunk alone + decode alone = sum vs one forward"
    )
    for row in rows:
        t, p = row["tailserve"], row["tailserve_prices"]
        a = row.get("aisimulate")

        def pair(key: str, width: int, t=t, a=a) -> str:
            text = f"{t[key]:,.1f}" + (f" / {a[key]:,.1f}" if a else "")
            return f"{text:>{width}}"

        print(
            f"{row['budget']:>6}  {pair('b_alone_ttft_ms', 15)}  {pair('b_ttft_ms', 15)}  {pair('a_max_itl_ms', 15)}  {pair('a_e2e_ms', 17)}  | "
            f"{p['chunk_alone_ms']:.1f} + {p['decode_alone_ms']:.1f} = {p['sum_ms']:.1f} vs {p['one_forward_ms']:.1f} ({p['chunk_tokens']} + 1 tokens)"
        )
    out_path = Path(args.out) if args.out else default_out("chunk_pricing.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.chunk_pricing", *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "rows": rows,
    }
    out_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {out_path}")


if __name__ == "__main__":
    main()
