"""The router's backends: what it knows of each (health, last scraped load, its own in-flight
count) and the loops that keep that knowledge fresh.

Health is checked two ways. Actively: ``GET /health`` every ``health_interval`` seconds (200 is
healthy; vLLM and ``tailserve serve`` answer 503 once their engine died, and a dead process does
not answer at all). Passively: a request that cannot reach a backend (connection refused or
reset, a connect timeout) takes it out at once, without waiting for the next check. A backend
taken out is put back by the first health check that passes.

Load comes from ``GET /metrics`` every ``scrape_interval`` seconds (``load.parse_load``); between
two scrapes the router sees the load as it was at the last one — the same staleness the cluster
simulator models — and ``ReplicaState.scraped_at`` says when that was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tailserve.cluster.routing import ReplicaState
from tailserve.router.load import BackendLoad, parse_load

logger = logging.getLogger("tailserve.router")


@dataclass(slots=True)
class Backend:
    url: str  # base URL, no trailing slash
    index: int  # position in the router's list, the replica index its router sees
    healthy: bool = False  # until the first health check passes
    load: BackendLoad | None = None  # at the last successful scrape
    scraped_at: float = 0.0  # router clock (time.monotonic), seconds
    in_flight: int = 0  # requests this router has open on it
    last_error: str = ""  # why it was taken out, for logs and /health

    def state(self, *, exclude: bool = False) -> ReplicaState:
        load = self.load or BackendLoad(0, 0, 0.0)
        return ReplicaState(
            replica_id=self.index,
            name=self.url,
            num_waiting=load.num_waiting,
            num_running=load.num_running,
            kv_usage=load.kv_usage,
            scraped_at=self.scraped_at,
            healthy=self.healthy and not exclude,
        )


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash or a ``/v1`` suffix; a bad URL is a ValueError."""
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--backend {url!r}: expected an http(s)://HOST:PORT URL")
    return url


class BackendPool:
    """The backends in a fixed order, with the health and scrape loops over them."""

    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        *,
        health_interval: float = 1.0,
        scrape_interval: float = 1.0,
        probe_timeout: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[Backend], None] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("give at least one --backend URL")
        normalized = [normalize_url(u) for u in urls]
        duplicates = sorted({u for u in normalized if normalized.count(u) > 1})
        if duplicates:
            raise ValueError(f"--backend {duplicates[0]} is given twice")
        for name, value in (("--health-interval", health_interval), ("--scrape-interval", scrape_interval)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        self.backends = [Backend(url, i) for i, url in enumerate(normalized)]
        self.client = client
        self.health_interval = health_interval  # seconds
        self.scrape_interval = scrape_interval  # seconds
        self.probe_timeout = probe_timeout  # seconds, for /health and /metrics
        self.clock = clock
        self.on_change = on_change  # called after a backend's health or load changed
        self._tasks: list[asyncio.Task] = []

    def states(self, exclude: set[int] = frozenset()) -> list[ReplicaState]:  # type: ignore[assignment]
        return [b.state(exclude=b.index in exclude) for b in self.backends]

    def mark_down(self, backend: Backend, reason: str) -> None:
        if backend.healthy:
            logger.warning("backend %s taken out: %s", backend.url, reason)
        backend.healthy = False
        backend.last_error = reason
        self._changed(backend)

    async def check_health(self, backend: Backend) -> bool:
        try:
            response = await self.client.get(f"{backend.url}/health", timeout=self.probe_timeout)
        except httpx.HTTPError as error:
            self.mark_down(backend, f"/health unreachable ({type(error).__name__})")
            return False
        if response.status_code != 200:
            self.mark_down(backend, f"/health answered {response.status_code}")
            return False
        if not backend.healthy and backend.last_error:
            logger.warning("backend %s is healthy again", backend.url)
        elif not backend.healthy:
            logger.info("backend %s is healthy", backend.url)
        backend.healthy = True
        self._changed(backend)
        return True

    async def scrape(self, backend: Backend) -> None:
        if not backend.healthy:
            return  # its load is not routed on; the health check brings it back first
        try:
            response = await self.client.get(f"{backend.url}/metrics", timeout=self.probe_timeout)
            response.raise_for_status()
            load = parse_load(response.text)
        except (httpx.HTTPError, ValueError) as error:
            logger.debug("scraping %s/metrics failed: %s", backend.url, error)
            return  # the last load stays, with its age in scraped_at
        if load is not None:
            backend.load = load
            backend.scraped_at = self.clock()
            self._changed(backend)

    async def refresh(self) -> None:
        """One health check and one scrape of every backend, concurrently."""
        await asyncio.gather(*(self.check_health(b) for b in self.backends))
        await asyncio.gather(*(self.scrape(b) for b in self.backends))

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every(self.health_interval, self.check_health)),
            asyncio.create_task(self._every(self.scrape_interval, self.scrape)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _every(self, interval: float, probe: Callable[[Backend], object]) -> None:
        while True:
            await asyncio.sleep(interval)
            outcomes = await asyncio.gather(*(probe(b) for b in self.backends), return_exceptions=True)  # type: ignore[misc]
            for backend, outcome in zip(self.backends, outcomes):
                if isinstance(outcome, Exception):  # a bug must not stop the loop for everyone
                    logger.error("probing %s failed", backend.url, exc_info=outcome)

    def _changed(self, backend: Backend) -> None:
        if self.on_change is not None:
            self.on_change(backend)
