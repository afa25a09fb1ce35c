"""A server's own latency histograms, read from its Prometheus ``/metrics`` text.

``calibrate --from-server`` times one request at a time; the engine's histograms hold the same
interval measured inside the server, without the network, the HTTP framing and the tokenizer.
Only each histogram's ``_sum`` and ``_count`` are read: their changes around one request are
that request's own figure, exactly (the buckets, 10 ms wide at best, are too coarse for a CPU
engine's 5 ms steps).

Names, newest first within each kind (vLLM v1 ``vllm/v1/metrics/loggers.py``; tailserve's server
uses vLLM's; SGLang's with ``--enable-metrics``):

- prefill: ``vllm:request_prefill_time_seconds`` (first scheduled -> first token: the prefill
  step alone, no queue), else the server's TTFT (``vllm:time_to_first_token_seconds``,
  ``sglang:time_to_first_token_seconds``), which one request at a time has no queue in either;
- decode: ``vllm:inter_token_latency_seconds`` (before vLLM 0.11
  ``vllm:time_per_output_token_seconds``, the same histogram), ``sglang:inter_token_latency_seconds``.

Series of several engines (vLLM's ``engine`` label under data parallelism) are summed.

Counters are kept too: ``vllm:prefix_cache_hits`` (tokens served from the prefix cache; SGLang's
``sglang:cached_tokens``) tells whether a probe's prompt prefix was cached; tailserve's
``tailserve_cpu_thread_seconds{threads}`` how long its CPU executor ran at each thread count (it
runs on the cores other processes leave free, so a client on the same machine slows it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFILL = (
    "vllm:request_prefill_time_seconds",
    "vllm:time_to_first_token_seconds",
    "sglang:time_to_first_token_seconds",
)
DECODE = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
)
THREAD_SECONDS = "tailserve_cpu_thread_seconds"
CACHE_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits", "sglang:cached_tokens")


@dataclass(frozen=True, slots=True)
class HistogramTotals:
    """Every histogram's (sum of observations, number of observations) in one scrape."""

    totals: dict[str, tuple[float, float]]
    counters: dict[str, float] = field(default_factory=dict)  # every counter's value (summed)
    thread_seconds: dict[int, float] = field(default_factory=dict)  # tailserve: seconds per count

    def first(self, names: tuple[str, ...]) -> str | None:
        """The first of ``names`` the server publishes as a histogram."""
        return next((n for n in names if n in self.totals), None)

    def counter_delta(self, since: HistogramTotals, names: tuple[str, ...]) -> float | None:
        """How far the first of ``names`` the server publishes as a counter moved since
        ``since``; None when it publishes none of them."""
        name = next((n for n in names if n in self.counters), None)
        if name is None:
            return None
        return self.counters[name] - since.counters.get(name, 0.0)

    def threads_since(self, since: HistogramTotals) -> dict[int, float]:
        """Seconds a tailserve CPU executor spent at each thread count since ``since`` (empty:
        the server publishes no such counter)."""
        out = {n: s - since.thread_seconds.get(n, 0.0) for n, s in self.thread_seconds.items()}
        return {n: s for n, s in out.items() if s > 0}

    def delta(self, since: HistogramTotals, name: str) -> tuple[float, float]:
        """(sum, count) observed under ``name`` between ``since`` and this scrape."""
        s1, c1 = self.totals.get(name, (0.0, 0.0))
        s0, c0 = since.totals.get(name, (0.0, 0.0))
        return s1 - s0, c1 - c0


def parse_histograms(text: str) -> HistogramTotals:
    """The ``_sum`` and ``_count`` of every histogram in a Prometheus text body, and every
    counter's value.

    Raises ``ValueError`` for a body that is not Prometheus text."""
    totals: dict[str, list[float]] = {}
    counters: dict[str, float] = {}
    threads: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counters[family.name] = counters.get(family.name, 0.0) + sample.value
                    if family.name == THREAD_SECONDS and sample.labels.get("threads", "").isdigit():
                        n = int(sample.labels["threads"])
                        threads[n] = threads.get(n, 0.0) + sample.value
            continue
        if family.type != "histogram":
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                totals.setdefault(family.name, [0.0, 0.0])[0] += sample.value
            elif sample.name.endswith("_count"):
                totals.setdefault(family.name, [0.0, 0.0])[1] += sample.value
    return HistogramTotals({k: (v[0], v[1]) for k, v in totals.items()}, counters, threads)
