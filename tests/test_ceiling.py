"""The throughput ceiling (tune/ceiling.py): the best flood run, in the workload's own rate units,
and a bound that no policy's completion rate passes."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import RateScaler
from tailserve.tune.ceiling import BUDGETS, FLOOD, ceiling_of, ceiling_specs
from tailserve.tune.sweep import RunOutcome, RunSpec, Sweep, make_backend

DEPLOYMENT = Deployment.of("Llama-3-8B", "H100-SXM", 1)
FLAGS = {"max_model_len": 8192}
N, N_LONG = 240, 24  # every tenth prompt is longer than the context: refused at any rate


@pytest.fixture(scope="module")
def flood(tmp_path_factory):
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("ceiling") / "trace.jsonl"
    rows = [
        {
            "arrival_time": round(i * 0.2, 3),
            "prompt_len": 9000 if i % 10 == 9 else int(rng.integers(200, 3000)),
            "max_tokens": int(rng.integers(16, 200)),
        }
        for i in range(N)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = WorkloadSpec("trace", trace_path=str(path))
    scaler = RateScaler.of(RunSpec(DEPLOYMENT, workload, PolicySpec.make("vllm", FLAGS)))
    specs = ceiling_specs(scaler, FLAGS)
    with Sweep(make_backend(1), quiet=True) as sweep:
        outcomes = sweep.run(specs)
    return {"scaler": scaler, "specs": specs, "outcomes": outcomes, "ceiling": ceiling_of(specs, outcomes)}


def test_the_ceiling_is_the_best_flood_run_counting_refused_requests(flood):
    specs, outcomes, ceiling = flood["specs"], flood["outcomes"], flood["ceiling"]
    assert [s.policy.flags["max_num_batched_tokens"] for s in specs] == list(BUDGETS)
    for s in specs:
        assert s.policy.name == "vllm" and s.policy.engine_flags == FLAGS
        assert s.workload.rate_scale == pytest.approx(FLOOD)
    for o in outcomes:
        # The trace's rate counts every request, so the ceiling does too.
        assert o.summary["num_requests"] == N and o.summary["num_rejected"] == N_LONG
    rates = [o.summary["num_requests"] / o.summary["duration_s"] for o in outcomes]
    assert ceiling.rate == max(rates)
    assert ceiling.policy == specs[rates.index(max(rates))].policy.label
    # The upper end: every request had started (its last admission), work still left.
    for o in outcomes:
        assert o.summary["last_admission_s"] < o.summary["duration_s"]
    assert ceiling.upper == max(o.summary["num_requests"] / o.summary["last_admission_s"] for o in outcomes)
    assert ceiling.upper > ceiling.rate


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "sglang", "tgi", "slo"])
def test_no_policy_completes_faster_than_the_ceiling(flood, policy):
    """Past the ceiling the queue grows: at twice its rate every policy's completion rate stays
    at (or, with another batch shape, a few percent around) the ceiling, far under the arrivals.
    A request TGI turns away (its ``max_concurrent_requests``) was not served: not counted."""
    ceiling = flood["ceiling"].rate
    spec = flood["scaler"].at(2 * ceiling, policy=PolicySpec.make(policy, FLAGS))
    summary = spec.execute().summary
    completed = (summary["num_requests"] - summary["num_turned_away"]) / summary["duration_s"]
    assert completed <= 1.05 * ceiling
    # Below it the deployment keeps up: the run ends soon after the last arrival.
    spec = flood["scaler"].at(0.5 * ceiling, policy=PolicySpec.make(policy, FLAGS))
    summary = spec.execute().summary
    assert summary["num_requests"] / summary["duration_s"] >= 0.45 * ceiling


def test_a_multi_turn_workload_has_no_ceiling():
    # Its later turns wait for think times, not for the rate: a flood queues nothing more.
    scaler = RateScaler.of(RunSpec(DEPLOYMENT, WorkloadSpec("multi-turn"), PolicySpec.make("vllm", {})))
    assert ceiling_specs(scaler) == []


def test_failed_or_empty_runs_give_no_ceiling(flood):
    spec = flood["specs"][0]
    failed = RunOutcome(spec.key, "vllm", {}, 0.0, error="does not fit")
    empty = RunOutcome(
        spec.key, "vllm", {"num_requests": 0, "duration_s": 0.0, "last_admission_s": None}, 0.0
    )
    assert ceiling_of([spec, spec], [failed, empty]) is None
    one = flood["outcomes"][1].summary
    only = ceiling_of([spec, spec], [failed, flood["outcomes"][1]])
    assert (only.rate, only.upper) == pytest.approx((N / one["duration_s"], N / one["last_admission_s"]))


def test_the_last_admission_is_the_same_streamed_or_not(flood):
    """A run's ``last_admission_s`` (the sweep adds it to the summary) from the requests and from
    the streaming store."""
    from tailserve.core.engine import EngineOptions

    spec = flood["specs"][1]
    streamed = replace(spec, options=EngineOptions(stream_finished=True)).execute().summary
    assert streamed["last_admission_s"] == flood["outcomes"][1].summary["last_admission_s"]
