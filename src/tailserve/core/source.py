"""Where requests come from: the engine pulls arrivals from a ``RequestSource``.

An open-loop workload or a trace is a ``ListSource`` (arrival times fixed in advance); a
closed-loop client (a new request each time one finishes) reacts to ``on_finish``. A live
engine (the offline ``LLM`` API, the HTTP server) puts requests into a ``QueueSource`` as they
come.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from tailserve.core.request import Request


class RequestSource(Protocol):
    # A cluster replica's source (cluster/replica.py) reports the cluster's next event here: the
    # exact fast paths must not run past it, as the step loop stops there for the router to act.
    # None for every other source.
    horizon: float | None

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

    horizon: float | None = None  # not a cluster replica's (RequestSource.horizon)

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


class QueueSource:
    """Requests added while the engine runs, each arriving when added; finished ones are kept
    for the caller to collect with ``pop_finished``."""

    horizon: float | None = None  # not a cluster replica's (RequestSource.horizon)

    def __init__(self) -> None:
        self._pending: deque[Request] = deque()
        self._finished: list[Request] = []

    def add(self, request: Request) -> None:
        self._pending.append(request)

    def next_arrival_time(self) -> float | None:
        return self._pending[0].arrival_time if self._pending else None

    def pop_arrived(self, now: float) -> list[Request]:
        out = list(self._pending)
        self._pending.clear()
        return out

    def on_finish(self, request: Request, now: float) -> None:
        self._finished.append(request)

    def pop_finished(self) -> list[Request]:
        done, self._finished = self._finished, []
        return done

    def forget_finished(self, request: Request) -> None:
        """Drop a finished request the caller answers itself (a refusal raised at once)."""
        self._finished.remove(request)

    def remove_pending(self, request_id: str) -> Request | None:
        """Take back a request added but not yet handed to the engine."""
        for request in self._pending:
            if request.request_id == request_id:
                self._pending.remove(request)
                return request
        return None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def exhausted(self) -> bool:
        return not self._pending
