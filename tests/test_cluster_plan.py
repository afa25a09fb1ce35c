"""Capacity planning over a GPU budget's layouts (aggregated and each P:D split)."""

from __future__ import annotations

from tailserve.policies.registry import PolicySpec
from tailserve.sim.deployment import Deployment
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import parse_capacity_slo
from tailserve.tune.cluster_plan import Layout, layouts, plan
from tailserve.workloads.lengths import Uniform


def test_layouts_cover_aggregated_and_every_split():
    assert layouts(3) == [Layout(3), Layout(1, 2), Layout(2, 1)]
    assert [x.label for x in layouts(2)] == ["2 aggregated", "1 prefill + 1 decode"]


def test_plan_finds_a_bracketed_rate_per_layout():
    spec = WorkloadSpec(
        "random", num_requests=60, rate=4.0, seed=3, input_len=Uniform(200, 2000), output_len=Uniform(20, 200)
    )
    slo = parse_capacity_slo("ttft_p99=300ms")
    rows = plan(
        2,
        Deployment.of("Llama-3.1-8B", "H100"),
        PolicySpec.make("vllm", {}),
        spec,
        slo,
        router="round-robin",
        rel_tol=0.25,
    )
    assert [r.layout for r in rows] == [Layout(2), Layout(1, 1)]
    for row in rows:
        assert row.rate > 0 and row.upper is not None and row.rate < row.upper <= row.rate / 0.75 + 1e-9
        assert row.summary_at_rate is not None and slo.meets(row.summary_at_rate)
