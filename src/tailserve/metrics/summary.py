"""Request metrics with the definitions of vLLM's serving benchmark (``vllm bench serve``).

- TTFT: first token time - arrival time, per request.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request, only when it has > 1 output token.
- ITL: every gap between consecutive tokens, pooled over all requests; tokens of one step
  (speculative decoding's accepted drafts) are one streamed chunk, one gap, as vLLM's benchmark
  times chunks (``endpoint_request_func.py``: one ``itl`` entry per chunk). With the engine's
  ``stream_interval`` above 1 its API server holds tokens back (``core/stream_interval.py``): the
  ITL is then the gap between the chunks a client receives, and the engine's own per-step gaps
  (its Prometheus ITL) are reported beside it, ``stream.engine_itl_s``.
- E2E: last token time - arrival time.
- Queue: first scheduled time - arrival time (vLLM's ``request_queue_time``).
- Throughput: completed requests (output tokens) / duration, where duration runs from the first
  arrival to the last finish.
- Goodput: requests meeting every given SLO (``<=``, so meeting it exactly counts) / duration;
  a request with one output token has TPOT 0 for this purpose.

Only requests that finished normally enter the latency statistics; aborted and rejected ones
are counted separately. Percentiles are numpy's linear interpolation, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from tailserve.core.finished_store import FinishedStore
from tailserve.core.gc_pause import paused_gc
from tailserve.core.request import Request, RequestStatus
from tailserve.core.stream_interval import StreamInterval

STAT_NAMES = ("mean", "p50", "p90", "p99", "max")
METRIC_NAMES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


def stats(values: Sequence[float] | np.ndarray, *, overwrite: bool = False) -> dict[str, float | None]:
    """Mean, percentiles and max. ``overwrite``: the percentiles partition ``values`` in place
    instead of a copy (the same numbers; for a large array nobody reads afterwards)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return dict.fromkeys(STAT_NAMES)
    mean, top = float(arr.mean()), float(arr.max())  # before any partition reorders it
    p50, p90, p99 = np.percentile(arr, [50, 90, 99], overwrite_input=overwrite)
    return {"mean": mean, "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": top}


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request service-level objectives in seconds; None means not checked."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "e2e"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"SLO {name} must be >= 0 seconds, got {v}")

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))


@dataclass(frozen=True, slots=True)
class RequestLatencies:
    """Per-request arrays (finished requests only), the input of every summary."""

    ttft: np.ndarray
    tpot: np.ndarray  # NaN where the request produced a single token
    e2e: np.ndarray
    queue: np.ndarray
    itl: np.ndarray  # pooled gaps between the chunks a client receives
    output_tokens: np.ndarray
    prompt_tokens: np.ndarray
    engine_itl: np.ndarray | None = None  # with a stream interval: the engine's own gaps

    @staticmethod
    def of(requests: Sequence[Request], stream: StreamInterval = StreamInterval()) -> RequestLatencies:
        done = [
            r for r in requests if r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        ]
        arrival = np.array([r.arrival_time for r in done], dtype=np.float64)
        first = np.array([r.token_times[0] for r in done], dtype=np.float64)
        last = np.array([r.token_times[-1] for r in done], dtype=np.float64)
        scheduled = np.array([r.first_scheduled_time for r in done], dtype=np.float64)
        n_out = np.array([len(r.token_times) for r in done], dtype=np.int64)
        ttft = first - arrival
        e2e = last - arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(n_out > 1, (e2e - ttft) / (n_out - 1), np.nan)
        # All token times in one flat array; gaps that cross from one request to the next dropped.
        flat = np.fromiter(
            chain.from_iterable(r.token_times for r in done), dtype=np.float64, count=int(n_out.sum())
        )
        gaps = np.diff(flat)
        keep = np.ones(gaps.size, dtype=bool)
        keep[np.cumsum(n_out)[:-1] - 1] = False
        keep &= gaps != 0.0  # tokens of one step: one chunk
        itl = gaps[keep] if gaps.size else np.zeros(0)
        engine_itl = None
        if stream.is_set:
            engine_itl = itl
            itl = np.fromiter(
                chain.from_iterable(np.diff(stream.chunk_times(r.token_times)) for r in done),
                dtype=np.float64,
            )
        return RequestLatencies(
            ttft=ttft,
            tpot=tpot,
            e2e=e2e,
            queue=scheduled - arrival,
            itl=itl,
            output_tokens=n_out,
            prompt_tokens=np.array([r.prompt_len for r in done], dtype=np.int64),
            engine_itl=engine_itl,
        )

    @staticmethod
    def of_store(store: FinishedStore) -> RequestLatencies:
        """The same arrays from a streaming run's store (``itl`` empty: its statistics are in
        ``store.itl_stats``, computed once when the gaps are taken)."""
        arrival = np.frombuffer(store.arrival_time, dtype=np.float64)
        first = np.frombuffer(store.first_token_time, dtype=np.float64)
        n_out = np.frombuffer(store.num_output_tokens, dtype=np.int64)
        ttft = first - arrival
        e2e = np.frombuffer(store.last_token_time, dtype=np.float64) - arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(n_out > 1, (e2e - ttft) / (n_out - 1), np.nan)
        if store.itl_stats is None:
            store.itl_stats = stats(store.take_itl(), overwrite=True)
            if store.engine_gaps is not None:
                store.engine_itl_stats = stats(store.engine_gaps.take(), overwrite=True)
        return RequestLatencies(
            ttft=ttft,
            tpot=tpot,
            e2e=e2e,
            queue=np.frombuffer(store.first_scheduled_time, dtype=np.float64) - arrival,
            itl=np.zeros(0),
            output_tokens=n_out,
            prompt_tokens=np.frombuffer(store.prompt_len, dtype=np.int64),
        )

    def good(self, slo: Slo) -> np.ndarray:
        ok = np.ones(self.ttft.shape, dtype=bool)
        if slo.ttft is not None:
            ok &= self.ttft <= slo.ttft
        if slo.tpot is not None:
            ok &= np.nan_to_num(self.tpot, nan=0.0) <= slo.tpot
        if slo.e2e is not None:
            ok &= self.e2e <= slo.e2e
        return ok


