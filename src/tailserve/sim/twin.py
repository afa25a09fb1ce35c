"""A recorded run against its replay in the simulator: how close the twin comes on the traffic.

A recording (``workloads/recorded.py``) holds each request's arrival, lengths and what was
measured; ``simulate --trace`` replays the same requests. Both sides are reduced with
``vllm bench serve``'s definitions (``bench/result.py``): TTFT per request, ITL every gap pooled,
TPOT = (latency - TTFT) / (tokens - 1) per request, E2E = latency; percentiles linear
(numpy's). Only requests that succeeded in the recording are compared, the same ones on both
sides.

``overhead_s`` is the time a request spends outside the engine (``calibrate --from-server``
measures it, ``request_overhead_s`` in its file): the replay's engine has no API server, network
or tokenizer, so it is added to each replayed TTFT and latency. The **held-out** part is the
later ``held_out`` fraction of the requests by arrival: when a twin was fitted to the earlier
part of a run, the later part says how it predicts traffic it has not seen (the replay runs the
whole trace, so the engine's state at the split is the replay's own).

``check_stalls`` holds the twin's explanation against what the real engine did: each gap the
recording measured above ``explain``'s stall threshold, the replay's cause for the same gap of
the same request (``metrics/attribution.py``), and whether a request the replay blames had its
prefill open at that moment in the recording (arrived before the gap ended, first token after it
began).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.core.request import Request
from tailserve.workloads.recorded import Measured

METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50", "tpot_p99", "e2e_p50", "output_tok_s")


@dataclass(frozen=True, slots=True)
class Timings:
    ttft: list[float]
    itl: list[float]
    tpot: list[float]
    e2e: list[float]
    output_tokens: int
    span_s: float  # first arrival -> last token

    def stats(self) -> dict[str, float]:
        def pct(values: list[float], q: float) -> float:
            return float(np.percentile(values, q)) if values else float("nan")

        return {
            "ttft_p50": pct(self.ttft, 50),
            "ttft_p99": pct(self.ttft, 99),
            "itl_p50": pct(self.itl, 50),
            "itl_p99": pct(self.itl, 99),
            "tpot_p50": pct(self.tpot, 50),
            "tpot_p99": pct(self.tpot, 99),
            "e2e_p50": pct(self.e2e, 50),
            "output_tok_s": self.output_tokens / self.span_s if self.span_s > 0 else float("nan"),
            "requests": float(len(self.ttft)),
        }


def recorded_timings(recorded: Sequence[tuple[Request, Measured]]) -> Timings:
    ttft, itl, tpot, e2e, tokens, start, end = [], [], [], [], 0, np.inf, 0.0
    for request, m in recorded:
        assert m.ttft_s is not None
        latency = m.latency_s if m.latency_s is not None else m.ttft_s + sum(m.itl_s)
        ttft.append(m.ttft_s)
        itl += m.itl_s
        if m.output_tokens > 1:
            tpot.append((latency - m.ttft_s) / (m.output_tokens - 1))
        e2e.append(latency)
        tokens += m.output_tokens
        start, end = min(start, request.arrival_time), max(end, request.arrival_time + latency)
    return Timings(ttft, itl, tpot, e2e, tokens, end - start if ttft else 0.0)


def replayed_timings(replayed: Sequence[Request], overhead_s: float = 0.0) -> Timings:
    ttft, itl, tpot, e2e, tokens, start, end = [], [], [], [], 0, np.inf, 0.0
    for r in replayed:
        times = r.token_times
        if not times:
            continue
        first = times[0] - r.arrival_time + overhead_s
        latency = times[-1] - r.arrival_time + overhead_s
        ttft.append(first)
        itl += np.diff(times).tolist()
        if len(times) > 1:
            tpot.append((latency - first) / (len(times) - 1))
        e2e.append(latency)
        tokens += len(times)
        start, end = min(start, r.arrival_time), max(end, r.arrival_time + latency)
    return Timings(ttft, itl, tpot, e2e, tokens, end - start if ttft else 0.0)


@dataclass(frozen=True, slots=True)
class TwinComparison:
    all: dict[str, dict[str, float]]  # "recorded" / "replayed" -> metric -> value
    held_out: dict[str, dict[str, float]]
    split_arrival_s: float  # the held-out part's first arrival
    num_compared: int
    num_failed: int  # recorded requests that failed (not compared)

    def to_json(self) -> dict:
        return {
            "all": self.all,
            "held_out": self.held_out,
            "split_arrival_s": self.split_arrival_s,
            "num_compared": self.num_compared,
            "num_failed": self.num_failed,
        }


def compare_replay(
    recorded: Sequence[tuple[Request, Measured]],
    replayed: Sequence[Request],
    overhead_s: float = 0.0,
    held_out: float = 0.5,
) -> TwinComparison:
    """``recorded`` in arrival order (``load_measured``); ``replayed`` the simulated requests of
    the same trace (ids ``trace-<row>`` on both sides)."""
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out must be a fraction in (0, 1), got {held_out}")
    ok = [(r, m) for r, m in recorded if m.success and m.ttft_s is not None]
    if not ok:
        raise ValueError("the recording has no request that succeeded with a first token to compare")
    by_id = {r.request_id: r for r in replayed}
    split = min(int(len(ok) * (1.0 - held_out)), len(ok) - 1)

    def side(pairs: Sequence[tuple[Request, Measured]]) -> dict[str, dict[str, float]]:
        return {
            "recorded": recorded_timings(pairs).stats(),
            "replayed": replayed_timings([by_id[r.request_id] for r, _ in pairs], overhead_s).stats(),
        }

    return TwinComparison(
        side(ok), side(ok[split:]), ok[split][0].arrival_time, len(ok), len(recorded) - len(ok)
    )


def relative_error(replayed: float, recorded: float) -> float:
    return replayed / recorded - 1.0 if recorded else float("nan")


# ---- the twin's explanation of the stalls the real engine had ---------------------------------
@dataclass(frozen=True, slots=True)
class StallCheck:
    """One inter-token gap the recording measured above the threshold, and the twin's account
    of the same gap (the same request, the same token) in its replay."""

    request_id: str
    token_index: int  # the later token of the gap (1: the gap after the first token)
    measured_s: float
    replayed_s: float
    cause: str  # the replay's dominant cause of the gap (``metrics/attribution.py``)
    blockers: tuple[str, ...]  # requests whose prefill the replay charges the gap to
    # A blocker's recorded prefill — its arrival to its first token at the client — overlaps
    # the measured gap: the real engine had that prompt to compute while the gap was open.
    confirmed: bool

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "token_index": self.token_index,
            "measured_s": self.measured_s,
            "replayed_s": self.replayed_s,
            "cause": self.cause,
            "blockers": list(self.blockers),
            "confirmed": self.confirmed,
        }


def measured_stall_threshold(recorded: Sequence[tuple[Request, Measured]]) -> float:
    """``explain``'s rule on the recording's own gaps: above its p99 and 3x its median."""
    gaps = [g for _, m in recorded for g in m.itl_s]
    if not gaps:
        return float("inf")
    return float(max(np.percentile(gaps, 99), 3 * np.median(gaps)))


def check_stalls(
    recorded: Sequence[tuple[Request, Measured]], attributor: Any, threshold_s: float
) -> list[StallCheck]:
    """Every recorded gap above ``threshold_s``, longest first, with the twin's cause for it.

    Recorded times are the client's: a request's tokens at arrival + TTFT + the gaps so far.
    The check of a blocker uses the recording alone (its arrival and first token), so it holds
    whatever the replay's own timing."""
    arrivals = {r.request_id: r.arrival_time for r, _ in recorded}
    first_token = {
        r.request_id: r.arrival_time + m.ttft_s for r, m in recorded if m.ttft_s is not None and m.success
    }
    out = []
    for r, m in recorded:
        if not m.success or m.ttft_s is None:
            continue
        replayed = attributor.requests.get(r.request_id)
        t = r.arrival_time + m.ttft_s
        for k, gap in enumerate(m.itl_s, 1):
            start, t = t, t + gap
            if gap <= threshold_s:
                continue
            if replayed is None or len(replayed.token_times) <= k:
                out.append(StallCheck(r.request_id, k, gap, float("nan"), "not replayed", (), False))
                continue
            b = attributor.gap(replayed, k)
            blockers = tuple(x.request_id for x in b.blockers)
            confirmed = any(
                arrivals.get(x, float("inf")) <= t and first_token.get(x, float("-inf")) >= start
                for x in blockers
            )
            out.append(StallCheck(r.request_id, k, gap, b.seconds, b.dominant, blockers, confirmed))
    out.sort(key=lambda s: -s.measured_s)
    return out
