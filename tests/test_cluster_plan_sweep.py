"""``tune --gpus``'s cluster runs on the sweep backends: the same rows serially, on the process
pool and on Ray, and resumed from a results file."""

from __future__ import annotations

import pytest

from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import parse_capacity_slo
from tailserve.tune.cluster_plan import ClusterRunSpec, Layout, plan
from tailserve.tune.sweep import ProcessBackend, Sweep, make_backend
from tailserve.workloads.lengths import Uniform

SPEC = WorkloadSpec(
    "random", num_requests=40, rate=4.0, seed=5, input_len=Uniform(200, 1500), output_len=Uniform(10, 80)
)
SLO = parse_capacity_slo("ttft_p99=300ms")
DEPLOYMENT = Deployment.of("Llama-3.1-8B", "H100")
POLICY = PolicySpec.make("vllm", {})


def _plan(sweep: Sweep | None = None) -> list:
    return plan(2, DEPLOYMENT, POLICY, SPEC, SLO, router="round-robin", rel_tol=0.3, sweep=sweep)


@pytest.fixture(scope="module")
def serial_rows() -> list:
    return _plan()


def _simulated(summary: dict) -> dict:
    """The summary less this machine's clock (wall_s, cpu_s)."""
    return {k: v for k, v in summary.items() if k not in ("wall_s", "cpu_s")}


def _same(rows: list, expected: list) -> None:
    assert [(r.layout, r.rate, r.upper) for r in rows] == [(r.layout, r.rate, r.upper) for r in expected]
    assert [_simulated(r.summary_at_rate) for r in rows] == [_simulated(r.summary_at_rate) for r in expected]


def test_the_process_pool_plans_what_serial_plans(serial_rows):
    with Sweep(ProcessBackend(2), quiet=True) as sweep:
        _same(_plan(sweep), serial_rows)
        assert sweep.num_executed >= 4  # both layouts' brackets and bisections ran there


def test_ray_plans_what_serial_plans(serial_rows):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with Sweep(make_backend(ray_address="auto"), quiet=True) as sweep:
            rows = _plan(sweep)
            assert sweep.num_executed >= 4  # the runs went to Ray's workers, not a cache
        _same(rows, serial_rows)
    finally:
        ray.shutdown()


def test_cluster_specs_are_keyed_by_what_decides_the_run():
    a = ClusterRunSpec(Layout(2), DEPLOYMENT, POLICY, SPEC, "round-robin", "ib-ndr")
    assert a.key == ClusterRunSpec(Layout(2), DEPLOYMENT, POLICY, SPEC, "round-robin", "ib-ndr").key
    assert a.key != ClusterRunSpec(Layout(1, 1), DEPLOYMENT, POLICY, SPEC, "round-robin", "ib-ndr").key
    assert a.key != ClusterRunSpec(Layout(2), DEPLOYMENT, POLICY, SPEC, "random", "ib-ndr").key


def test_tune_gpus_resumes_from_its_results_file(tmp_path, capsys):
    from tailserve.cli import main

    out = tmp_path / "runs.jsonl"
    argv = [
        "tune", "--gpus", "2", "--model", "Llama-3.1-8B", "--hardware", "H100", "--workload", "random",
        "--num-requests", "40", "--rate", "4", "--input-len", "uniform:200:1500", "--output-len",
        "uniform:10:80", "--slo", "ttft_p99=300ms", "--plan-router", "round-robin", "--rel-tol", "0.3",
        "--workers", "1", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    again = capsys.readouterr()
    assert "runs: 0 simulated" in again.err and " reused from " in again.err
    assert again.out == first.out  # the same table from the saved summaries


def test_a_goodput_slo_plans_a_capacity():
    # Cluster runs used to carry no per-request SLO, so their summaries had no goodput and a
    # ttft=...,tpot=... SLO found every layout's capacity "none".
    slo = parse_capacity_slo("ttft=300ms,tpot=100ms,goodput=90%")
    rows = plan(2, DEPLOYMENT, POLICY, SPEC, slo, router="round-robin", rel_tol=0.3)
    assert all(r.rate > 0 for r in rows)
    for row in rows:
        assert row.summary_at_rate["goodput"]["fraction_good"] >= 0.9
    upper = [r for r in rows if r.upper is not None]
    assert upper, "the SLO binds below the search's top rate, so the test sees a real bisection"


def test_a_tail_slo_keeps_its_keys():
    # Results files of tail-SLO plans written before cluster specs carried an SLO still resume.
    spec = ClusterRunSpec(Layout(2), DEPLOYMENT, POLICY, SPEC, "round-robin", "ib-ndr")
    assert "slo" not in spec.describe()
    with_slo = ClusterRunSpec(
        Layout(2), DEPLOYMENT, POLICY, SPEC, "round-robin", "ib-ndr", parse_capacity_slo("ttft=2s").request
    )
    assert with_slo.key != spec.key
