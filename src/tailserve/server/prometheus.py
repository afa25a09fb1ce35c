"""``/metrics``: vLLM's Prometheus metric names and meanings, so dashboards and routers work as is.

Every series carries vLLM's labels ``model_name`` (the served name) and ``engine`` ("0": one
engine). Counters get ``_total`` on exposition, as in vLLM (``vllm:prompt_tokens_total``).
Intervals follow vLLM's ``docs/design/metrics.md``, all on the engine's clock:

- TTFT = first token - arrival; ITL = each gap between consecutive tokens of a request;
- E2E = finish - arrival; queue = first scheduled - arrival; prefill = first token - first
  scheduled; decode = finish - first token; inference = finish - first scheduled.

Latency histograms are observed as tokens arrive (TTFT, ITL) or at a normal finish (the rest);
aborted requests count only in ``vllm:request_success{finished_reason="abort"}``, and those whose
engine step failed (a 500) in ``finished_reason="error"`` (vLLM's ``FinishReason.ERROR``). Gauges
and the prefix-cache / preemption counters follow ``LLMEngine.stats()`` after every step. Each
server owns its registry, so several servers can live in one process (tests do).

Our own counters (no vLLM equivalent) account for every generation request (``POST
/v1/completions`` and ``/v1/chat/completions``): ``tailserve_requests_received_total``, and
``tailserve_requests_rejected_total{reason}`` for each one answered before the engine took it.
Once the server is idle, received = the sum of ``vllm:request_success`` (stop, length, abort,
error) + the sum of rejected. Reasons: ``invalid`` (400), ``unauthorized`` (401), ``timeout``
(a 408 through the app), ``too_large`` (413), ``overloaded`` (503 from the concurrency limit, or
a 429), ``queue_full`` (also vLLM's admission limits' 503), ``shutting_down`` and ``engine_dead`` (503s), ``error`` (a 500 before the
engine took it) and ``client_disconnected`` (gone before an answer: while sending its body, say,
or cut off by the body timeout, whose 408 the connection sends itself). A connection refused
before it reaches the app (none is, by default) is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tailserve.llm import EngineStats, RequestOutput

# Buckets of vLLM v1 (vllm/v1/metrics/loggers.py), seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = (
    "invalid",
    "unauthorized",
    "too_large",
    "timeout",
    "overloaded",
    "queue_full",
    "shutting_down",
    "engine_dead",
    "error",
    "client_disconnected",
)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_STATUS_REASONS = {
    400: "invalid",
    401: "unauthorized",
    408: "timeout",
    413: "too_large",
    429: "overloaded",
    503: "overloaded",
}
_OUTCOME = "tailserve_outcome"  # in the request's scope state: "accepted" or a reject reason


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        names = ["model_name", "engine"]
        values = (model_name, "0")
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*values)

        self.num_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
            "number of cached tokens.",
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        # Not vLLM's: the torch executor on a CPU runs on the cores other processes leave free, so
        # its speed follows the machine's load; these say how many it had, and for how long.
        self.cpu_threads = gauge("tailserve_cpu_threads", "CPU threads the torch executor steps with now.")
        thread_seconds = Counter(
            "tailserve_cpu_thread_seconds",
            "Wall seconds the torch executor spent at each CPU thread count.",
            [*names, "threads"],
            registry=r,
        )
        self._thread_seconds = lambda n: thread_seconds.labels(*values, str(n))
        self._last_thread_seconds: dict[int, float] = {}
        self.requests_received = counter(
            "tailserve_requests_received",
            "Generation requests received (POST /v1/completions and /v1/chat/completions).",
        )
        rejected = Counter(
            "tailserve_requests_rejected",
            "Generation requests answered with an error before the engine took them, by reason.",
            [*names, "reason"],
            registry=r,
        )
        self.requests_rejected = {reason: rejected.labels(*values, reason) for reason in REJECT_REASONS}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_BUCKETS,
        )
        # Engine counters are cumulative; the Prometheus counters advance by their differences.
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0
        self._last_external = (0, 0)

    def observe_outputs(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            num_new = len(out.new_token_ids)
            times = out.token_times
            start = len(times) - num_new  # index of this output's first new token
            if num_new:
                self.generation_tokens.inc(num_new)
                if start == 0 and out.first_token_time is not None:
                    self.ttft.observe(out.first_token_time - out.arrival_time)
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                for i in range(max(start, 1), len(times)):
                    self.itl.observe(times[i] - times[i - 1])
            if out.finished and out.finish_reason in ("stop", "length"):
                self._observe_finish(out)

    def _observe_finish(self, out: RequestOutput) -> None:
        self.request_success[out.finish_reason or "stop"].inc()
        if out.finish_time is None:
            return
        self.e2e.observe(out.finish_time - out.arrival_time)
        scheduled = out.first_scheduled_time
        if scheduled is not None:
            self.queue.observe(scheduled - out.arrival_time)
            self.inference.observe(out.finish_time - scheduled)
            if out.first_token_time is not None:
                self.prefill.observe(out.first_token_time - scheduled)
        if out.first_token_time is not None:
            self.decode.observe(out.finish_time - out.first_token_time)

    def observe_abort(self) -> None:
        self.request_success["abort"].inc()

    def observe_failed(self, num_requests: int) -> None:
        """Requests whose engine step failed (each answered with a 500)."""
        self.request_success["error"].inc(num_requests)

    def observe_stats(self, stats: EngineStats) -> None:
        """Gauges and cumulative counters from ``LLMEngine.stats()``."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        queries, hits, preemptions = (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
            stats.num_preemptions,
        )
        if queries > self._last_queries:
            self.prefix_queries.inc(queries - self._last_queries)
        if hits > self._last_hits:
            self.prefix_hits.inc(hits - self._last_hits)
        if preemptions > self._last_preemptions:
            self.preemptions.inc(preemptions - self._last_preemptions)
        self._last_queries, self._last_hits, self._last_preemptions = queries, hits, preemptions
        external = (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits)
        for counter, now, last in zip(
            (self.external_queries, self.external_hits), external, self._last_external
        ):
            if now > last:
                counter.inc(now - last)
        self._last_external = external
        for threads, seconds in stats.cpu_thread_seconds:
            gained = seconds - self._last_thread_seconds.get(threads, 0.0)
            if gained > 0:
                self._thread_seconds(threads).inc(gained)
                self._last_thread_seconds[threads] = seconds
        if stats.cpu_threads:
            self.cpu_threads.set(stats.cpu_threads)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def mark_accepted(request: Any) -> None:
    """The engine took the request: its outcome is counted there (finished, aborted or failed)."""
    request.scope.setdefault("state", {})[_OUTCOME] = "accepted"


def mark_rejected(request: Any, reason: str) -> None:
    """The reason the error response about to be sent refuses the request (else its status's)."""
    assert reason in REJECT_REASONS, reason
    request.scope.setdefault("state", {})[_OUTCOME] = reason


class RequestCounter:
    """ASGI middleware (outermost) counting generation requests received, and rejected by reason:
    an error response to a request not marked accepted, or no response at all."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.metrics.requests_received.inc()
        state = scope.setdefault("state", {})
        counted = False

        def reject(reason: str) -> None:
            nonlocal counted
            if not counted and state.get(_OUTCOME) != "accepted":
                self.metrics.requests_rejected[reason].inc()
            counted = True

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not counted:
                status = message["status"]
                if status >= 400:
                    marked = state.get(_OUTCOME)
                    reject(marked if marked in REJECT_REASONS else _STATUS_REASONS.get(status, "error"))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            reject("error")  # a bug: the server's error handler answers 500
            raise
        finally:
            reject("client_disconnected")  # a no-op once the request was answered or accepted
