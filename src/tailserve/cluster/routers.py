"""The load-balancing routers: round-robin, random, least-requests, least-kv, power-of-two and
session affinity. Pure Python; the prefix-aware ones are in ``prefix_routers.py``.

"Scraped load" of a replica is what its last /metrics scrape said was waiting + running, plus
what this router sent it since that scrape (the scrape cannot have seen those yet). "In-flight"
is the router's own count of requests it sent and has not seen finish.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from tailserve.cluster.routing import InFlight, ReplicaState, RouteRequest, healthy_indices


@dataclass(frozen=True, slots=True)
class NoFlags:
    pass


@dataclass(frozen=True, slots=True)
class SeedFlags:
    seed: int = 0  # the router's own random stream


class BaseRouter:
    """In-flight bookkeeping every router shares; subclasses implement ``route``."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type] = NoFlags

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.config_cls()
        self.inflight = InFlight()

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        raise NotImplementedError

    def on_routed(self, request: RouteRequest, replica: int, now: float) -> None:
        self.inflight.add(request, replica)

    def on_finished(self, request_id: str, replica: int, now: float) -> None:
        self.inflight.remove(request_id, replica)

    def describe(self) -> str:
        changed = {
            f.name: getattr(self.config, f.name)
            for f in fields(self.config)
            if getattr(self.config, f.name) != f.default
        }
        if not changed:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in changed.items())

    def flags(self) -> dict[str, Any]:
        return asdict(self.config)

    # ---- shared measures ----------------------------------------------------------------
    def scraped_load(self, replicas: Sequence[ReplicaState], i: int) -> int:
        return replicas[i].num_requests + self.inflight.sent_since_scrape[i]

    def _candidates(self, replicas: Sequence[ReplicaState]) -> list[int]:
        self.inflight.observe(replicas)
        return healthy_indices(replicas)


class RoundRobinRouter(BaseRouter):
    """sgl-router / Dynamo ``round_robin``: a counter over the healthy replicas."""

    name = "round-robin"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._counter = 0

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        chosen = healthy[self._counter % len(healthy)]
        self._counter += 1
        return chosen


class RandomRouter(BaseRouter):
    """Uniform over the healthy replicas, from the router's own seeded stream."""

    name = "random"
    config_cls = SeedFlags

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        return self._rng.choice(self._candidates(replicas))


class LeastRequestsRouter(BaseRouter):
    """Fewest requests by scraped load (ties: the lowest index)."""

    name = "least-requests"

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        return min(healthy, key=lambda i: (self.scraped_load(replicas, i), i))


class VllmDpRouter(BaseRouter):
    """vLLM's own data-parallel balancer (``DPLBAsyncMPClient.get_core_engine_for_request``,
    vllm/v1/engine/core_client.py): the lowest ``4 x waiting + running`` from the counts the DP
    coordinator publishes, each request sent since counted as waiting (vLLM bumps its local
    copy), ties to the lowest rank (the scan starts at the client's index, 0 for one API server)."""

    name = "vllm-dp"

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        sent = self.inflight.sent_since_scrape

        def score(i: int) -> tuple[int, int]:
            return 4 * (replicas[i].num_waiting + sent[i]) + replicas[i].num_running, i

        return min(healthy, key=score)


class LeastKvRouter(BaseRouter):
    """Lowest scraped KV usage (ties: scraped load, then the lowest index)."""

    name = "least-kv"

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        return min(healthy, key=lambda i: (replicas[i].kv_usage, self.scraped_load(replicas, i), i))


class PowerOfTwoRouter(BaseRouter):
    """Two distinct healthy replicas drawn at random; the one with the lower scraped load (the
    first drawn on a tie)."""

    name = "power-of-two"
    config_cls = SeedFlags

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        if len(healthy) == 1:
            return healthy[0]
        a, b = self._rng.sample(healthy, 2)
        return b if self.scraped_load(replicas, b) < self.scraped_load(replicas, a) else a


class SessionRouter(BaseRouter):
    """Affinity by session (or user) id: rendezvous hashing of the id over the healthy replicas'
    names, so a session stays on its replica while it is healthy and only the sessions of a
    replica taken out move. Requests without an id go to the least scraped load."""

    name = "session"

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        if request.session_id is None:
            return min(healthy, key=lambda i: (self.scraped_load(replicas, i), i))
        return max(healthy, key=lambda i: _rendezvous_weight(request.session_id or "", replicas[i].name))


def _rendezvous_weight(session_id: str, replica_name: str) -> int:
    digest = hashlib.blake2b(f"{session_id}\x00{replica_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
