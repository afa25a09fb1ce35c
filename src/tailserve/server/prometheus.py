"""``/metrics``: vLLM's Prometheus metric names and meanings, so dashboards and routers work as is.

Every series carries vLLM's labels ``model_name`` (the served name) and ``engine`` ("0": one
engine). Counters get ``_total`` on exposition, as in vLLM (``vllm:prompt_tokens_total``).
Intervals follow vLLM's ``docs/design/metrics.md``, all on the engine's clock:

- TTFT = first token - arrival; ITL = each gap between consecutive tokens of a request;
- E2E = finish - arrival; queue = first scheduled - arrival; prefill = first token - first
  scheduled; decode = finish - first token; inference = finish - first scheduled.

Latency histograms are observed as tokens arrive (TTFT, ITL) or at a normal finish (the rest);
aborted requests count only in ``vllm:request_success{finished_reason="abort"}``. Gauges and
the prefix-cache / preemption counters follow ``LLMEngine.stats()`` after every step. Each
server owns its registry, so several servers can live in one process (tests do).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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

FINISH_REASONS = ("stop", "length", "abort")


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

    def render(self) -> bytes:
        return generate_latest(self.registry)
