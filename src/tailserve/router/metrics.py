"""The router's own ``/metrics`` (Prometheus text), one series per backend.

| name | type | labels | what |
|---|---|---|---|
| ``tailserve_router_requests_total`` | counter | backend, outcome | requests that ended on a backend: ``ok`` (2xx), ``client_error`` (4xx passed through), ``backend_error`` (a 5xx, or a failure mid-response), ``cancelled`` (the client left) |
| ``tailserve_router_requests_in_flight`` | gauge | backend | requests open on the backend now |
| ``tailserve_router_errors_total`` | counter | backend, kind | ``connect`` (not reached: retried), ``unavailable`` (a 503 before accepting: retried), ``timeout``, ``disconnect`` (the backend went away mid-response) |
| ``tailserve_router_retries_total`` | counter | backend | requests sent elsewhere after this backend did not accept them |
| ``tailserve_router_routing_decisions_total`` | counter | policy, backend | backends the router chose |
| ``tailserve_router_backend_healthy`` | gauge | backend | 1 while in service, 0 while taken out |
| ``tailserve_router_backend_num_requests_running`` / ``_waiting`` / ``_kv_cache_usage_perc`` | gauge | backend | the load at the last scrape (vLLM's names after the prefix) |
| ``tailserve_router_backend_scrape_timestamp_seconds`` | gauge | backend | when that scrape was (router clock, seconds) |
| ``tailserve_router_rejected_total`` | counter | reason | requests answered by the router itself: ``no_backend`` (503), ``bad_request`` (400) |

Each router owns its registry, so several can live in one process (the tests run some).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tailserve.router.backends import Backend

OUTCOMES = ("ok", "client_error", "backend_error", "cancelled")
ERROR_KINDS = ("connect", "unavailable", "timeout", "disconnect")


class RouterMetrics:
    def __init__(self, backends: list[str], policy: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.policy = policy
        self.requests = Counter(
            "tailserve_router_requests",
            "Requests that ended on a backend.",
            ["backend", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tailserve_router_requests_in_flight", "Requests open on a backend.", ["backend"], registry=r
        )
        self.errors = Counter(
            "tailserve_router_errors", "Backend failures by kind.", ["backend", "kind"], registry=r
        )
        self.retries = Counter(
            "tailserve_router_retries",
            "Requests sent to another backend after this one did not accept them.",
            ["backend"],
            registry=r,
        )
        self.decisions = Counter(
            "tailserve_router_routing_decisions",
            "Backends chosen by the router.",
            ["policy", "backend"],
            registry=r,
        )
        self.healthy = Gauge(
            "tailserve_router_backend_healthy", "1 while the backend is in service.", ["backend"], registry=r
        )
        self.running = Gauge(
            "tailserve_router_backend_num_requests_running",
            "vllm:num_requests_running at the last scrape.",
            ["backend"],
            registry=r,
        )
        self.waiting = Gauge(
            "tailserve_router_backend_num_requests_waiting",
            "vllm:num_requests_waiting at the last scrape.",
            ["backend"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "tailserve_router_backend_kv_cache_usage_perc",
            "vllm:kv_cache_usage_perc at the last scrape.",
            ["backend"],
            registry=r,
        )
        self.scraped_at = Gauge(
            "tailserve_router_backend_scrape_timestamp_seconds",
            "When the backend was last scraped (router clock).",
            ["backend"],
            registry=r,
        )
        self.rejected = Counter(
            "tailserve_router_rejected", "Requests the router answered itself.", ["reason"], registry=r
        )
        for url in backends:  # every series exists from the start, at 0
            for outcome in OUTCOMES:
                self.requests.labels(url, outcome)
            for kind in ERROR_KINDS:
                self.errors.labels(url, kind)
            self.retries.labels(url)
            self.decisions.labels(policy, url)
            self.in_flight.labels(url).set(0)
            self.healthy.labels(url).set(0)
        for reason in ("no_backend", "bad_request"):
            self.rejected.labels(reason)

    def observe_backend(self, backend: Backend) -> None:
        self.healthy.labels(backend.url).set(1 if backend.healthy else 0)
        if backend.load is not None:
            self.running.labels(backend.url).set(backend.load.num_running)
            self.waiting.labels(backend.url).set(backend.load.num_waiting)
            self.kv_usage.labels(backend.url).set(backend.load.kv_usage)
            self.scraped_at.labels(backend.url).set(backend.scraped_at)

    def render(self) -> bytes:
        return generate_latest(self.registry)
