"""Anyscale's continuous-batching benchmark (June 2023) in the simulator.

The claim: on a production-like workload, continuous batching gives ~8x and continuous batching
with PagedAttention (vLLM) ~23x the throughput of static batching. Their setup, as published
(docs/experiments.md quotes the sources): 1,000 prompts of 512 input tokens, each with a
predetermined output length drawn from an exponential distribution and capped (32, 128, 512,
1,536 tokens: the cap sets the length variance), EOS ignored, all submitted at once; OPT-13B on
one A100 40 GB. Here:

- ``static``: wait for a batch, pad, run it to completion; batch size swept (best one kept);
- ``orca:reserve_tokens=2048``: continuous batching that reserves one contiguous buffer of the
  maximum sequence length (512 + 1,536) per request, like servers before paged KV;
- ``vllm``: continuous batching with paged KV (vLLM V1's defaults for the A100).

    python benchmarks/anyscale_cb.py [--mean 128] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _paths import default_out  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tailserve.assemble import BuildOptions, build_engine  # noqa: E402
from tailserve.core.request import Request  # noqa: E402
from tailserve.core.source import ListSource  # noqa: E402
from tailserve.metrics.summary import summarize  # noqa: E402
from tailserve.policies.registry import PolicySpec, parse_policy_list  # noqa: E402
from tailserve.sim.deployment import Deployment, build_cost_model  # noqa: E402

CAPS = (32, 128, 512, 1536)
PROMPT = 512
MAX_LEN = 2048  # OPT-13B's context: 512 + 1,536
STATIC_BATCHES = (4, 8, 16, 32, 64)


def requests(cap: int, mean: float, seed: int, n: int = 1000) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(f"r{i}", PROMPT, max(1, min(cap, round(rng.expovariate(1.0 / mean)))), 0.0) for i in range(n)
    ]


def run(built, spec: PolicySpec, reqs: list[Request]) -> dict:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mean", type=float, default=128.0, help="mean of the exponential before the cap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hardware", default="A100-40GB")
    ap.add_argument("--out", default=str(default_out("anyscale_cb.json")))
    args = ap.parse_args()
    built = build_cost_model(Deployment("OPT-13B", args.hardware, 1, "none"))
    console = Console(width=150)
    table = Table(
        title=f"OPT-13B on {args.hardware}: 1,000 x 512-token prompts, outputs ~Exp(mean {args.mean:g}) capped",
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
        reqs = functools.partial(requests, cap, args.mean, args.seed)  # fresh requests per run
        mean_out = sum(r.max_tokens for r in reqs()) / 1000
        static = {}
        for b in STATIC_BATCHES:
            try:
                static[b] = run(built, parse_policy_list(f"static:batch_size={b},max_wait=0")[0], reqs())
            except ValueError as e:
                static[b] = {"error": str(e)}
        ok = {b: r for b, r in static.items() if "error" not in r and r["finished"] == 1000}
        best_b = max(ok, key=lambda b: ok[b]["output_tok_s"])
        cb = run(built, parse_policy_list(f"orca:reserve_tokens={MAX_LEN}")[0], reqs())
        vl = run(built, parse_policy_list("vllm")[0], reqs())
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
    console.print(table)
    Path(args.out).write_text(
        json.dumps({"mean": args.mean, "seed": args.seed, "hardware": args.hardware, "rows": rows}, indent=2)
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
