"""``tune --gpus N --plan-pp 1,2``: capacity plans over pipeline-parallel layouts (replicas of
TP x PP GPUs, aggregated only when PP > 1, the fit judged on the fullest stage)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import parse_capacity_slo
from tailserve.tune.cluster_plan import (
    ClusterRunSpec,
    Layout,
    layout_deployment,
    layouts,
    parallel_shapes,
    plan,
    replica_layouts,
    unfit,
)
from tailserve.workloads.lengths import Uniform

# Falcon-180B's bf16 weights (334 GiB) leave no KV room at TP 4 on H100-SXM; half its 80 layers
# per stage do (TP 4 x PP 2)
FALCON = Deployment.of("Falcon-180B", "H100-SXM", tp=4)
SMALL = WorkloadSpec(
    "random", num_requests=12, rate=2.0, seed=1, input_len=Uniform(100, 400), output_len=Uniform(5, 20)
)
VLLM = PolicySpec.make("vllm", {})


def test_layouts_and_labels_with_pp():
    # PP > 1: the aggregated replicas only (P/D splits under PP are not simulated)
    assert layouts(2, 8, False, 2) == [Layout(2, 0, 8, pp=2)]
    assert layouts(2, 8, False, 1) == [Layout(2, 0, 8, pp=1), Layout(1, 1, 8, pp=1)]
    assert Layout(2, 0, 8, pp=2).label == "2 aggregated x TP 8 x PP 2"
    assert Layout(1, 1, 8, pp=1).label == "1 prefill + 1 decode x TP 8 x PP 1"  # PP 1 shown: rows compare
    assert Layout(4, pp=1).label == "4 aggregated x PP 1"
    assert Layout(1, 0, 4, True, 2, pp=1).label == "1 engine x DP 2 x TP 4 EP x PP 1"
    assert Layout(2, 0, 8, True, eplb=0, pp=2).label == "2 aggregated x TP 8 EP x PP 2, EPLB +0 experts"
    # without a plan of PP sizes the labels are as before
    assert [x.label for x in layouts(2)] == ["2 aggregated", "1 prefill + 1 decode"]
    assert Layout(2, 0, 8).label == "2 aggregated x TP 8"


def test_a_tp_that_does_not_fit_alone_fits_with_pp():
    assert 4 in unfit(FALCON, [4, 8]) and 8 not in unfit(FALCON, [4, 8])
    assert unfit(FALCON, [4, 8], pp=2) == {}
    assert unfit(FALCON, [4], pp=81) == {4: "PP 81 is more stages than Falcon-180B's 80 layers"}
    assert parallel_shapes(16, FALCON, [4, 8], "off") == [(8, False)]
    assert parallel_shapes(16, FALCON, [4, 8], "off", pp=2) == [(4, False), (8, False)]
    # The plan's layouts: each TP's PP sizes after its PP 1 layouts; TP 4 only at PP 2
    found = replica_layouts(16, FALCON, [4, 8], "off", [1, 2])
    assert [x.label for x in found] == [
        "2 aggregated x TP 4 x PP 2",
        "2 aggregated x TP 8 x PP 1",
        "1 prefill + 1 decode x TP 8 x PP 1",
        "1 aggregated x TP 8 x PP 2",
    ]
    # without --plan-tps: the deployment's TP at each PP size that fits
    assert replica_layouts(16, FALCON, pps=[1, 2, 4]) == [Layout(2, pp=2), Layout(1, pp=4)]
    with pytest.raises(ValueError, match=r"no TP 4 x PP of \[1\] splits 16 GPUs"):
        replica_layouts(16, FALCON, pps=[1])
    # the layout runs as TP 4 x PP 2: every request served, the KV sized on a 40-layer stage
    deployment = layout_deployment(Layout(1, pp=2), FALCON)
    assert (deployment.tp, deployment.pp, deployment.gpus) == (4, 2, 8)
    outcome = ClusterRunSpec(Layout(1, pp=2), FALCON, VLLM, SMALL, "round-robin", "ib-ndr").execute()
    assert outcome.error is None and outcome.summary["num_finished"] == SMALL.num_requests
    alone = ClusterRunSpec(Layout(1, pp=1), FALCON, VLLM, SMALL, "round-robin", "ib-ndr").execute()
    assert alone.error is not None and "does not fit on H100-SXM at TP 4" in alone.error


def test_a_deployments_own_pp_plans_aggregated_replicas_of_tp_x_pp():
    own = Deployment.of("Llama-3-8B", "H100-SXM", tp=2, pp=2)
    assert replica_layouts(8, own) == [Layout(2)]  # 2 replicas of 4 GPUs, no P/D split, labels as before
    assert replica_layouts(8, own, [1, 2]) == [Layout(4, 0, 1), Layout(2, 0, 2)]
    with pytest.raises(ValueError, match="6 GPUs do not split into replicas of TP 2 x PP 2"):
        replica_layouts(6, own)
    # --plan-pp replaces the deployment's PP: PP 1 layouts get their P/D splits back
    assert replica_layouts(4, own, pps=[1]) == [Layout(2, pp=1), Layout(1, 1, pp=1)]
    # DP engines (--plan-dp) stay PP 1
    moe = Deployment.of("Mixtral-8x7B", "H100-SXM", tp=2, pp=2)
    assert layout_deployment(Layout(1, 0, 4, False, 2), moe).pp == 1
    assert layout_deployment(Layout(2), moe).pp == 2


def test_pp_needs_a_policy_simulated_under_stages():
    slo = parse_capacity_slo("ttft_p99=1s")
    sglang = PolicySpec.make("sglang", {})
    with pytest.raises(ValueError, match="--plan-policy vllm") as error:
        plan(8, Deployment.of("Llama-3-8B", "H100-SXM", tp=4), sglang, SMALL, slo, pps=[1, 2])
    assert "\n" not in str(error.value)
    assert "orca, vllm-v0, vllm, sarathi, trtllm" in str(error.value)
    with pytest.raises(ValueError, match="--plan-policy vllm"):  # the deployment's own PP too
        plan(8, Deployment.of("Llama-3-8B", "H100-SXM", tp=2, pp=2), sglang, SMALL, slo)


def test_results_file_keys_of_a_plan_without_pp_are_unchanged():
    # Keys as the code before --plan-pp computed them (git HEAD 6deb678): a results file written
    # then still resumes
    spec = WorkloadSpec(
        "random", num_requests=40, rate=4.0, seed=5, input_len=Uniform(200, 1500), output_len=Uniform(10, 80)
    )
    deployment = Deployment.of("Llama-3.1-8B", "H100")
    keys = {
        Layout(2): "0143384bb667aafa23e0",
        Layout(1, 1, 2, False): "8fd9620e528dfc4642c0",
        Layout(1, 0, 4, True, 2): "f3a2abae41d8c5dd0617",
    }
    for layout, key in keys.items():
        run = ClusterRunSpec(layout, deployment, VLLM, spec, "round-robin", "ib-ndr")
        assert "pp" not in run.describe()["layout"]
        assert run.key == key
    with_pp = ClusterRunSpec(replace(Layout(2), pp=1), deployment, VLLM, spec, "round-robin", "ib-ndr")
    assert with_pp.describe()["layout"]["pp"] == 1 and with_pp.key != keys[Layout(2)]


def test_left_out_lines_consider_the_pp_sizes(capsys):
    from tailserve.cli.tune_plan import _print_left_out

    _print_left_out(16, FALCON, [2, 4, 8], [1, 2])
    err = capsys.readouterr().err.splitlines()
    # TP 2 fits at neither PP size: named once, with the nearest it came; TP 4 fits at PP 2
    assert err[0].startswith("tailserve: --plan-tps: TP 2 left out (at PP 2): Falcon-180B does not fit")
    assert err[1].startswith("tailserve: --plan-pp: TP 4 x PP 1 left out: Falcon-180B does not fit")
    assert len(err) == 2 and "try --tp" not in "".join(err)
    _print_left_out(16, FALCON, [2, 4, 8], None)  # without --plan-pp: as before
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[2] for line in err] == [" TP 2 left out", " TP 4 left out"]


def test_tune_gpus_plan_pp_end_to_end(tmp_path, capsys):
    from tailserve.cli import main

    out = tmp_path / "plan.json"
    argv = [
        "tune", "--gpus", "8", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--tp", "4",
        "--plan-pp", "1,2", "--workload", "random", "--num-requests", "60", "--rate", "20",
        "--input-len", "uniform:500:3000", "--output-len", "uniform:20:200",
        "--slo", "ttft_p99=200ms,tbt_p99=30ms", "--plan-router", "round-robin", "--rel-tol", "0.3",
        "--workers", "1", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "8 GPUs as replicas of TP 4 x PP 1, 2" in " ".join(text.split())
    assert "1 aggregated x PP 2" in text and "2 aggregated x PP 1" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["num_prefill"], r["num_decode"], r["pp"]) for r in rows] == [(2, 0, 1), (1, 1, 1), (1, 0, 2)]
    assert all(r["capacity_rps"] > 0 and r["upper_rps"] > r["capacity_rps"] for r in rows)
    # the refusals, one line each
    assert main([*argv[:-2], "--plan-policy", "sglang"]) == 2
    assert "give --plan-policy vllm" in capsys.readouterr().err
    assert main(["tune", "--plan-pp", "1,2"]) == 2
    assert "--plan-pp plans a GPU budget: it needs --gpus N" in capsys.readouterr().err
    assert main(["tune", "--gpus", "8", "--plan-pp", "0"]) == 2
    assert "--plan-pp takes PP sizes >= 1" in capsys.readouterr().err