def summarize(
    requests: Sequence[Request] | FinishedStore,
    slo: Slo | None = None,
    *,
    stream: StreamInterval = StreamInterval(),
) -> dict[str, Any]:
    """The ``metrics``/``throughput`` part of a run's JSON, plus request counts and duration:
    from the requests, or from a streaming run's ``FinishedStore`` (the same numbers; its own
    ``stream``). ``stream``: how the engine's API server chunked streamed responses."""
    if isinstance(requests, FinishedStore):
        store = requests
        stream = store.stream
        lat = RequestLatencies.of_store(store)
        itl = store.itl_stats
        engine_itl = store.engine_itl_stats
        counts = (store.num_requests, store.num_rejected, store.num_aborted, store.num_preemptions)
        ends = [store.last_finish] if store.last_finish is not None else []
        starts = [store.first_arrival]
    else:
        with paused_gc():
            lat = RequestLatencies.of(requests, stream)
        itl = stats(lat.itl)
        engine_itl = stats(lat.engine_itl) if lat.engine_itl is not None else None
        statuses = [r.status for r in requests]
        counts = (
            len(requests),
            statuses.count(RequestStatus.FINISHED_REJECTED),
            statuses.count(RequestStatus.FINISHED_ABORTED),
            sum(r.num_preemptions for r in requests),
        )
        starts = [r.arrival_time for r in requests]
        ends = [r.finish_time for r in requests if r.finish_time is not None]
    duration = (max(ends) - min(starts)) if ends else 0.0
    n_done = int(lat.ttft.size)
    out_tokens = int(lat.output_tokens.sum())
    in_tokens = int(lat.prompt_tokens.sum())
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "num_requests": counts[0],
        "num_finished": n_done,
        "num_rejected": counts[1],
        "num_aborted": counts[2],
        "num_preemptions": counts[3],
        "duration_s": duration,
        "metrics": {
            "ttft_s": stats(lat.ttft),
            "tpot_s": stats(lat.tpot[~np.isnan(lat.tpot)]),
            "itl_s": itl,
            "e2e_s": stats(lat.e2e),
            "queue_s": stats(lat.queue),
        },
        "throughput": {
            "requests_per_s": per_s(n_done),
            "output_tokens_per_s": per_s(out_tokens),
            "total_tokens_per_s": per_s(out_tokens + in_tokens),
        },
    }
    if stream.is_set:
        summary["stream"] = {**stream.to_json(), "engine_itl_s": engine_itl}
    if slo is not None and slo.is_set:
        summary["goodput"] = {
            "slo": {"ttft_s": slo.ttft, "tpot_s": slo.tpot, "e2e_s": slo.e2e},
            "requests_per_s": per_s(int(lat.good(slo).sum())),
            "fraction_good": float(lat.good(slo).mean()) if n_done else 0.0,
        }
    return summary


def prefix_cache_summary(requests: Sequence[Request] | FinishedStore) -> dict[str, Any]:
    """Prefix-cache effect, from each request's hit at its first admission: hit rate in tokens and
    requests, prefill tokens saved, and TTFT of requests with and without a hit."""
    if isinstance(requests, FinishedStore):
        return _prefix_cache_summary_of_store(requests)
    done = [
        r for r in requests if r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    ]
    prompt = sum(r.prompt_len for r in done)
    cached = sum(r.num_cached_tokens for r in done)
    hit = [r.token_times[0] - r.arrival_time for r in done if r.num_cached_tokens]
    miss = [r.token_times[0] - r.arrival_time for r in done if not r.num_cached_tokens]
    return {
        "hit_rate_tokens": cached / prompt if prompt else 0.0,
        "hit_rate_requests": len(hit) / len(done) if done else 0.0,
        "prefill_tokens_saved": cached,
        "ttft_s": {"hit": stats(hit), "miss": stats(miss)},
    }


def _prefix_cache_summary_of_store(store: FinishedStore) -> dict[str, Any]:
    cached = np.frombuffer(store.num_cached_tokens, dtype=np.int64)
    ttft = np.frombuffer(store.first_token_time, dtype=np.float64) - np.frombuffer(
        store.arrival_time, dtype=np.float64
    )
    prompt = int(np.frombuffer(store.prompt_len, dtype=np.int64).sum())
    hit = ttft[cached > 0]
    n_done = store.num_finished
    return {
        "hit_rate_tokens": int(cached.sum()) / prompt if prompt else 0.0,
        "hit_rate_requests": hit.size / n_done if n_done else 0.0,
        "prefill_tokens_saved": int(cached.sum()),
        "ttft_s": {"hit": stats(hit), "miss": stats(ttft[cached == 0])},
    }
