"""``tailserve tune --plan-eplb``: each expert-parallel layout of a capacity plan once per EPLB
setting (off, or its redundant experts), on the routing ``--expert-imbalance`` gives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import parse_capacity_slo
from tailserve.tune.cluster_plan import Layout, plan

BASE = [
    sys.executable, "-m", "tailserve", "tune", "--model", "Qwen3-30B-A3B", "--hardware", "H100", "--tp", "1",
    "--data-parallel-size", "2", "--enable-expert-parallel", "--workload", "chat", "--num-requests", "60",
    "--rate", "4", "--seed", "1", "--slo", "ttft_p99=2s",
]  # fmt: skip


def _tune(*extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*BASE, *extra], capture_output=True, text=True, check=check)


def test_each_setting_is_a_layout_of_its_own(tmp_path):
    out = tmp_path / "plan.json"
    _tune("--expert-imbalance", "0.3", "--plan-eplb", "off,0,16", "--json", str(out))
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        "1 engine x DP 2 x TP 1 EP, no EPLB",
        "1 engine x DP 2 x TP 1 EP, EPLB +0 experts",
        "1 engine x DP 2 x TP 1 EP, EPLB +16 experts",
    }


def test_the_layouts_run_the_setting_they_name():
    d = Deployment.of("Qwen3-30B-A3B", "H100", 1, expert_parallel=True, dp=2, expert_imbalance=0.3)
    spec = WorkloadSpec("chat", num_requests=30, rate=2.0, seed=1)
    rows = plan(
        2, d, PolicySpec.make("vllm", {}), spec, parse_capacity_slo("ttft_p99=2s"), dps=[2], dp_only=True,
        tps=[1], expert_parallel="on", eplb=[-1, 16], rel_tol=0.3,
    )  # fmt: skip
    assert [r.layout.eplb for r in rows] == [-1, 16]
    # a non-EP layout is left as it is; none at all is refused
    with pytest.raises(ValueError, match="no layout splits the experts whole"):
        plan(2, Deployment.of("Qwen3-30B-A3B", "H100", 1), PolicySpec.make("vllm", {}), spec,
             parse_capacity_slo("ttft_p99=2s"), eplb=[16], rel_tol=0.3)  # fmt: skip
    assert Layout(1, 0, 1, True, 2, -1).label.endswith(", no EPLB")


def test_bad_settings_and_uniform_routing_are_said():
    bad = _tune("--plan-eplb", "off,-4", check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--plan-eplb takes off or redundant-expert counts" in bad.stderr
    uniform = _tune("--plan-eplb", "off", "--num-requests", "20")
    assert "EPLB has nothing to balance" in uniform.stderr
    without_budget = subprocess.run(
        [sys.executable, "-m", "tailserve", "tune", "--model", "Qwen3-30B-A3B", "--hardware", "H100",
         "--plan-eplb", "off"], capture_output=True, text=True,
    )  # fmt: skip
    assert without_budget.returncode != 0 and "--plan-eplb plans a GPU budget" in without_budget.stderr


def _cost_of(run):
    stage = next(iter(run.stages.values()))
    return stage.replicas[0].engine.executor.cost_model


def test_a_layout_runs_its_eplb_setting_and_reads_the_routing_at_the_base_ep_size():
    from tailserve.tune.cluster_plan import run_layout

    base = Deployment.of("Qwen3-30B-A3B", "H100", 2, expert_parallel=True, expert_imbalance=0.5)
    spec = WorkloadSpec("chat", num_requests=6, rate=2.0, seed=1)
    policy = PolicySpec.make("vllm", {})
    same = _cost_of(run_layout(Layout(1, 0, 2, True, 0, 16), base, policy, spec, "round-robin", "ib-ndr"))
    assert same.expert_load.redundant == 16 and same.expert_load.measured_ep == 0  # measured where it runs
    wider = _cost_of(run_layout(Layout(1, 0, 4, True), base, policy, spec, "round-robin", "ib-ndr"))
    assert wider.expert_load.measured_ep == 2 and not wider.expert_load.eplb
    from tailserve.executors.simulated.expert_load import steady_imbalance

    # the same routing over twice the ranks is more uneven, not refitted to 0.5 again
    assert steady_imbalance(wider.expert_load, 128, 4) > 0.9
    assert "(measured at EP 2)" in wider.expert_load.describe()


def test_settings_that_cannot_run_are_left_out_with_the_reason():
    base = Deployment.of("Qwen3-30B-A3B", "H100", 2, expert_parallel=True, expert_imbalance=0.5)
    spec = WorkloadSpec("chat", num_requests=6, rate=2.0, seed=1)
    notes: list[str] = []
    rows = plan(
        2, base, PolicySpec.make("vllm", {}), spec, parse_capacity_slo("ttft_p99=2s"), eplb=[-1, 3, 4096],
        rel_tol=0.5, notes=notes,
    )  # fmt: skip
    assert [r.layout.eplb for r in rows] == [-1]
    assert any("EPLB +3 experts left out" in n and "do not split over 2 EP ranks" in n for n in notes)
    assert any("EPLB +4096 experts left out" in n and "does not fit" in n for n in notes)
    with pytest.raises(ValueError, match="routing measured at an EP size"):
        plan(2, Deployment.of("Qwen3-30B-A3B", "H100", 1, expert_parallel=True, expert_imbalance=0.5),
             PolicySpec.make("vllm", {}), spec, parse_capacity_slo("ttft_p99=2s"), tps=[2], expert_parallel="on")  # fmt: skip
