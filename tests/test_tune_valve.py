"""``tailserve tune --valve`` (``tune/valve.py``): above capacity, the largest admission valve of
each engine that holds the SLO's TTFT bound for the requests it serves."""

from __future__ import annotations

import json

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import RateScaler, parse_capacity_slo
from tailserve.tune.sweep import RunSpec, SerialBackend, Sweep
from tailserve.tune.valve import valve_steps
from tailserve.workloads.lengths import parse_length

SLO = parse_capacity_slo("ttft_p99=1s")


def _valve(name: str, rate: float, flags: dict | None = None):
    workload = WorkloadSpec(
        "random", num_requests=400, rate=rate, input_len=parse_length("uniform:500:3000"),
        output_len=parse_length("100"), seed=1,
    )  # fmt: skip
    spec = PolicySpec.make(name, flags or {})
    scaler = RateScaler.of(RunSpec(Deployment.of("Llama-3-8B", "H100-SXM", 1), workload, spec))
    with Sweep(SerialBackend(), quiet=True) as sweep:
        (valve,) = sweep.drive([valve_steps(scaler, spec, SLO)])
    return scaler, valve


@pytest.mark.parametrize(
    ("name", "flag"), [("vllm", "max_num_queued_tokens"), ("sglang", "max_queued_requests")]
)
def test_above_capacity_the_valve_holds_the_ttft_bound_and_a_larger_one_does_not(name, flag):
    scaler, valve = _valve(name, 60.0)
    assert valve.needed and valve.value is not None and valve.ttft["p99"] <= 1.0 and valve.refused > 0
    # the setting just past the search's tolerance misses; the engine without a valve misses too
    with Sweep(SerialBackend(), quiet=True) as sweep:
        past, none = sweep.run(
            [
                scaler.at(scaler.rate, policy=PolicySpec.make(name, {flag: int(valve.value * 1.1) + 1})),
                scaler.at(scaler.rate, policy=PolicySpec.make(name, {})),
            ]
        )
    assert past.summary["metrics"]["ttft_s"]["p99"] > 1.0 and none.summary["metrics"]["ttft_s"]["p99"] > 1.0
    assert "holds the TTFT bound at 60 req/s" in valve.line(60.0)


def test_below_capacity_no_valve_is_needed_and_a_given_valve_is_set_aside():
    _, valve = _valve("vllm", 5.0, {"max_num_queued_tokens": 10})
    assert not valve.needed and valve.value is None and valve.runs == 1 and valve.refused == 0.0
    assert valve.policy == "vllm"


def test_tune_valve_prints_and_writes_it(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = [
        "tune", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--tp", "1", "--workload", "random",
        "--input-len", "uniform:500:3000", "--output-len", "100", "--num-requests", "300", "--rate", "60",
        "--policies", "vllm,sglang,tgi", "--chunk-sizes", "2048", "--slo", "ttft_p99=1s", "--valve",
        "--no-resume", "--out", str(tmp_path / "runs.jsonl"), "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "valve: none simulated for tgi" in text
    assert "valve vllm: --max-num-queued-tokens" in text and "valve sglang: --max-queued-requests" in text
    valves = json.loads(out.read_text())["valves"]
    assert [v["policy"] for v in valves] == ["vllm", "sglang"] and all(v["needed"] for v in valves)


def test_tune_valve_needs_a_ttft_bound(tmp_path, capsys):
    argv = [
        "tune", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--tp", "1", "--num-requests", "50",
        "--policies", "vllm", "--chunk-sizes", "2048", "--slo", "tbt_p99=200ms", "--valve", "--no-resume",
        "--out", str(tmp_path / "runs.jsonl"),
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--valve needs a TTFT tail bound in --slo" in err


def test_tune_valve_is_one_engines(tmp_path, capsys):
    argv = [
        "tune",
        "--model",
        "Llama-3-8B",
        "--hardware",
        "H100-SXM",
        "--gpus",
        "4",
        "--valve",
        "--slo",
        "ttft_p99=2s",
    ]
    assert main(argv) == 2
    assert "--valve searches one engine's admission valve" in capsys.readouterr().err
