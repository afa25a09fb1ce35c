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
