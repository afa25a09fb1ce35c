"""Capacity search: bisection on a known threshold, the SLO syntax, rate scaling, and a simulated
deployment whose capacity follows from its service time."""

from __future__ import annotations

import json
import math

import pytest

from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import (
    CapacitySearch,
    CapacitySlo,
    RateScaler,
    bisect_capacity,
    parse_capacity_slo,
    search_capacities,
)
from tailserve.tune.sweep import RunSpec, SerialBackend, Sweep, execute
from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import Fixed
from tailserve.workloads.traces import load_trace


# ---- bisection on a synthetic monotone function -------------------------------------------
@pytest.mark.parametrize("start", [0.01, 1.0, 7.3, 50.0, 900.0])
@pytest.mark.parametrize("threshold", [0.37, 7.3, 123.0])
def test_bisection_finds_a_known_threshold_from_any_start(start, threshold):
    calls = []

    def meets(rate):
        calls.append(rate)
        return rate <= threshold

    cap = bisect_capacity(meets, start, start, rel_tol=0.02)
    assert cap.rate <= threshold < cap.upper
    assert cap.upper - cap.rate <= 0.02 * cap.upper
    assert cap.bounded
    assert len(calls) == len(set(calls)), "no rate is tried twice"
    # bracketing is logarithmic in start/threshold, bisection in 1/rel_tol
    assert len(calls) <= abs(math.log2(start / threshold)) + 2 + math.log2(1 / 0.02) + 2
    assert [r for r, _ in cap.evaluations] == calls


def test_bisection_reports_unbounded_and_hopeless_searches():
    always = bisect_capacity(lambda r: True, 1.0, 1.0, max_rate=100.0)
    assert always.upper is None and 64.0 <= always.rate <= 100.0 and not always.bounded
    never = bisect_capacity(lambda r: False, 1.0, 1.0, min_rate=0.01)
    assert never.rate == 0.0 and never.upper is not None and never.upper < 0.02 and not never.bounded


def test_bisection_uses_a_given_bracket():
    cap = bisect_capacity(lambda r: r <= 3.0, 2.0, 4.0, rel_tol=0.01)
    assert cap.evaluations[:2] == ((2.0, True), (4.0, False))
    assert cap.rate <= 3.0 < cap.upper


@pytest.mark.parametrize(
    ("lo", "hi", "tol"), [(0.0, 1.0, 0.05), (2.0, 1.0, 0.05), (1.0, 1.0, 0.0), (1.0, 1.0, 1.5)]
)
def test_bisection_rejects_a_bad_bracket_or_tolerance(lo, hi, tol):
    with pytest.raises(ValueError):
        bisect_capacity(lambda r: True, lo, hi, rel_tol=tol)


# ---- the SLO ------------------------------------------------------------------------------
def summary(ttft_p99=1.0, itl_p99=0.1, good=1.0, turned_away=0):
    metrics = {name: {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0} for name in
               ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")}  # fmt: skip
    metrics["ttft_s"]["p99"] = ttft_p99
    metrics["itl_s"]["p99"] = itl_p99
    return {"metrics": metrics, "goodput": {"fraction_good": good}, "num_turned_away": turned_away}


def test_slo_parses_tail_bounds_and_goodput():
    slo = parse_capacity_slo("ttft_p99=2s,tbt_p99=200ms")
    assert slo.tails == (("ttft_s", "p99", 2.0), ("itl_s", "p99", 0.2)) and slo.request is None
    assert slo.ratio(summary(1.0, 0.1)) == pytest.approx(0.5)
    assert slo.ratio(summary(1.0, 0.3)) == pytest.approx(1.5) and not slo.meets(summary(1.0, 0.3))
    assert not slo.meets(summary(turned_away=1)), "a request turned away misses the SLO"
    good = parse_capacity_slo("ttft=2s,tpot=100,goodput=95%")
    assert good.request.ttft == 2.0 and good.request.tpot == pytest.approx(0.1)
    assert good.min_good_fraction == pytest.approx(0.95)
    assert good.meets(summary(good=0.96)) and not good.meets(summary(good=0.9))
    assert "95% of requests" in str(good)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ttft_p99", "expected NAME=VALUE"),
        ("ttft_p42=2s", "METRIC_STAT=TIME"),
        ("latency_p99=2s", "METRIC_STAT=TIME"),
        ("ttft_p99=fast", "not a time"),
        ("ttft_p99=-1s", ">= 0"),
        ("goodput=90%", "needs per-request bounds"),
        ("ttft=2s,goodput=1.5", "goodput must be in (0, 1]"),
    ],
)
def test_bad_slo_strings_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_capacity_slo(text)


