"""Capacity: the highest arrival rate (requests/s) whose run meets an SLO — Sarathi-Serve's measure.

The search brackets the threshold by doubling (or halving) a starting rate, then bisects the
bracket until it is narrower than ``rel_tol`` of its upper end. It assumes that failure is
monotone in the rate: if a rate misses the SLO, every higher rate misses it too. Queueing makes
that true in expectation; one seeded run per rate can break it near the threshold, where the
search then returns *a* passing rate with a failing one within the tolerance above it. Every
rate replays the same requests (same seed) with arrival times scaled by old rate / new rate, so
the rate is the only thing that changes between runs.

An SLO (``parse_capacity_slo``) is a set of tail bounds (``ttft_p99=2s,tbt_p99=200ms``: TBT is
vLLM's ITL, every gap between tokens) and/or a goodput target (``ttft=2s,tpot=100ms,goodput=90%``:
at least 90% of requests meet every per-request bound). A run also misses it when the policy
turns a request away (TGI's ``max_concurrent_requests``): that request never got served.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tailserve.metrics.summary import STAT_NAMES, Slo
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.sweep import RunOutcome, RunSpec, Sweep
from tailserve.workloads.traces import load_trace

TAIL_METRICS = {
    "ttft": "ttft_s",
    "tbt": "itl_s",
    "itl": "itl_s",
    "tpot": "tpot_s",
    "e2e": "e2e_s",
    "queue": "queue_s",
}
REQUEST_METRICS = ("ttft", "tpot", "e2e")
DEFAULT_SLO = "ttft_p99=2s,tbt_p99=200ms"


# ---- the SLO ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CapacitySlo:
    tails: tuple[tuple[str, str, float], ...] = ()  # (summary metric, stat, seconds)
    request: Slo | None = None  # per-request bounds for goodput
    min_good_fraction: float = 0.9  # share of requests that must meet ``request``

    def __post_init__(self) -> None:
        if not self.tails and self.request is None:
            raise ValueError("the SLO sets no bound; e.g. ttft_p99=2s,tbt_p99=200ms or ttft=2s,goodput=90%")
        if not 0 < self.min_good_fraction <= 1:
            raise ValueError(f"goodput must be a fraction in (0, 1], got {self.min_good_fraction}")

    def __str__(self) -> str:
        parts = [f"{_short(metric)}_{stat}<={_time(bound)}" for metric, stat, bound in self.tails]
        if self.request is not None:
            bounds = [
                f"{n}<={_time(v)}" for n in REQUEST_METRICS if (v := getattr(self.request, n)) is not None
            ]
            parts.append(f"{self.min_good_fraction:.0%} of requests with {' and '.join(bounds)}")
        return ", ".join(parts)

    def ratio(self, summary: dict[str, Any]) -> float:
        """The worst measured/bound over the SLO's terms: <= 1 meets them, lower means more
        headroom; infinite when a metric has no value (nothing finished). Requests turned away
        are not in it (``meets`` checks them): they have no latency to compare."""
        worst = 0.0
        for metric, stat, bound in self.tails:
            value = summary["metrics"][metric][stat]
            if value is None:
                return math.inf
            worst = max(worst, value / bound if bound > 0 else (math.inf if value > 0 else 0.0))
        if self.request is not None:
            good = summary.get("goodput", {}).get("fraction_good", 0.0)
            worst = max(worst, self.min_good_fraction / good if good > 0 else math.inf)
        return worst

    def meets(self, summary: dict[str, Any]) -> bool:
        return self.ratio(summary) <= 1.0 and summary.get("num_turned_away", 0) == 0


def _short(metric: str) -> str:
    return "tbt" if metric == "itl_s" else metric.removesuffix("_s")


def _time(seconds: float) -> str:
    return f"{seconds:g}s" if seconds >= 1 else f"{seconds * 1e3:g}ms"


def parse_capacity_slo(text: str) -> CapacitySlo:
    """``ttft_p99=2s,tbt_p99=200ms`` (tail bounds), ``ttft=2s,tpot=100ms,goodput=90%`` (goodput)."""
    tails: list[tuple[str, str, float]] = []
    request: dict[str, float] = {}
    fraction: float | None = None
    for raw in text.split(","):
        item = raw.strip()
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or not value.strip():
            raise ValueError(f"--slo item {item!r}: expected NAME=VALUE, e.g. ttft_p99=2s")
        if key == "goodput":
            fraction = _parse_fraction(value.strip(), item)
            continue
        name, _, stat = key.partition("_")
        if not stat and name in REQUEST_METRICS:
            request[name] = parse_seconds(value.strip(), item)
        elif name in TAIL_METRICS and stat in STAT_NAMES:
            tails.append((TAIL_METRICS[name], stat, parse_seconds(value.strip(), item)))
        else:
            raise ValueError(
                f"--slo item {item!r}: expected METRIC_STAT=TIME with METRIC one of "
                f"{', '.join(TAIL_METRICS)} and STAT one of {', '.join(STAT_NAMES)} (e.g. tbt_p99=200ms), "
                f"a per-request bound {'=, '.join(REQUEST_METRICS)}= with goodput=FRACTION"
            )
    if fraction is not None and not request:
        raise ValueError(
            "--slo goodput= needs per-request bounds to count good requests, e.g. ttft=2s,goodput=90%"
        )
    return CapacitySlo(
        tuple(tails), Slo(**request) if request else None, 0.9 if fraction is None else fraction
    )


def parse_seconds(raw: str, item: str) -> float:
    """``2s``, ``200ms``, or a bare number of milliseconds (``vllm bench --goodput``'s unit)."""
    try:
        if raw.endswith("ms"):
            seconds = float(raw[:-2]) / 1000
        elif raw.endswith("s"):
            seconds = float(raw[:-1])
        else:
            seconds = float(raw) / 1000
    except ValueError:
        raise ValueError(f"--slo item {item!r}: {raw!r} is not a time like 2s or 200ms") from None
    if not seconds >= 0 or math.isinf(seconds):
        raise ValueError(f"--slo item {item!r}: a bound must be a finite time >= 0")
    return seconds


def _parse_fraction(raw: str, item: str) -> float:
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"--slo item {item!r}: {raw!r} is not a fraction like 0.9 or 90%") from None
    if not 0 < value <= 1:
        raise ValueError(f"--slo item {item!r}: goodput must be in (0, 1], e.g. 0.9 or 90%")
    return value


