"""The throughput ceiling: the most requests/s a deployment completes on a workload's requests.

Every request is queued from the start (the arrivals compressed ``FLOOD``-fold) and vLLM's
scheduler runs them at a few token budgets, so the GPU works flat out with the largest batches
its KV cache holds. Two figures bracket the most the deployment sustains on these requests:

- ``rate``, requests / (last finish - first arrival): a rate it demonstrably reaches. It counts
  the drain at the end (the last requests decoding in ever smaller batches), so it errs low — by
  about one long request's lifetime over the run (~8% on 4,000 mixed requests with outputs up
  to 1,500 tokens, ~0% on the Azure conversation trace).
- ``upper``, requests / (last admission - first arrival): every request had started by then, and
  the work still left is why it errs high. No scheduler sustains a higher arrival rate: above it
  the queue grows for as long as the traffic lasts, so a capacity above ``upper`` met its SLO only
  because the run ended first (``capacity.longer_workload`` shows the same from the other side).

The best of vLLM's budgets is taken for each (they are within a few percent of each other).
With prefix caching the flood finds a little fewer hits than paced traffic (an earlier turn of a
conversation may still be running when the next is admitted): on the Mooncake conversation trace
25.3% of prompt tokens against 27.5% at 5 requests/s (Llama-3-8B / H100), so there both figures
can err ~3% low.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.policies.registry import PolicySpec
from tailserve.tune.capacity import RateScaler
from tailserve.tune.sweep import RunOutcome, RunSpec

FLOOD = 1000.0  # x the workload's rate: every request waits from (nearly) the first iteration
BUDGETS = (1024, 2048, 8192)  # vLLM's max_num_batched_tokens tried; the best one counts


@dataclass(frozen=True, slots=True)
class Ceiling:
    rate: float  # requests/s, in the workload's own rate units (a trace's refused requests count)
    upper: float  # requests/s that no policy sustains on these requests (see above)
    policy: str  # the configuration that reached ``rate``


def ceiling_specs(scaler: RateScaler, engine_flags: dict[str, Any] | None = None) -> list[RunSpec]:
    """The flood runs for ``scaler``'s workload: vLLM at each of ``BUDGETS`` (its
    ``max_num_seqs`` following a smaller budget down, as tune sets it), with the workload's
    engine flags (``max_model_len``: the same requests are refused as in the capacity runs).
    Empty for a multi-turn workload, whose later turns wait for think times, not the rate."""
    from tailserve.tune.recommend import KNOBS, _max_model_len, _with_size  # recommend runs this module

    base = scaler.base
    if base.workload.name == "multi-turn":
        return []
    device = get_hardware(base.deployment.hardware).device_info
    vllm = PolicySpec.make("vllm", dict(engine_flags or {}))
    max_model_len = _max_model_len(vllm, get_model(base.deployment.model).max_position_embeddings)
    specs = []
    for budget in BUDGETS:
        spec = _with_size(vllm, KNOBS["vllm"], budget, device, max_model_len)
        specs.append(scaler.at(scaler.rate * FLOOD, policy=spec, slo=None))
    return specs


def ceiling_of(specs: Sequence[RunSpec], outcomes: Sequence[RunOutcome]) -> Ceiling | None:
    """The best of the flood runs, each end; None when none ran."""
    best: Ceiling | None = None
    for spec, outcome in zip(specs, outcomes):
        summary = outcome.summary
        if outcome.error is not None or not summary.get("duration_s") or not summary.get("last_admission_s"):
            continue
        n = summary["num_requests"]
        rate, upper = n / summary["duration_s"], n / summary["last_admission_s"]
        if best is None:
            best = Ceiling(rate, upper, spec.policy.label)
        else:
            label = spec.policy.label if rate > best.rate else best.policy
            best = Ceiling(max(rate, best.rate), max(upper, best.upper), label)
    return best
