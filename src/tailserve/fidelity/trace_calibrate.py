"""``tailserve calibrate --from-trace recorded.jsonl``: fit the cost model to traffic already served.

A recording (``bench`` or ``router --record-trace``, ``workloads/recorded.py``) holds, per request,
its arrival, lengths, prompt token ids and the token times the client saw. Most of its moments
mix many things, but two kinds are clean enough to read an iteration time from, with no probe
sent to the engine:

- **a request that ran alone**: nothing else was in flight from its arrival to its first token
  (every other request either finished before it arrived or arrived after its first token). Its
  TTFT is one prefill of its uncached tokens (the API server, network and tokenizer included, as
  ``calibrate --from-server`` without server metrics sees it). Prompts longer than the engine's
  token budget are left out (chunked: several iterations). With ``prefix_caching`` the prompt's
  longest block-aligned prefix shared with an earlier request's token ids counts as cached
  context, as vLLM's automatic prefix caching would have it.
- **a gap of pure decode**: an inter-token gap of one request during which no request was
  between its arrival and its first token (nothing waited, nothing prefilled), and every request
  in decode was so for the whole gap (started before it, ended after it). The gap is one decode
  iteration of those requests, each at its context then (prompt + tokens it had received). A gap
  next to tokens that arrived together (one streamed chunk: the server or the client fell
  behind) is left out: it holds several steps, or a late delivery.

Gaps are grouped by batch size and context (buckets of ``context_bucket`` tokens) and each
group's median is one point; alone-prefills are grouped by their uncached length. The points go
to the same fit as ``--from-server`` (``server_calibrate.fit_points``). A recording that is busy
all the time has few clean moments: then the error says how many it found and what to do.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tailserve.core.request import Request
from tailserve.executors.simulated.cost_model import BatchShape
from tailserve.fidelity.server_calibrate import ProbedPoint
from tailserve.kv.prefix import block_hashes
from tailserve.workloads.recorded import Measured

MIN_GAPS_PER_POINT = 5  # a decode point is the median of at least this many gaps
MIN_PREFILL_POINTS = 2
MIN_DECODE_POINTS = 2
MAX_DECODE_POINTS = 24  # the most-sampled shapes; more would only weight the fit towards decode


@dataclass(frozen=True, slots=True)
class TraceCalibrationOptions:
    max_num_batched_tokens: int = 2048  # vLLM's API-server default on CPUs and most GPUs
    prefix_caching: bool = True  # vLLM V1's default
    block_size: int = 16
    context_bucket: int = 256
    # Token times closer than this are one moment: a client sees one iteration's tokens of
    # different streams a little apart.
    tolerance_s: float = 0.002


@dataclass(frozen=True, slots=True)
class _Timeline:
    arrival: float
    first: float
    tokens: np.ndarray  # each token's time (seconds since the recording's start)
    prompt_len: int
    cached: int  # block-aligned prefix shared with an earlier request

    @property
    def end(self) -> float:
        return float(self.tokens[-1])


@dataclass(frozen=True, slots=True)
class _Spans:
    """Every request's arrival, first token and last token, as arrays (one per recording)."""

    arrivals: np.ndarray
    firsts: np.ndarray
    ends: np.ndarray

    @staticmethod
    def of(lines: list[_Timeline]) -> _Spans:
        return _Spans(
            np.array([t.arrival for t in lines]),
            np.array([t.first for t in lines]),
            np.array([t.end for t in lines]),
        )


@dataclass(frozen=True, slots=True)
class TracePoints:
    points: list[ProbedPoint]
    num_requests: int  # requests that succeeded with a TTFT
    alone: int  # requests that ran alone (before the budget and grouping)
    clean_gaps: int  # pure-decode gaps found


class TraceCalibrationError(ValueError):
    pass


def timelines(
    recorded: Sequence[tuple[Request, Measured]], options: TraceCalibrationOptions
) -> list[_Timeline]:
    out: list[_Timeline] = []
    seen: set[int] = set()  # chained keys of every full block of the prompts so far
    for request, m in recorded:
        ids = request.prompt_token_ids
        cached = 0
        if options.prefix_caching and ids:
            # The longest block-aligned prefix some earlier prompt starts with; the last token is
            # always computed (vLLM never serves a whole prompt from the cache).
            for key in block_hashes(ids[:-1], options.block_size):
                if key not in seen:
                    break
                cached += options.block_size
            seen.update(block_hashes(ids, options.block_size))
        if not m.success or m.ttft_s is None:
            continue
        first = request.arrival_time + m.ttft_s
        tokens = first + np.concatenate(([0.0], np.cumsum(m.itl_s)))
        out.append(_Timeline(request.arrival_time, first, tokens, request.prompt_len, cached))
    return out


