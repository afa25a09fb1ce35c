"""The machine's speed at the minute, for the closed loop (issue 33).

On this shared VM the same engine's steps drift by tens of percent within an hour (docs/fidelity.md,
"How much of that is the machine": two runs 2 h apart moved ITL p50 by +27-48% with the code
unchanged), so a twin calibrated in the run's first minutes describes those minutes, and a cell
25 minutes later is measured on another machine. The gauge is a few seconds of fixed work timed
from outside, as the calibration was: three lone prompts of 192 tokens (one output token each)
and one batch of 4 streams of 48 tokens. It runs right after the calibration (the base) and again
on each server start; the ratios rescale the twin's times for that server's cells
(``scaled_calibration``) — prefill's compute-bound terms by the prefill ratio, every other time
term by the decode ratio — and the benchmark reports the cells both ways.

The gauge's shapes fit every flag setting the loop runs (prompts under the smallest budget of 256
tokens, 4 streams under ``max_num_seqs`` 4) and its prompts are fresh random tokens each time, so
no prefix cache shortens them.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tailserve.bench.client import BenchConfig, run_benchmark
from tailserve.bench.datasets import BenchRequest

PROMPT, PREFILLS, STREAMS, TOKENS = 192, 3, 4, 48


@dataclass(frozen=True, slots=True)
class Gauge:
    prefill_s: float  # median client TTFT of the lone prompts
    itl_s: float  # median inter-token gap of the decode batch (first token excluded)

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def measure(url: str, model: str, vocab: int, seed: int) -> Gauge:
    """Time the gauge on the server at ``url`` (fresh prompts from ``seed``)."""
    rng = np.random.default_rng([seed, 7177])
    config = BenchConfig(f"{url}/v1/completions", model, extra_body={"temperature": 0.0})
    ttfts = []
    for _ in range(PREFILLS):  # one at a time: each runs alone
        req = [BenchRequest(rng.integers(10, vocab, PROMPT).tolist(), PROMPT, 1)]
        results, _ = asyncio.run(run_benchmark(req, np.zeros(1), config))
        if not results[0].success:
            raise RuntimeError(f"gauge prefill failed: {results[0].error}")
        ttfts.append(results[0].ttft)
    batch = [BenchRequest(rng.integers(10, vocab, 32).tolist(), 32, TOKENS) for _ in range(STREAMS)]
    results, _ = asyncio.run(run_benchmark(batch, np.zeros(STREAMS), config))
    gaps = [g for r in results if r.success for g in r.itl]
    if not gaps:
        raise RuntimeError("gauge decode produced no inter-token gaps")
    return Gauge(statistics.median(ttfts), statistics.median(gaps))


def factors(now: Gauge, base: Gauge) -> tuple[float, float]:
    """(prefill, decode): how much slower the machine is now than at the base."""
    return now.prefill_s / base.prefill_s, now.itl_s / base.itl_s


def scaled_calibration(path: str, prefill: float, decode: float, out: Path) -> str:
    """A copy of the calibration file at ``path`` whose times are ``prefill`` x (compute-bound
    terms, and the per-request time outside the engine, spent as a prompt arrives) and
    ``decode`` x (memory-bound and per-step terms) its own; the path of the copy."""
    if not (math.isfinite(prefill) and prefill > 0 and math.isfinite(decode) and decode > 0):
        raise ValueError(f"gauge factors must be positive, got prefill {prefill}, decode {decode}")
    body = json.loads(Path(path).read_text())
    eff = body["efficiency"]
    eff["compute"] /= prefill
    eff["memory"] /= decode
    for name in ("overhead", "per_token", "per_logit", "gemm_latency"):
        eff[name] = eff.get(name, 0.0) * decode
    if body.get("request_overhead_s"):
        body["request_overhead_s"] *= prefill
    body["source"] = (
        f"{body.get('source', '')}; times x{prefill:.3f} (prefill) / x{decode:.3f} (decode) by the gauge"
    )
    out.write_text(json.dumps(body))
    return str(out)