def test_an_slo_needs_a_bound():
    with pytest.raises(ValueError, match="sets no bound"):
        CapacitySlo()


# ---- rate scaling -------------------------------------------------------------------------
def test_synthetic_workload_rescales_arrivals_only():
    base = RunSpec(Deployment(), WorkloadSpec("chat", num_requests=20, rate=2.0), PolicySpec("vllm"))
    scaler = RateScaler.of(base)
    assert scaler.rate == 2.0
    assert scaler.at(8.0).workload.rate == 8.0
    assert scaler.at(8.0).workload.seed == base.workload.seed


def test_trace_is_time_scaled_to_the_asked_rate(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(json.dumps({"arrival_time": t, "prompt_len": 100, "max_tokens": 10}) for t in range(0, 10))
    )
    base = RunSpec(Deployment(), WorkloadSpec("trace", trace_path=str(path)), PolicySpec("vllm"))
    scaler = RateScaler.of(base)
    assert scaler.rate == pytest.approx(10 / 9)
    spec = scaler.at(5.0).workload
    trace = load_trace(path, rate_scale=spec.rate_scale)
    assert len(trace) / (trace[-1].arrival_time - trace[0].arrival_time) == pytest.approx(5.0)


def test_fixed_scenarios_have_no_rate_to_search():
    with pytest.raises(ValueError, match="hol workload"):
        RateScaler.of(RunSpec(Deployment(), WorkloadSpec("hol"), PolicySpec("vllm")))
    closed = WorkloadSpec("random", arrival=ArrivalSpec("closed", concurrency=4))
    with pytest.raises(ValueError, match="closed-loop"):
        RateScaler.of(RunSpec(Deployment(), closed, PolicySpec("vllm")))


# ---- a simulated case with a threshold we can compute ----------------------------------------
def test_simulated_capacity_matches_the_service_time():
    """One request at a time (max_num_seqs 1), one output token, constant arrivals: each request
    takes exactly one prefill iteration of S seconds. Below 1/S nobody waits (TTFT = S); above it
    request i waits i(S - 1/r), so the last of N has TTFT = N·S - (N-1)/r, and max TTFT <= 1.5 S
    holds exactly up to r* = (N - 1) / ((N - 1.5) S)."""
    n = 50
    deployment = Deployment("Llama-3-8B", "H100-SXM", 1)
    policy = PolicySpec.make("vllm", {"max_num_seqs": 1, "max_num_batched_tokens": 2048})
    workload = WorkloadSpec(
        "random",
        num_requests=n,
        rate=1.0,
        input_len=Fixed(1000),
        output_len=Fixed(1),
        arrival=ArrivalSpec("constant"),
    )
    alone = execute(
        RunSpec(
            deployment,
            WorkloadSpec("random", num_requests=1, input_len=Fixed(1000), output_len=Fixed(1)),
            policy,
        )
    )
    service = alone.summary["metrics"]["ttft_s"]["max"]
    expected = (n - 1) / ((n - 1.5) * service)

    slo = parse_capacity_slo(f"ttft_max={1.5 * service * 1000}ms")
    search = CapacitySearch(RateScaler.of(RunSpec(deployment, workload, policy)), slo, rel_tol=0.01)
    with Sweep(SerialBackend(), quiet=True) as sweep:
        (cap,) = search_capacities(sweep, [search])
    assert cap.rate <= expected < cap.upper
    assert cap.upper - cap.rate <= 0.01 * cap.upper
    # every run below capacity met the SLO, every run above missed it
    for rate, outcome in search.outcomes.items():
        assert slo.meets(outcome.summary) == (rate <= expected)
