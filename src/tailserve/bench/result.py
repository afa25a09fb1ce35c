"""The result of a benchmark run, with ``vllm bench serve``'s metric math and JSON field names.

Per successful request: TTFT; TPOT = (latency - TTFT) / (output tokens - 1), only when more
than one token came; ITL = every gap, pooled; E2EL = latency. Statistics are mean, median, std
and the chosen percentiles (numpy, linear), reported in ms as ``mean_ttft_ms``,
``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms`` ... Goodput counts requests meeting every
SLO (``value <= slo``; TPOT 0 for one-token requests). ``max_output_tokens_per_s`` buckets token
events (rebuilt from start + TTFT + cumulative ITL) into 1-second bins; ``max_concurrent_requests``
is the exact peak overlap of [start, start + latency) with departures first on ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tailserve.bench.client import RequestResult

# A server that streams this many tokens per chunk on average holds tokens back (one token a
# chunk otherwise; a finish or a short request adds a little)
CHUNKY = 1.5
CHUNK_MISMATCH = 0.25  # a prediction further than this from the measured tokens per chunk
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items or ():
        key, colon, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not colon or key not in GOODPUT_KEYS or not ms >= 0:
            raise ValueError(
                f"--goodput {item!r}: expected KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_KEYS)} "
                "and a value >= 0, e.g. ttft:200 tpot:50"
            )
        slo[key] = ms
    return slo


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(
            f"--metric-percentiles {text!r}: expected a comma list of numbers in 0..100, e.g. 50,99"
        )
    return values


def _ms_stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000
    out = {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(arr.std()),
    }
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def peak_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def tokens_per_chunk(results: Sequence[RequestResult]) -> float | None:
    """Output tokens per streamed chunk over the successful requests of more than one token (1.0:
    a chunk per token; more: the server held tokens back, a stream interval, or sent several a
    step, speculative decoding's accepted drafts); None without such a request."""
    many = [r for r in results if r.success and r.output_tokens > 1]
    chunks = sum(len(r.itl) + 1 for r in many)
    return sum(r.output_tokens for r in many) / chunks if chunks else None


def chunk_notes(measured: float | None, predicted: float | None = None) -> list[str]:
    """What a client's ITL means when the server streams several tokens a chunk, and whether the
    prediction chunks as the server does."""
    notes = []
    if measured is not None and measured >= CHUNKY:
        notes.append(
            f"the server streamed {measured:.1f} tokens per chunk on average: ITL is timed per chunk, as vllm "
            "bench serve does, so it is about that many decode steps (a stream interval: vLLM's and SGLang's "
            "--stream-interval, TensorRT-LLM's stream_interval; or speculative decoding's accepted drafts); "
            "TPOT is per token"
        )
    if (
        measured is not None
        and predicted is not None
        and abs(measured - predicted) > CHUNK_MISMATCH * predicted
    ):
        notes.append(
            f"the prediction streams {predicted:.1f} tokens per chunk, the server {measured:.1f}: the ITLs do "
            "not compare; give the server's stream interval (--predict-policy POLICY:stream_interval=N, e.g. "
            "vllm:stream_interval=4) or its speculative decoding"
        )
    return notes


def compute_result(
    results: Sequence[RequestResult],
    duration: float,
    *,
    percentiles: Sequence[float] = (99.0,),
    metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el"),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The metrics part of vLLM's result JSON (``duration`` ... ``pNN_e2el_ms``), with the
    per-request lists (drop ``DETAILED_FIELDS`` unless detailed output was asked for)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    all_tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    good = None
    if goodput:
        checks = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        slo_s = {k: v / 1000 for k, v in goodput.items()}
        good = sum(all(checks[k][i] <= slo_s[k] for k in slo_s) for i in range(len(ok)))
    max_tokens_per_s = 0.0
    if ok:
        t0 = min(r.start_time for r in ok)
        buckets = np.zeros(int(np.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1)
        for r in ok:
            times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
            idx = (times - t0).astype(np.int64)
            np.add.at(buckets, idx[(idx >= 0) & (idx < buckets.size)], 1)
        max_tokens_per_s = float(buckets.max())
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good) if good is not None else None,
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": max_tokens_per_s,
        "mean_tokens_per_chunk": tokens_per_chunk(ok),
        "max_concurrent_requests": peak_concurrency([(r.start_time, r.start_time + r.latency) for r in ok]),
    }
    values = {
        "ttft": ttfts,
        "tpot": tpots,
        "itl": itls,
        "e2el": e2els,
        "client_queue_time": [r.client_queue_time for r in ok],
    }
    for name in metrics:
        if name not in values:
            raise ValueError(f"--percentile-metrics: unknown metric {name!r}; known: {', '.join(values)}")
        result.update(_ms_stats(name, values[name], percentiles))
    return result
