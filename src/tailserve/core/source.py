"""Where requests come from: the engine pulls arrivals from a ``RequestSource``.

An open-loop workload or a trace is a ``ListSource`` (arrival times fixed in advance); a
closed-loop client (a new request each time one finishes) reacts to ``on_finish``. The HTTP
server feeds the engine directly and needs no source.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from tailserve.core.request import Request


class RequestSource(Protocol):
    def next_arrival_time(self) -> float | None:
        """Arrival time (seconds) of the next request not yet handed out; None if none is known."""
        ...

    def pop_arrived(self, now: float) -> list[Request]:
        """Hand out every request with ``arrival_time <= now``, in arrival order."""
        ...

    def on_finish(self, request: Request, now: float) -> None:
        """Called once for every request that leaves the engine (finished, aborted, rejected)."""
        ...

    @property
    def exhausted(self) -> bool:
        """True when no request will ever be handed out again."""
        ...


class ListSource:
    """Requests with fixed arrival times (open loop): synthetic workloads and trace replay."""

    def __init__(self, requests: Iterable[Request]) -> None:
        ordered = sorted(requests, key=lambda r: r.arrival_time)  # stable: ties keep input order
        self._pending: deque[Request] = deque(ordered)
        self.num_requests = len(ordered)

    def next_arrival_time(self) -> float | None:
        return self._pending[0].arrival_time if self._pending else None

    def pop_arrived(self, now: float) -> list[Request]:
        out: list[Request] = []
        pending = self._pending
        while pending and pending[0].arrival_time <= now:
            out.append(pending.popleft())
        return out

    def on_finish(self, request: Request, now: float) -> None:
        return None

    @property
    def exhausted(self) -> bool:
        return not self._pending
