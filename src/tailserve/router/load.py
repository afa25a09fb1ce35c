"""A backend's load, read from its Prometheus ``/metrics`` text with vLLM's metric names.

What a real router can know about a vLLM-compatible server is what the server publishes:

- ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (gauges);
- ``vllm:kv_cache_usage_perc`` (a fraction 0..1; vLLM before 0.9 called it
  ``vllm:gpu_cache_usage_perc``, which is read when the new name is absent);
- SGLang's ``sglang:num_running_reqs``, ``sglang:num_queue_reqs`` and ``sglang:token_usage``, so
  SGLang servers can be routed by load as well.

A server may publish one series per engine (vLLM's ``engine`` label under data parallelism):
the gauges are summed over them (KV usage averaged). A text without any of the names is
``None``: the backend is up but says nothing about its load.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# (running, waiting, KV usage) names of each family, newest first.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


@dataclass(frozen=True, slots=True)
class BackendLoad:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of the KV cache in use, 0..1


def parse_load(text: str) -> BackendLoad | None:
    """The load in a ``/metrics`` body; ``None`` when it holds none of the names above.

    Raises ``ValueError`` for a body that is not Prometheus text."""
    samples: dict[str, list[float]] = {}
    wanted = {*RUNNING, *WAITING, *KV_USAGE}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            samples.setdefault(family.name, []).extend(s.value for s in family.samples)

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((samples[n] for n in names if n in samples), None)

    running, waiting, usage = first(RUNNING), first(WAITING), first(KV_USAGE)
    if running is None and waiting is None and usage is None:
        return None
    return BackendLoad(
        num_running=int(sum(running or ())),
        num_waiting=int(sum(waiting or ())),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
    )
