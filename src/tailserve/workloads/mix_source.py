"""A request source that labels each arriving request from a seeded mix (a priority, a tenant),
on its own random stream, so the wrapped workload's lengths and arrivals stay as they were."""

from __future__ import annotations

import random
from typing import Any

from tailserve.core.request import Request
from tailserve.core.source import RequestSource


class MixSource:
    horizon: float | None = None  # not a cluster replica's (RequestSource.horizon)

    def __init__(
        self, source: RequestSource, field: str, mix: tuple[tuple[Any, float], ...], seed: int
    ) -> None:
        self._source = source
        self._field = field
        self._values = [v for v, _ in mix]
        self._weights = [f for _, f in mix]
        self._rng = random.Random(seed)

    def next_arrival_time(self) -> float | None:
        return self._source.next_arrival_time()

    def pop_arrived(self, now: float) -> list[Request]:
        arrived = self._source.pop_arrived(now)
        for request in arrived:
            setattr(request, self._field, self._rng.choices(self._values, self._weights)[0])
        return arrived

    def on_finish(self, request: Request, now: float) -> None:
        self._source.on_finish(request, now)

    @property
    def exhausted(self) -> bool:
        return self._source.exhausted
