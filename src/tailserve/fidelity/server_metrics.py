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
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class HistogramTotals:
    """Every histogram's (sum of observations, number of observations) in one scrape."""

    totals: dict[str, tuple[float, float]]

    def first(self, names: tuple[str, ...]) -> str | None:
        """The first of ``names`` the server publishes."""
        return next((n for n in names if n in self.totals), None)

    def delta(self, since: HistogramTotals, name: str) -> tuple[float, float]:
        """(sum, count) observed under ``name`` between ``since`` and this scrape."""
        s1, c1 = self.totals.get(name, (0.0, 0.0))
        s0, c0 = since.totals.get(name, (0.0, 0.0))
        return s1 - s0, c1 - c0


def parse_histograms(text: str) -> HistogramTotals:
    """The ``_sum`` and ``_count`` of every histogram in a Prometheus text body.

    Raises ``ValueError`` for a body that is not Prometheus text."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                totals.setdefault(family.name, [0.0, 0.0])[0] += sample.value
            elif sample.name.endswith("_count"):
                totals.setdefault(family.name, [0.0, 0.0])[1] += sample.value
    return HistogramTotals({k: (v[0], v[1]) for k, v in totals.items()})
