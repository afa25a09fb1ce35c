"""Capacity planning over a GPU budget's layouts (aggregated and each P:D split)."""

from __future__ import annotations

from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
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


def test_tune_gpus_prints_and_saves_every_layout(tmp_path, capsys):
    import json

    from tailserve.cli import main

    out = tmp_path / "plan.json"
    argv = [
        "tune", "--gpus", "2", "--model", "Llama-3.1-8B", "--hardware", "H100", "--workload", "random",
        "--num-requests", "60", "--rate", "4", "--input-len", "uniform:200:2000", "--output-len",
        "uniform:20:200", "--slo", "ttft_p99=300ms", "--plan-router", "round-robin", "--rel-tol", "0.25",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2 aggregated" in text and "1 prefill + 1 decode" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["num_prefill"], r["num_decode"]) for r in rows] == [(2, 0), (1, 1)]
    assert all(r["capacity_rps"] > 0 and r["upper_rps"] > r["capacity_rps"] for r in rows)


def test_tune_gpus_errors_are_one_line(capsys):
    from tailserve.cli import main

    assert main(["tune", "--gpus", "0"]) == 2
    assert "--gpus must be >= 1, got 0" in capsys.readouterr().err
    assert main(["tune", "--gpus", "3", "--model", "Llama-3-70B", "--hardware", "A100", "--tp", "2"]) == 2
    assert "do not split into replicas of TP 2" in capsys.readouterr().err


def test_plan_tps_searches_the_replicas_parallelism(tmp_path, capsys):
    import json

    from tailserve.cli import main
    from tailserve.tune.cluster_plan import parallel_shapes

    moe = Deployment.of("Qwen3-235B-A22B", "H200")
    # TP 1 and 2 leave no room for the KV cache (470 GB of bf16 weights), 3 does not divide 8
    assert parallel_shapes(8, moe, [1, 2, 3, 4, 8], "both") == [(4, False), (4, True), (8, False), (8, True)]
    assert parallel_shapes(8, moe, [4, 8], "on") == [(4, True), (8, True)]
    dense = Deployment.of("Llama-3.1-8B", "H100")
    assert parallel_shapes(4, dense, [1, 2, 4], "both") == [(1, False), (2, False), (4, False)]  # no experts
    out = tmp_path / "plan.json"
    argv = [
        "tune", "--gpus", "2", "--model", "Mixtral-8x7B", "--hardware", "H100", "--workload", "random",
        "--num-requests", "40", "--rate", "2", "--input-len", "uniform:200:1000", "--output-len",
        "uniform:20:100", "--slo", "ttft_p99=2s", "--plan-tps", "1,2", "--rel-tol", "0.5", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "TP 1 left out: Mixtral-8x7B does not fit on H100-SXM at TP 1" in captured.err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["expert_parallel"], r["num_prefill"], r["num_decode"]) for r in rows] == [
        (2, False, 1, 0), (2, True, 1, 0),
    ]  # fmt: skip
    assert "1 aggregated x TP 2 EP" in captured.out
    assert main(["tune", "--gpus", "2", "--plan-tps", "x"]) == 2
    assert "--plan-tps takes TP degrees" in capsys.readouterr().err