# ---- bisection ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Capacity:
    rate: float  # the highest rate found meeting the SLO; 0.0 if even ``min_rate`` misses it
    upper: float | None  # the lowest rate found missing it; None if ``max_rate`` still meets it
    evaluations: tuple[tuple[float, bool], ...] = ()  # (rate, met) in the order tried

    @property
    def bounded(self) -> bool:
        return self.upper is not None and self.rate > 0


def capacity_steps(
    lo: float, hi: float, rel_tol: float = 0.05, *, min_rate: float = 1e-3, max_rate: float = 1e4
) -> Generator[float, bool, Capacity]:
    """The search as a coroutine: yields the next rate to try, is sent whether it met the SLO.

    ``[lo, hi]`` is a first guess of the bracket (``lo == hi`` is fine). If ``lo`` misses, it is
    halved until a rate meets (or falls below ``min_rate``); if ``hi`` meets, it is doubled until
    one misses (or exceeds ``max_rate``). Then the bracket is bisected until
    ``upper - rate <= rel_tol * upper``.
    """
    if not 0 < lo <= hi:
        raise ValueError(f"capacity search needs 0 < lo <= hi, got {lo} and {hi}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    tried: dict[float, bool] = {}

    def meets(rate: float) -> Generator[float, bool, bool]:
        if rate not in tried:
            tried[rate] = bool((yield rate))
        return tried[rate]

    def result(rate: float, upper: float | None) -> Capacity:
        return Capacity(rate, upper, tuple(tried.items()))

    good, bad = 0.0, None
    rate = lo
    while not (yield from meets(rate)):
        bad = rate
        rate /= 2
        if rate < min_rate:
            return result(0.0, bad)
    good = rate
    if bad is None:
        rate = max(hi, good)
        while (yield from meets(rate)):
            good = rate
            rate *= 2
            if rate > max_rate:
                return result(good, None)
        bad = rate
    while bad - good > rel_tol * bad:
        mid = (good + bad) / 2
        if (yield from meets(mid)):
            good = mid
        else:
            bad = mid
    return result(good, bad)


def bisect_capacity(
    meets: Callable[[float], bool],
    lo: float,
    hi: float,
    rel_tol: float = 0.05,
    *,
    min_rate: float = 1e-3,
    max_rate: float = 1e4,
) -> Capacity:
    """The highest rate at which ``meets(rate)`` holds, for a ``meets`` true below a threshold
    and false above it; see ``capacity_steps``."""
    steps = capacity_steps(lo, hi, rel_tol, min_rate=min_rate, max_rate=max_rate)
    try:
        rate = next(steps)
        while True:
            rate = steps.send(meets(rate))
    except StopIteration as stop:
        return stop.value


# ---- capacity of simulated runs -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RateScaler:
    """Rescales a workload to an arrival rate: synthetic workloads by their ``rate`` (same seed,
    same requests, arrival times x old/new), a trace by ``rate_scale`` over its own rate."""

    base: RunSpec
    trace_rate: float | None = None  # the trace's requests/s at rate_scale 1

    @staticmethod
    def of(spec: RunSpec) -> RateScaler:
        w = spec.workload
        if w.name == "hol":
            raise ValueError(
                "the hol workload is a fixed scenario with no arrival rate to search; "
                "use --workload chat, random, shared-prefix, multi-turn or --trace"
            )
        if w.name == "random" and w.arrival.is_closed_loop:
            raise ValueError("a closed-loop workload (--arrival closed:C) has no arrival rate to search")
        if w.name != "trace":
            return RateScaler(spec)
        trace = load_trace(w.trace_path or "", max_requests=w.max_requests)
        span = trace[-1].arrival_time - trace[0].arrival_time if trace else 0.0
        if len(trace) < 2 or span <= 0:
            raise ValueError(
                f"{w.trace_path}: needs two or more requests at different times to scale its rate"
            )
        return RateScaler(spec, len(trace) / span)

    @property
    def rate(self) -> float:
        """The base workload's arrival rate, requests/s (sessions/s for multi-turn)."""
        w = self.base.workload
        return w.rate if self.trace_rate is None else self.trace_rate * w.rate_scale

    def at(self, rate: float, **changes: Any) -> RunSpec:
        if self.trace_rate is None:
            workload = replace(self.base.workload, rate=rate)
        else:
            workload = replace(self.base.workload, rate_scale=rate / self.trace_rate)
        return replace(self.base, workload=workload, **changes)


def _size_field(workload: WorkloadSpec) -> tuple[str, str]:
    """The ``WorkloadSpec`` field that sets how much traffic a workload has, and what it counts."""
    if workload.name == "trace":
        return "max_requests", "trace requests"
    if workload.name == "multi-turn":
        return "num_sessions", "sessions"
    return "num_requests", "requests"


def longer_workload(workload: WorkloadSpec, factor: int = 2) -> WorkloadSpec | None:
    """The workload with ``factor`` x its requests (sessions for multi-turn; a trace's next
    requests), for checking that a capacity is sustained; None for a trace already used whole."""
    field, _ = _size_field(workload)
    n = getattr(workload, field)
    if field == "max_requests":
        if n is None:
            return None
        more = min(len(load_trace(workload.trace_path or "")), n * factor)
        return replace(workload, max_requests=more) if more > n else None
    return replace(workload, **{field: n * factor})


def workload_size(workload: WorkloadSpec) -> str:
    """How many requests a capacity was measured with: "1,000 requests", "40 sessions"."""
    field, noun = _size_field(workload)
    n = getattr(workload, field)
    return f"{n:,} {noun}" if n is not None else "the whole trace"


def size_option(workload: WorkloadSpec, factor: int = 2) -> str:
    """The command-line option for ``factor`` x the workload's traffic: ``--num-requests 2000``."""
    field, _ = _size_field(workload)
    return f"--{field.replace('_', '-')} {factor * (getattr(workload, field) or 0)}"


@dataclass(slots=True)
class CapacitySearch:
    """One policy's search, with the outcome of every rate it ran."""

    scaler: RateScaler
    slo: CapacitySlo
    rel_tol: float = 0.05
    min_rate: float = 1e-3
    max_rate: float = 1e4
    outcomes: dict[float, RunOutcome] = field(default_factory=dict)

    def steps(self) -> Generator[RunSpec, RunOutcome, Capacity]:
        start = self.scaler.rate
        search = capacity_steps(start, start, self.rel_tol, min_rate=self.min_rate, max_rate=self.max_rate)
        try:
            rate = next(search)
            while True:
                outcome = yield self.scaler.at(rate)
                if outcome.error is not None:
                    raise ValueError(f"{self.scaler.base.policy.label}: {outcome.error}")
                self.outcomes[rate] = outcome
                rate = search.send(self.slo.meets(outcome.summary))
        except StopIteration as stop:
            return stop.value


def search_capacities(
    sweep: Sweep, searches: Iterable[CapacitySearch], description: str = "capacity"
) -> list[Capacity]:
    """Every search's capacity, the searches' runs interleaved on the sweep's backend."""
    return sweep.drive([s.steps() for s in searches], description)
