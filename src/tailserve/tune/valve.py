"""The admission valve: when arrivals outrun the engine, the smallest refusal that keeps the served
requests' TTFT within the SLO (``tailserve tune --valve``).

No scheduler order holds a TTFT bound above capacity: the queue grows for as long as the traffic
lasts. The engines' own valve refuses the excess with a 503 instead (``policies/vllm_admission.py``,
``policies/sglang_load.py``): vLLM 0.32's ``max_num_queued_tokens`` (its docs' rule: target TTFT x
prefill throughput) and SGLang's ``max_queued_requests``. For a policy and the workload's own rate
the search runs the engine without a valve; if that misses the SLO's TTFT terms, it finds the
largest valve setting that meets them (the fewest requests refused): ``capacity_steps``' doubling,
halving and bisection over the setting, within ``rel_tol`` of it, since a smaller valve refuses
more and queues less (monotone in expectation, as the rate search assumes). Only the TTFT terms
are asked for (a valve shortens queues, not decode steps); the refused share is reported beside.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

from tailserve.policies.registry import PolicySpec
from tailserve.tune.capacity import CapacitySlo, RateScaler, capacity_steps
from tailserve.tune.sweep import RunOutcome, RunSpec

# The policy's valve: its flag, the engine's flag, and where the search starts.
VALVES = {
    "vllm": ("max_num_queued_tokens", "--max-num-queued-tokens", 16384),
    "sglang": ("max_queued_requests", "--max-queued-requests", 64),
}


@dataclass(frozen=True, slots=True)
class Valve:
    policy: str  # the policy's label without the valve
    flag: str  # the engine's flag
    value: int | None  # None: no valve needed (the rate meets the TTFT terms) or none found
    needed: bool
    ttft: dict[str, float]  # the TTFT terms' measured seconds at ``value`` (or without a valve)
    refused: float  # the share of requests the valve refused at ``value``
    runs: int

    def line(self, rate: float) -> str:
        terms = ", ".join(f"ttft_{stat} {seconds:.3g} s" for stat, seconds in self.ttft.items())
        if not self.needed:
            return f"valve {self.policy}: none needed at {rate:.3g} req/s ({terms})"
        if self.value is None:
            return f"valve {self.policy}: {self.flag} cannot hold the TTFT bound at {rate:.3g} req/s"
        return (
            f"valve {self.policy}: {self.flag} {self.value:,} holds the TTFT bound at {rate:.3g} req/s "
            f"({terms}), refusing {self.refused:.1%} of the requests with 503 ({self.runs} runs)"
        )


def ttft_terms(slo: CapacitySlo) -> list[tuple[str, float]]:
    """The SLO's TTFT tail bounds, (stat, seconds)."""
    return [(stat, bound) for metric, stat, bound in slo.tails if metric == "ttft_s"]


def _measured(outcome: RunOutcome, terms: list[tuple[str, float]]) -> dict[str, float] | None:
    metrics = outcome.summary.get("metrics", {}).get("ttft_s")
    if outcome.error is not None or not metrics:
        return None
    return {stat: float(metrics[stat]) for stat, _ in terms}


def _meets(measured: dict[str, float] | None, terms: list[tuple[str, float]]) -> bool:
    # A valve so small that nobody is served holds no queue: it "meets", the search goes up.
    return measured is None or all(measured[stat] <= bound for stat, bound in terms)


def _refused(outcome: RunOutcome) -> float:
    n = outcome.summary.get("num_requests") or 0
    return (outcome.summary.get("num_turned_away") or 0) / n if n else 0.0


def valve_steps(
    scaler: RateScaler, policy: PolicySpec, slo: CapacitySlo, rel_tol: float = 0.05
) -> Generator[RunSpec, RunOutcome, Valve]:
    """The search as a coroutine (``Sweep.drive``): yields runs at the workload's rate, is sent
    their outcomes."""
    name, flag, start = VALVES[policy.name]
    terms = ttft_terms(slo)
    if not terms:
        raise ValueError("--valve needs a TTFT tail bound in --slo (e.g. ttft_p99=2s)")
    base = replace(policy, flags={k: v for k, v in policy.flags.items() if k != name})
    outcome = yield scaler.at(scaler.rate, policy=base, slo=None)
    runs = 1
    measured = _measured(outcome, terms)
    if measured is not None and _meets(measured, terms):
        return Valve(base.label, flag, None, False, measured, _refused(outcome), runs)
    search = capacity_steps(start, start, rel_tol, min_rate=1.0, max_rate=1e9)
    seen: dict[int, tuple[RunOutcome, bool]] = {}
    value = next(search)
    try:
        while True:
            setting = max(1, round(value))
            if setting not in seen:
                spec = replace(base, flags={**base.flags, name: setting})
                out = yield scaler.at(scaler.rate, policy=spec, slo=None)
                runs += 1
                seen[setting] = (out, _meets(_measured(out, terms), terms))
            value = search.send(seen[setting][1])
    except StopIteration as stop:
        found = stop.value.rate
    best = max((s for s, (_, ok) in seen.items() if ok and s <= max(found, 1.0)), default=None)
    if best is None:
        return Valve(base.label, flag, None, True, measured or {}, 0.0, runs)
    out = seen[best][0]
    return Valve(base.label, flag, best, True, _measured(out, terms) or {}, _refused(out), runs)


def valve_json(valve: Valve, rate: float) -> dict[str, Any]:
    return {
        "policy": valve.policy,
        "flag": valve.flag,
        "value": valve.value,
        "needed": valve.needed,
        "rate": rate,
        "ttft_s": valve.ttft,
        "refused_fraction": valve.refused,
        "runs": valve.runs,
    }