def trace_points(
    recorded: Sequence[tuple[Request, Measured]], options: TraceCalibrationOptions | None = None
) -> TracePoints:
    options = options or TraceCalibrationOptions()
    lines = timelines(recorded, options)
    spans = _Spans.of(lines)
    prefill = _alone_prefills(lines, spans, options)
    alone = sum(len(v) for v in prefill.values())
    decode, clean = _decode_gaps(lines, spans, options)
    points = [
        ProbedPoint(
            BatchShape.of([(length, cached)], []),
            statistics.median(ttfts),
            statistics.median(ttfts),
            "trace",
            f"prefill {length}" + (f"@{cached}" if cached else "") + f" (n={len(ttfts)})",
        )
        for (length, cached), ttfts in sorted(prefill.items())
        if length <= options.max_num_batched_tokens
    ]
    groups = sorted(
        ((k, v) for k, v in decode.items() if len(v) >= MIN_GAPS_PER_POINT),
        key=lambda kv: -len(kv[1]),
    )[:MAX_DECODE_POINTS]
    for (batch, _), samples in sorted(groups):
        seconds = statistics.median(s for s, _ in samples)
        context = round(statistics.mean(c for _, c in samples))
        points.append(
            ProbedPoint(
                BatchShape.of([], [context] * batch),
                seconds,
                seconds,
                "trace",
                f"decode {batch}x{context} (n={len(samples)})",
            )
        )
    return TracePoints(points, len(lines), alone, clean)


def _alone_prefills(
    lines: list[_Timeline], spans: _Spans, options: TraceCalibrationOptions
) -> dict[tuple[int, int], list[float]]:
    """Per (uncached tokens, cached context): the TTFTs of requests nothing overlapped."""
    out: dict[tuple[int, int], list[float]] = defaultdict(list)
    arrivals, ends = spans.arrivals, spans.ends
    tol = options.tolerance_s
    for i, t in enumerate(lines):
        # Another request overlaps [arrival, first token] if it arrived before the first token
        # and had not finished when this one arrived.
        overlap = (arrivals < t.first - tol) & (ends > t.arrival + tol)
        overlap[i] = False
        if not overlap.any():
            out[(t.prompt_len - t.cached, t.cached)].append(t.first - t.arrival)
    return out


def _decode_gaps(
    lines: list[_Timeline], spans: _Spans, options: TraceCalibrationOptions
) -> tuple[dict[tuple[int, int], list[tuple[float, int]]], int]:
    """Per (batch, context bucket): (gap seconds, mean context) of each pure-decode gap."""
    out: dict[tuple[int, int], list[tuple[float, int]]] = defaultdict(list)
    arrivals, firsts, ends = spans.arrivals, spans.firsts, spans.ends
    tol = options.tolerance_s
    clean = 0
    for t in lines:
        # Only requests in flight at some point of this one's decode can touch its gaps.
        near = np.flatnonzero((arrivals < t.end) & (ends > t.first - tol))
        a, f, n = arrivals[near], firsts[near], ends[near]
        gaps = np.diff(t.tokens)
        together = gaps <= tol  # tokens delivered in one chunk: the gap before held several steps
        for k in range(len(gaps)):
            if together[k] or (k + 1 < len(gaps) and together[k + 1]) or (k > 0 and together[k - 1]):
                continue
            s, e = float(t.tokens[k]), float(t.tokens[k + 1])
            # Someone between arrival and first token during the gap: waiting or prefilling.
            if ((a < e - tol) & (f > s + tol)).any():
                continue
            active = (f <= s + tol) & (n > s + tol)
            # Everyone decoding at its start decodes through its end: one stable batch.
            if (n[active] < e - tol).any():
                continue
            members = near[active]
            contexts = [
                lines[j].prompt_len + int(np.searchsorted(lines[j].tokens, s + tol, side="right"))
                for j in members
            ]
            context = round(statistics.mean(contexts))
            out[(len(members), context // options.context_bucket)].append((e - s, context))
            clean += 1
    return out, clean


def check_enough(found: TracePoints, path: str) -> None:
    prefills = sum(1 for p in found.points if p.batch.decode_kv_tokens == 0)
    decodes = len(found.points) - prefills
    if prefills >= MIN_PREFILL_POINTS and decodes >= MIN_DECODE_POINTS:
        return
    raise TraceCalibrationError(
        f"{path}: too few clean moments to fit ({found.num_requests} requests; {found.alone} ran "
        f"alone, giving {prefills} prefill length(s) within the token budget; {found.clean_gaps} "
        f"pure-decode gaps, giving {decodes} decode shape(s) with >= {MIN_GAPS_PER_POINT} gaps; "
        f"need {MIN_PREFILL_POINTS} and {MIN_DECODE_POINTS}): record a stretch at lower load, "
        "or use calibrate --from-server URL"
    )
