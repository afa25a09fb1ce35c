"""Arrival processes: when each request of a workload reaches the server.

Open-loop processes return a sorted array of ``n`` arrival times in seconds. The gamma process
is the one ``vllm bench serve`` uses (``--request-rate R --burstiness K``), reproduced exactly so
that a tailserve run and a vLLM benchmark with the same rate and burstiness see the same kind of
traffic. A closed-loop client instead keeps a fixed number of requests in flight, which only
the engine can drive, so it is a ``RequestSource`` reacting to ``on_finish``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tailserve.core.request import Request

ARRIVAL_FORMS = ("poisson", "gamma:K", "constant", "closed:C")


def _check_n(n: int) -> None:
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")


def _check_rate(rate: float) -> None:
    # NaN fails every comparison, so test for the valid range rather than the invalid one.
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 requests/s (inf for all at once), got {rate}")


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds) with Gamma(k, 1/(rate*k)) gaps, as ``vllm bench serve`` draws them.

    ``burstiness`` k = 1 is Poisson; k < 1 is burstier (gap coefficient of variation 1/sqrt(k)),
    k > 1 is smoother. Like vLLM, the cumulative schedule is then rescaled so the last arrival is
    exactly at ``n / rate``: without it the realised rate drifts a percent or two between seeds.
    ``rate == inf`` sends everything at t = 0.
    """
    _check_n(n)
    _check_rate(rate)
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] != 0:
        times *= (n / rate) / times[-1]
    return times


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds) of a Poisson process: the gamma process with burstiness 1."""
    return gamma_arrivals(n, rate, 1.0, rng)


def constant_arrivals(n: int, rate: float) -> np.ndarray:
    """Arrival times (seconds) evenly spaced ``1 / rate`` apart, the first at t = 0."""
    _check_n(n)
    _check_rate(rate)
    if math.isinf(rate):
        return np.zeros(n)
    return np.arange(n, dtype=float) / rate


@dataclass(frozen=True)
class ArrivalSpec:
    """An arrival process as named on the command line (see ``parse_arrival``)."""

    kind: str  # "poisson", "gamma", "constant" or "closed"
    burstiness: float = 1.0  # gamma shape k; only for kind "gamma"
    concurrency: int | None = None  # requests kept in flight; only for kind "closed"

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "gamma", "constant", "closed"):
            raise ValueError(f"unknown arrival process {self.kind!r}; known: {', '.join(ARRIVAL_FORMS)}")
        if not self.burstiness > 0 or math.isinf(self.burstiness):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.kind == "closed":
            if self.concurrency is None or self.concurrency < 1:
                raise ValueError(f"closed-loop concurrency must be >= 1, got {self.concurrency}")
        elif self.concurrency is not None:
            raise ValueError(f"concurrency only applies to closed loop, got {self.concurrency}")

    @property
    def is_closed_loop(self) -> bool:
        return self.kind == "closed"

    def times(self, n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
        """Arrival times (seconds) for an open-loop process; a closed loop has none in advance."""
        if self.kind == "closed":
            raise ValueError("a closed-loop process has no arrival times; use ClosedLoopSource")
        if self.kind == "constant":
            return constant_arrivals(n, rate)
        return gamma_arrivals(n, rate, self.burstiness, rng)

    def __str__(self) -> str:
        if self.kind == "gamma":
            return f"gamma:{self.burstiness:g}"
        if self.kind == "closed":
            return f"closed:{self.concurrency}"
        return self.kind


def parse_arrival(text: str) -> ArrivalSpec:
    """Parse ``poisson``, ``gamma:K``, ``constant`` or ``closed:C`` (the ``--arrival`` flag)."""
    name, _, arg = text.strip().partition(":")
    name = name.lower()
    bad = ValueError(f"bad arrival process {text!r}; accepted forms: {', '.join(ARRIVAL_FORMS)}")
    if name in ("poisson", "constant") and not arg:
        return ArrivalSpec(name)
    if name == "gamma" and arg:
        try:
            burstiness = float(arg)
        except ValueError:
            raise bad from None
        return ArrivalSpec("gamma", burstiness=burstiness)
    if name == "closed" and arg:
        try:
            concurrency = int(arg)
        except ValueError:
            raise bad from None
        return ArrivalSpec("closed", concurrency=concurrency)
    raise bad


class ClosedLoopSource:
    """A closed-loop client: ``concurrency`` requests in flight, a new one as each finishes.

    The first ``concurrency`` requests arrive at t = 0; every ``on_finish`` releases the next
    request with ``arrival_time`` = the finish time. The requests' own arrival times are
    overwritten. ``on_finish`` for a request this source did not hand out (or a second call for
    the same one) is ignored, so the number in flight can never drift above ``concurrency``.
    """

    horizon: float | None = None  # not a cluster replica's (RequestSource.horizon)

    def __init__(self, requests: Iterable[Request], concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"closed-loop concurrency must be >= 1, got {concurrency}")
        self.concurrency = concurrency
        self._unreleased: deque[Request] = deque(requests)
        self.num_requests = len(self._unreleased)
        # Released but not yet popped: (arrival_time, sequence, request). The sequence number
        # keeps ties in release order and stops heapq from ever comparing two Requests.
        self._released: list[tuple[float, int, Request]] = []
        self._num_released = 0
        # Released and not yet finished; Request has eq=False, so the set compares by identity.
        self._outstanding: set[Request] = set()
        for _ in range(min(concurrency, self.num_requests)):
            self._release(0.0)

    def _release(self, now: float) -> None:
        request = self._unreleased.popleft()
        request.arrival_time = now
        heapq.heappush(self._released, (now, self._num_released, request))
        self._num_released += 1
        self._outstanding.add(request)

    @property
    def num_outstanding(self) -> int:
        """Requests released (popped or not) and not yet finished."""
        return len(self._outstanding)

    def next_arrival_time(self) -> float | None:
        return self._released[0][0] if self._released else None

    def pop_arrived(self, now: float) -> list[Request]:
        out: list[Request] = []
        released = self._released
        while released and released[0][0] <= now:
            out.append(heapq.heappop(released)[2])
        return out

    def on_finish(self, request: Request, now: float) -> None:
        if request not in self._outstanding:
            return
        self._outstanding.discard(request)
        if self._unreleased:
            self._release(now)

    @property
    def exhausted(self) -> bool:
        return not self._unreleased and not self._released
