"""``calibrate --from-trace``: a cost model fitted from recorded traffic alone.

The ground truth is the simulator: a run priced by a known cost model is written as a recording
(each request's TTFT and gaps, as a client would have seen them), the fit reads only that file,
and its iteration times are held against the known model's on shapes the run never had."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import write_recording
from tailserve.cli import main
from tailserve.core.request import Request
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.fidelity import server_calibrate as sc
from tailserve.fidelity import trace_calibrate as tc
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import Uniform
from tailserve.workloads.recorded import Measured, load_measured

# The "real engine": A40 curves bent by measured points, so the fit does not start at the truth.
TRUTH = Deployment("Llama-3-8B", "A40", 1, "prefill:2048=0.52,decode:16x1024=0.034,decode:1x256=0.021")
QUIET = WorkloadSpec(
    "random", num_requests=160, rate=0.9, seed=5, input_len=Uniform(64, 1800), output_len=Uniform(8, 96)
)


def _record(spec: WorkloadSpec, path: Path) -> Path:
    built = build_cost_model(TRUTH)
    run = run_policy(built, parse_policy_list("vllm:async_scheduling=false")[0], WorkloadBuilder(spec))
    write_recording(run.requests, path)
    return path


def _grid() -> list[BatchShape]:
    return [BatchShape.of([(n, 0)], []) for n in (128, 512, 1536)] + [
        BatchShape.of([], [c] * b) for b in (1, 4, 12) for c in (300, 1200)
    ]


def test_a_fit_from_recorded_traffic_predicts_the_engine_it_was_recorded_on(tmp_path: Path):
    path = _record(QUIET, tmp_path / "rec.jsonl")
    found = tc.trace_points(load_measured(path))
    tc.check_enough(found, str(path))
    assert found.alone >= 20 and found.clean_gaps >= 100
    truth = build_cost_model(TRUTH).cost_model
    start = build_cost_model(Deployment("Llama-3-8B", "A40", 1, "none")).cost_model
    fitted = sc.fit_points(truth.model, start.hardware, 1, [p.measured() for p in found.points])
    model = CostModel(truth.model, start.hardware, 1, fitted.efficiency)
    errors = [model.iteration_time(s) / truth.iteration_time(s) - 1 for s in _grid()]
    before = [start.iteration_time(s) / truth.iteration_time(s) - 1 for s in _grid()]
    assert max(abs(e) for e in before) > 0.15  # the catalog curves alone are far off
    assert max(abs(e) for e in errors) < 0.06, errors
    print("before", [f"{e:+.1%}" for e in before], "after", [f"{e:+.1%}" for e in errors])


def test_every_point_is_a_moment_nothing_else_happened():
    # Two requests: the first alone; the second arrives while the first decodes.
    a = (Request("trace-0", 100, 4, 0.0), Measured(0.05, [0.01, 0.01, 0.01], 4, 0.08))
    b = (Request("trace-1", 200, 4, 0.061), Measured(0.03, [0.012, 0.012, 0.012], 4, 0.066))
    found = tc.trace_points([a, b], tc.TraceCalibrationOptions(tolerance_s=0.0005))
    labels = [p.label for p in found.points]
    assert found.alone == 1 and labels[0] == "prefill 100 (n=1)"
    # a's gaps: [0.05,0.06] alone (clean, batch 1); [0.06,0.07] and [0.07,0.08] hold b's prefill.
    # b's gaps after a finished (0.08): [0.091,0.103], [0.103,0.115] alone; [0.079..0.091]? b's
    # first token at 0.091 is after a's end: b's gaps are all batch 1.
    assert found.clean_gaps == 4


def test_shared_prefixes_count_as_cached_context():
    ids = list(range(1, 40))
    first = (Request("trace-0", 39, 2, 0.0, prompt_token_ids=ids), Measured(0.05, [0.01], 2, 0.06))
    again = [*ids[:35], 99, 98, 97, 96]
    second = (Request("trace-1", 39, 2, 1.0, prompt_token_ids=again), Measured(0.02, [0.01], 2, 0.03))
    found = tc.trace_points([first, second])
    assert [p.label for p in found.points] == ["prefill 7@32 (n=1)", "prefill 39 (n=1)"]
    off = tc.trace_points([first, second], tc.TraceCalibrationOptions(prefix_caching=False))
    assert [p.label for p in off.points] == ["prefill 39 (n=2)"]


def test_a_busy_recording_is_refused_with_what_was_found(tmp_path: Path, capsys):
    busy = WorkloadSpec("random", num_requests=40, rate=200.0, seed=1, input_len=Uniform(2500, 3000))
    path = _record(busy, tmp_path / "busy.jsonl")
    assert main(["calibrate", "--from-trace", str(path), "--model", "Llama-3-8B", "--hardware", "A40"]) == 2
    err = capsys.readouterr().err
    assert "too few clean moments to fit" in err and "record a stretch at lower load" in err


def test_the_command_writes_a_calibration_that_replays_the_trace(tmp_path: Path, capsys):
    path = _record(QUIET, tmp_path / "rec.jsonl")
    out = tmp_path / "fit.json"
    args = ["--model", "Llama-3-8B", "--hardware", "A40"]
    assert main(["calibrate", "--from-trace", str(path), "--out", str(out), *args]) == 0
    text = capsys.readouterr().out
    assert "pure-decode gaps" in text and "wrote" in text
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(path),
                "--calibration",
                str(out),
                "--policy",
                "vllm",
                "--no-async-scheduling",
                *args,
            ]
        )
        == 0
    )
    replay = capsys.readouterr().out
    assert "replayed vs recorded" in replay


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--from-trace", "/nonexistent.jsonl"], "no such file"),
        (["--from-trace", "X", "--from-server", "http://h"], "takes one of"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert main(["calibrate", *argv, "--model", "Llama-3-8B", "--hardware", "A40"]) == 2
    assert message in capsys.readouterr().err
