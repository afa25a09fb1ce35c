"""Whether the twin's explanation of a stall is what the real engine shows.

``tailserve explain`` says why a decode stalled from the simulated run's batch record: whose
prefill shared (or held up) the iteration. A real engine shows no batch record from outside, but
a recording of its traffic (``bench --record-trace``, the closed loop's cells) shows every
request's send time and every token's arrival at the client, and that is enough to name the
suspect of each stall it saw: the requests whose prefill was in flight during the gap — sent
before the gap ended, first token after it began. Of those, the one whose prompt, times its
overlap with the gap, is largest is the measured blocker (a long prompt's prefill covers the
whole gap; short requests that arrived during it waited behind it and overlap it less).

For every stall of the real run (a gap above the recording's own threshold: its p99 gap and three
times its median, ``attribution.default_tbt_threshold``'s rule) the twin's gap of the same request
that stands for it is found by cause, not by token index (a twin 20% faster is several tokens
ahead when a long prompt arrives): the request's longest gap in the twin while the measured
blocker's prefill runs there (its arrival to its first token on the twin's clock); with no such
gap (or no measured blocker), its longest gap within ``WINDOW`` tokens of the real one. That gap
is explained (``Attributor.gap``) and compared:

- **caught**: the twin's gap is a stall too: over ``STALL_FACTOR`` times the twin's median gap
  (the twin's p99 would do as badly as a threshold: where stalls are ~1% of the gaps, as in a
  head-of-line run, the p99 is the stall itself);
- **same cause**: the twin's top blocker is the measured one (both "no prefill in flight" counts).

And the other way round, the twin's own stalls (above its p99 gap and 3x its median, the rule the
real ones are picked by) that stand for no real stall of the request (``twin_only``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tailserve.core.request import Request
from tailserve.metrics.attribution import (
    Attributor,
    default_tbt_threshold,
    finished,
    pooled_gaps,
    stall_threshold,
)

WINDOW = 3  # tokens either side of a real stall where the twin's stall may fall
STALL_FACTOR = 3.0  # a twin gap over this many times the twin's median gap is a stall


@dataclass(frozen=True, slots=True)
class SeenRequest:
    """One request as the client saw it: send time, prompt, every token's arrival (seconds on
    one clock)."""

    request_id: str
    arrival: float
    prompt_len: int
    token_times: tuple[float, ...]

    @property
    def first_token(self) -> float:
        return self.token_times[0] if self.token_times else float("inf")


def seen_requests(
    request_ids: Sequence[str],
    arrivals: Sequence[float],
    prompt_lens: Sequence[int],
    ttfts: Sequence[float | None],
    itls: Sequence[Sequence[float]],
) -> list[SeenRequest]:
    """From per-request send times, TTFTs and inter-token gaps (a failed request: TTFT None)."""
    out = []
    for rid, t0, n, ttft, gaps in zip(request_ids, arrivals, prompt_lens, ttfts, itls, strict=True):
        times = () if ttft is None else tuple(np.cumsum([t0 + ttft, *gaps]).tolist())
        out.append(SeenRequest(rid, float(t0), int(n), times))
    return out


@dataclass(frozen=True, slots=True)
class StallMatch:
    request_id: str
    token_index: int  # the later token of the real gap (1 = the gap after the first)
    measured_s: float
    twin_s: float | None  # the twin's gap that stands for it (see the module docstring)
    measured_blocker: tuple[str, int] | None  # (request, prompt tokens) in flight; None: none was
    twin_blocker: tuple[str, int] | None  # the twin's top blocker of the same gap
    twin_stalled: bool

    @property
    def same_cause(self) -> bool:
        mine = self.measured_blocker[0] if self.measured_blocker else None
        twin = self.twin_blocker[0] if self.twin_blocker else None
        return mine == twin


@dataclass
class StallCheck:
    threshold_s: float  # the real run's stall threshold
    twin_threshold_s: float
    matches: list[StallMatch] = field(default_factory=list)  # every real stall, longest first
    twin_only: int = 0  # twin stalls whose real gap was below the real threshold
    skipped: int = 0  # requests whose token counts differ between the runs (not compared)

    @property
    def caught(self) -> int:
        return sum(m.twin_stalled for m in self.matches)

    @property
    def same_cause(self) -> int:
        return sum(m.same_cause for m in self.matches)

    @property
    def caught_same_cause(self) -> int:
        return sum(m.twin_stalled and m.same_cause for m in self.matches)

    def gap_ratio(self) -> float | None:
        """Median of twin gap / measured gap over the real stalls."""
        ratios = [m.twin_s / m.measured_s for m in self.matches if m.twin_s is not None and m.measured_s > 0]
        return statistics.median(ratios) if ratios else None

    def summary(self) -> str:
        n = len(self.matches)
        if n == 0:
            return (
                f"the real run has no stall above {self.threshold_s * 1e3:.1f} ms; the twin has "
                f"{self.twin_only} above its {self.twin_threshold_s * 1e3:.1f} ms"
            )
        ratio = self.gap_ratio()
        ratio_text = f"; twin gap / real gap median {ratio:.2f}" if ratio is not None else ""
        return (
            f"{n} real stalls (gaps > {self.threshold_s * 1e3:.1f} ms): the twin stalls at {self.caught} "
            f"of them (> {self.twin_threshold_s * 1e3:.1f} ms) and names the prefill in flight in "
            f"{self.same_cause} ({self.caught_same_cause} both){ratio_text}; {self.twin_only} twin "
            f"stalls where the real gap was none"
        )

    def to_json(self, top: int | None = None) -> dict:
        return {
            "threshold_s": self.threshold_s,
            "twin_threshold_s": self.twin_threshold_s,
            "real_stalls": len(self.matches),
            "caught": self.caught,
            "same_cause": self.same_cause,
            "caught_same_cause": self.caught_same_cause,
            "twin_only": self.twin_only,
            "skipped_requests": self.skipped,
            "gap_ratio_median": self.gap_ratio(),
            "stalls": [
                {
                    "request_id": m.request_id,
                    "token_index": m.token_index,
                    "measured_s": m.measured_s,
                    "twin_s": m.twin_s,
                    "measured_blocker": list(m.measured_blocker) if m.measured_blocker else None,
                    "twin_blocker": list(m.twin_blocker) if m.twin_blocker else None,
                    "twin_stalled": m.twin_stalled,
                }
                for m in self.matches[:top]
            ],
        }


def prefill_in_flight(
    seen: Sequence[SeenRequest], stalled: str, a: float, b: float
) -> tuple[str, int] | None:
    """The request whose prefill most covers the gap (a, b): prompt tokens x overlap."""
    best, score = None, 0.0
    for r in seen:
        if r.request_id == stalled:
            continue
        overlap = min(b, r.first_token) - max(a, r.arrival)
        if overlap > 0 and r.prompt_len * overlap > score:
            best, score = (r.request_id, r.prompt_len), r.prompt_len * overlap
    return best


def check_stalls(
    seen: Sequence[SeenRequest],
    twin: Sequence[Request],
    attributor: Attributor,
    threshold_s: float | None = None,
    twin_threshold_s: float | None = None,
) -> StallCheck:
    """Every real stall of ``seen`` against the same gap in the twin's run (``twin``, explained by
    ``attributor``); requests are matched by id and must have as many tokens in both."""
    done = {r.request_id: r for r in finished(twin)}
    threshold = default_tbt_threshold(seen) if threshold_s is None else threshold_s
    pooled = pooled_gaps(done.values())
    median = float(np.median(pooled)) if len(pooled) else 0.0
    twin_threshold = STALL_FACTOR * median if twin_threshold_s is None else twin_threshold_s
    # The twin's own stalls, by the rule the real ones are picked by (its p99 and 3x its median):
    # the ones that stand for no real stall are ``twin_only``.
    own_threshold = max(twin_threshold, stall_threshold(pooled))
    prefill_window = {
        rid: (r.arrival_time, r.token_times[0]) for rid, r in done.items() if r.token_times
    }  # each request's prefill on the twin's clock
    check = StallCheck(threshold, twin_threshold)
    for r in seen:
        replay = done.get(r.request_id)
        if replay is None or len(replay.token_times) != len(r.token_times):
            check.skipped += bool(r.token_times)
            continue
        real = np.diff(r.token_times)
        times = np.asarray(replay.token_times)
        simulated = np.diff(times)
        stalled = np.flatnonzero(real > threshold)
        matched = []
        for j in stalled:
            a, b = r.token_times[j], r.token_times[j + 1]
            blocker = prefill_in_flight(seen, r.request_id, a, b)
            t = _twin_gap(times, simulated, j, prefill_window.get(blocker[0]) if blocker else None)
            matched.append(t)
            gap = attributor.gap(replay, t + 1)
            top = (gap.blockers[0].request_id, gap.blockers[0].prompt_len) if gap.blockers else None
            check.matches.append(
                StallMatch(
                    r.request_id,
                    int(j + 1),
                    float(b - a),
                    float(simulated[t]),
                    blocker,
                    top,
                    bool(simulated[t] > twin_threshold),
                )
            )
        near_real = np.zeros(len(simulated), dtype=bool)  # twin gaps some real stall accounts for
        for j in stalled:
            near_real[max(0, j - WINDOW) : j + WINDOW + 1] = True
        near_real[matched] = True
        check.twin_only += int(np.count_nonzero((simulated > own_threshold) & ~near_real))
    check.matches.sort(key=lambda m: -m.measured_s)
    return check


def _twin_gap(times: np.ndarray, gaps: np.ndarray, j: int, prefill: tuple[float, float] | None) -> int:
    """Index of the twin's gap that stands for the real stall ``j``: the longest overlapping the
    blocker's prefill on the twin's clock, else the longest within ``WINDOW`` tokens."""
    if prefill is not None:
        overlapping = np.flatnonzero((times[:-1] < prefill[1]) & (times[1:] > prefill[0]))
        if len(overlapping):
            return int(overlapping[np.argmax(gaps[overlapping])])
    lo, hi = max(0, j - WINDOW), min(len(gaps), j + WINDOW + 1)
    return lo + int(np.argmax(gaps[lo:hi]))
