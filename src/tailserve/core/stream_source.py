"""A request source fed by an iterator: requests are made as the engine reaches their arrival
time, so a run of millions never holds the whole list (``ListSource`` does)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tailserve.core.request import Request


class IteratorSource:
    """Open-loop requests from an iterator in non-decreasing arrival order (checked)."""

    horizon: float | None = None  # not a cluster replica's (RequestSource.horizon)

    def __init__(self, requests: Iterable[Request]) -> None:
        self._it: Iterator[Request] = iter(requests)
        self._next: Request | None = next(self._it, None)
        self.num_requests = 0  # handed out so far

    def next_arrival_time(self) -> float | None:
        return self._next.arrival_time if self._next is not None else None

    def pop_arrived(self, now: float) -> list[Request]:
        out: list[Request] = []
        nxt = self._next
        while nxt is not None and nxt.arrival_time <= now:
            out.append(nxt)
            following = next(self._it, None)
            if following is not None and following.arrival_time < nxt.arrival_time:
                raise ValueError(
                    f"request {following.request_id} arrives at {following.arrival_time} s, before "
                    f"{nxt.request_id} at {nxt.arrival_time} s: the iterator must be in arrival order"
                )
            nxt = following
        self._next = nxt
        self.num_requests += len(out)
        return out

    def on_finish(self, request: Request, now: float) -> None:
        return None

    @property
    def exhausted(self) -> bool:
        return self._next is None
