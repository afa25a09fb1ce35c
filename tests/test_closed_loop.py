"""The closed-loop benchmark's pieces that need no engine: its settings as flags and as the
simulator's policy, its workloads (seeded, token-id prompts, a trace the simulator reads), the
ranking and target arithmetic, and the SLO it puts at a workload's knee."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from benchmarks import _closed_loop_report as report
from benchmarks._closed_loop_engines import SETTINGS, Setting
from benchmarks._closed_loop_tune import knee_slo, slo_ratio, workload_trace
from benchmarks._closed_loop_workloads import hol, shared_prefix

from tailserve.policies.registry import parse_policy_list
from tailserve.workloads.traces import load_trace


def test_a_setting_is_the_same_flags_on_both_engines_and_in_the_simulator():
    off = Setting("x", 2048, 4, prefix_caching=False, chunked_prefill=False)
    assert off.flags() == [
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "4",
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
    ]  # fmt: skip
    (spec,) = parse_policy_list(off.policy())
    assert spec.flags["max_num_batched_tokens"] == 2048 and spec.flags["max_num_seqs"] == 4
    assert spec.flags["enable_prefix_caching"] is False and spec.flags["enable_chunked_prefill"] is False
    assert len(SETTINGS) >= 6 and SETTINGS[0].budget == 2048  # the calibration's server: the default


def test_workloads_are_seeded_and_replayable(tmp_path: Path):
    a, b = hol(8192, 0, quick=False), hol(8192, 0, quick=False)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests] and list(a.times) == list(b.times)
    assert sum(r.prompt_len == 1800 for r in a.requests) == 4  # a long prompt every 2 s
    shared = shared_prefix(8192, 0, quick=True)
    prefixes = {tuple(r.prompt[:512]) for r in shared.requests}
    assert len(prefixes) <= 4 and len(shared.requests) == 16
    requests = load_trace(workload_trace(shared, tmp_path / "s.jsonl"))
    assert [r.prompt_token_ids for r in requests] == [r.prompt for r in shared.requests]


def test_ranking_and_targets():
    assert report.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert report.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert math.isnan(report.spearman([1, 2], [1, 2]))
    # The measured tie (100 vs 102) is left out; of the other pairs one is ordered the other way.
    assert report.pairwise([1, 2, 3], [100, 102, 50]) == (0, 2)
    assert report.within_target("ttft_p99", 0.19) and not report.within_target("ttft_p50", 0.11)


def test_the_knee_slo_splits_the_budgets():
    cells = [
        {"predicted": {"ttft_p99": 1000.0, "itl_p99": 100.0}},
        {"predicted": {"ttft_p99": 1100.0, "itl_p99": 900.0}},
    ]
    ttft_s, itl_s = knee_slo(cells)
    assert ttft_s == pytest.approx(1.2) and itl_s == pytest.approx(0.3)
    assert (
        slo_ratio(cells[0]["predicted"], ttft_s, itl_s) < 1 < slo_ratio(cells[1]["predicted"], ttft_s, itl_s)
    )


def test_the_gauge_rescales_every_time_term_of_the_twin(tmp_path: Path):
    # scaled_calibration at one factor for prefill and decode scales every iteration the twin
    # prices by exactly that factor (a time term left unscaled would break the ratio), and the
    # request overhead with the prefill's; two factors move a lone prefill by the first.
    from benchmarks._closed_loop_gauge import Gauge, factors, scaled_calibration

    from tailserve.executors.simulated.calibration_files import (
        CalibrationFile,
        read_calibration_file,
        write_calibration_file,
    )
    from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.executors.simulated.models import get_model

    eff = Efficiency(
        compute=0.5,
        memory=0.3,
        overhead=0.008,
        per_token=2e-6,
        gemm_latency=1e-5,
        sharpness=1.0,
        per_logit=2e-4,
    )
    base = tmp_path / "cal.json"
    write_calibration_file(
        base, CalibrationFile(get_hardware("A100-80GB"), eff, "m", 1, "test", request_overhead_s=0.012)
    )
    model = get_model("Llama-3-8B")
    shapes = [
        BatchShape(1024, 1, 1024 * 1025 // 2, 1024, 0, 1, 0),
        BatchShape(32, 32, 0, 0, 32 * 1000, 0, 32),
        BatchShape(288, 33, 256 * 257 // 2, 256, 32 * 500, 1, 32),
    ]

    def times(path: str) -> list[float]:
        cal = read_calibration_file(path)
        cost = CostModel(model, cal.hardware, efficiency=cal.efficiency)
        return [cost.iteration_time(s) for s in shapes]

    same = scaled_calibration(str(base), 1.7, 1.7, tmp_path / "x.json")
    assert [b / a for a, b in zip(times(str(base)), times(same))] == pytest.approx([1.7] * 3, rel=1e-9)
    assert read_calibration_file(same).request_overhead_s == pytest.approx(0.012 * 1.7)
    split = scaled_calibration(str(base), 2.0, 1.0, tmp_path / "y.json")
    assert read_calibration_file(split).request_overhead_s == pytest.approx(0.024)
    assert times(split)[0] / times(str(base))[0] > 1.5  # the lone prefill: compute-bound
    assert times(split)[1] / times(str(base))[1] < 1.2  # the decode batch: memory and per-step time
    assert factors(Gauge(0.03, 0.02), Gauge(0.02, 0.02)) == pytest.approx((1.5, 1.0))
    with pytest.raises(ValueError, match="positive"):
        scaled_calibration(str(base), 0.0, 1.0, tmp_path / "z.json")


@pytest.mark.parametrize(
    ("level", "expected"), [("avx512_bf16", "bfloat16"), ("avx512", "float32"), ("avx2", "float32")]
)
def test_vllm_runs_its_faster_dtype_on_the_cpu_and_an_explicit_one_wins(monkeypatch, level, expected):
    from benchmarks import closed_loop

    from tailserve.executors.pytorch import cpu_isa

    monkeypatch.setattr(cpu_isa, "native_level", lambda: level)
    assert closed_loop.resolve_vllm_dtype("auto") == expected
    assert closed_loop.resolve_vllm_dtype("bfloat16") == "bfloat16"


def test_a_saved_run_is_predicted_again_and_refitted_without_an_engine(tmp_path: Path):
    # closed_loop --from-json: the cells a run measured, predicted again by this code; --refit
    # fits the run's probes again (here: the probes carry a per-sampled-row host cost that the
    # run's own fit, without that term, missed).
    import json

    from benchmarks import _closed_loop_repredict as repro
    from benchmarks._closed_loop_workloads import build
    from benchmarks.closed_loop import predict

    from tailserve.executors.simulated.calibration import MeasuredBatch
    from tailserve.executors.simulated.calibration_files import CalibrationFile, write_calibration_file
    from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
    from tailserve.executors.simulated.hardware import Hardware
    from tailserve.executors.simulated.models import load_hf_config

    model = tmp_path / "tiny"
    model.mkdir()
    config = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8}
    config |= {"num_key_value_heads": 4, "intermediate_size": 1536, "vocab_size": 8192}
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    cpu = Hardware("cpu", 150e9, 15e9, 64.0, 15e9, 15e9, vendor="cpu")
    truth = Efficiency(compute=0.5, memory=0.5, overhead=1e-3, sharpness=2.0, per_logit=3e-4)
    shapes = [BatchShape.of([(q, c)], []) for q in (16, 64, 256, 512) for c in (0, 256, 1024)]
    shapes += [BatchShape.of([], [c] * b) for b in (1, 8, 32, 64) for c in (16, 512, 1024)]
    cost = CostModel(load_hf_config(model), cpu, 1, truth)
    points = tuple(MeasuredBatch(s, cost.iteration_time(s)) for s in shapes)

    def saved_calibration(eff: Efficiency, name: str) -> str:
        path = tmp_path / name
        write_calibration_file(path, CalibrationFile(cpu, eff, "tiny", 1, "probes", points))
        return str(path)

    (w,) = build(["hol"], 8192, 0, quick=True)
    setting = SETTINGS[0]
    measured, _ = predict(w, setting, saved_calibration(truth, "truth.json"), model)
    run_fit = Efficiency(compute=0.5, memory=0.5, overhead=1e-3, sharpness=2.0)  # no per-row term
    saved = {
        "model": str(model),
        "dtype": {"tailserve": "bfloat16"},
        "workloads": [w.summary],
        "settings": [{"name": setting.name}],
        "calibrations": {
            "tailserve": {"body": json.loads(Path(saved_calibration(run_fit, "run.json")).read_text())}
        },
        "cells": [
            {
                "engine": "tailserve",
                "setting": setting.name,
                "workload": "hol",
                "measured": report.figures(measured),
            }
        ],
    }
    assert [x.name for x in repro.run_workloads(saved, 8192, 0, None)] == ["hol"]
    assert repro.run_settings(saved) == [setting]

    def worst_error(refit: bool) -> float:
        cals = repro.saved_calibrations(saved, model, tmp_path / ("re" if refit else "as"), refit)
        (cell,) = repro.repredict_cells(saved["cells"], [setting], [w], cals, model, predict)
        return max(abs(e) for e in cell["error"].values() if e is not None and not math.isnan(e))

    (tmp_path / "re").mkdir()
    (tmp_path / "as").mkdir()
    assert worst_error(refit=False) > 0.05  # the run's own fit: every decode step short of the truth
    assert worst_error(refit=True) < 0.01
    with pytest.raises(SystemExit, match="do not match"):
        repro.run_workloads({**saved, "workloads": [{**w.summary, "requests": 5}]}, 8192, 0, None)


def _cell(engine: str, setting: str, pass_no: int, scale: float, twin: float | None = None) -> dict:
    measured = {name: 100.0 * scale for name, _ in report.METRICS}
    cell = {"engine": engine, "workload": "hol", "setting": setting, "pass": pass_no, "measured": measured}
    if twin is not None:
        cell["predicted"] = {name: 100.0 * twin for name, _ in report.METRICS}
        cell["error"] = report.errors(cell["predicted"], measured)
    return cell


def test_repeatability_takes_the_first_pass_as_the_engines_own_twin() -> None:
    # Three settings, twice: the second pass 5% slower on two settings, 30% on the third.
    cells = [_cell("vllm", s, 0, k + 1.0, twin=k + 1.0) for k, s in enumerate("abc")]
    cells += [
        _cell("vllm", s, 1, (k + 1.0) * f, twin=k + 1.0)
        for k, (s, f) in enumerate(zip("abc", (1.05, 1.05, 1.3)))
    ]
    cells.append({"engine": "vllm", "workload": "hol", "setting": "d", "pass": 1, "skipped": "did not start"})
    rep = report.repeatability(cells)
    assert rep is not None and len(rep["pairs"]) == 3
    shares = rep["shares"]["vllm"]
    assert (shares["cells"], shares["cells_all_within"]) == (3, 2)  # 1/1.3 - 1 = -23%: out at every figure
    assert shares["figures_within"] == 2 * 6
    # The twin predicted the first pass's values: on the later cells it errs as the first pass does.
    assert rep["twin_shares"]["vllm"]["cells_all_within"] == 2
    m = rep["median_abs_error"]["vllm"]["ttft_p50"]
    assert m["self"] == pytest.approx(1 - 1 / 1.05) and m["twin"] == pytest.approx(1 - 1 / 1.05)
    (ranks,) = rep["rankings"]
    assert ranks["ttft_p99"] == pytest.approx(1.0)  # the settings keep their order between passes
    # Rankings of the twin against each pass are computed per pass, not over both.
    for c in cells:
        c.setdefault("predicted", None)
    rows = report.rankings([c for c in cells if c.get("predicted")])
    assert sorted(r.get("pass", 0) for r in rows) == [0, 1]
    assert report.repeatability([c for c in cells if c["pass"] == 0]) is None


def test_a_calibration_override_is_checked_before_anything_runs(monkeypatch, tmp_path, capsys) -> None:
    from benchmarks import closed_loop

    cal = tmp_path / "fit.json"
    cal.write_text("{}")
    cases = [
        (["--calibration", f"tailserve={cal}"], "needs --from-json"),
        (["--from-json", "x.json", "--calibration", f"sglang={cal}"], "expected vllm=FILE or tailserve=FILE"),
        (["--from-json", "x.json", "--calibration", "tailserve=/nonexistent.json"], "no such file"),
        (["--repeat", "0"], "must be >= 1"),
    ]
    for argv, message in cases:
        monkeypatch.setattr("sys.argv", ["closed_loop", *argv])
        with pytest.raises(SystemExit):
            closed_loop.parse_args()
        assert message in capsys.readouterr().err
    monkeypatch.setattr(
        "sys.argv", ["closed_loop", "--from-json", "x.json", "--calibration", f"tailserve={cal}"]
    )
    assert closed_loop.parse_args().calibration == {"tailserve": str(cal)}
