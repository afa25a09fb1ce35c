"""The MLPerf point definitions (benchmarks/fidelity_mlperf.py) load, are self-consistent, and
simulate through the CLI's path; behaviour only, never timing or fidelity figures."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import pytest
from benchmarks.fidelity_mlperf import (
    CNN_DAILYMAIL,
    DEEPSEEK_R1,
    LIMITS,
    OPENORCA,
    POINTS,
    capacity,
    parse_tables,
    run,
    select,
    simulate,
    step_summary,
    trace,
    with_tables,
)
from rich.console import Console

from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model, resolve_model_name

SMALL = select("redhat-h100")[0]  # the small model: quickest to simulate


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.label)
def test_point_is_well_formed(point):
    get_model(point.model), get_hardware(point.gpu)  # both in the catalog
    assert point.benchmark in LIMITS and point.policy in ("vllm", "vllm-v0", "trtllm")
    assert point.replicas >= 1 and point.gpus % (point.tp * point.dp) == 0
    # an attention-DP engine is one of an MoE model, its experts spread over the ranks
    assert point.dp == 1 or (
        get_model(point.model).is_moe and "--enable-expert-parallel" in point.engine_flags
    )
    # LoadGen schedules at least what completes; the percentiles are ordered
    assert point.scheduled_qps >= point.completed_qps > 0
    assert point.ttft_ms[0] < point.ttft_ms[1] and point.tpot_ms[0] < point.tpot_ms[1]
    # a VALID result: its p99s are within the benchmark's limits
    assert point.ttft_ms[1] <= LIMITS[point.benchmark][0] * 1e3
    assert point.tpot_ms[1] <= LIMITS[point.benchmark][1] * 1e3
    assert point.in_flight > 0 and point.out_mean > 0
    assert point.source.startswith("mlcommons/inference_results_v5.1@")


@pytest.mark.parametrize("dataset", (OPENORCA, CNN_DAILYMAIL, DEEPSEEK_R1), ids=lambda d: d.name)
def test_dataset_tables_are_percentiles(dataset):
    for table in (dataset.input_percentiles, dataset.output_percentiles):
        if table is not None:
            assert len(table) == 51 and list(table) == sorted(table) and table[0] >= 1


def test_sampled_lengths_follow_the_tables_and_the_output_mean():
    rng = np.random.default_rng(0)
    inputs, outputs = OPENORCA.sample(20000, 300.0, rng)
    assert inputs.min() >= OPENORCA.input_percentiles[0] and inputs.max() <= OPENORCA.input_percentiles[-1]
    assert abs(np.median(inputs) - OPENORCA.input_percentiles[25]) <= 3
    assert abs(outputs.mean() / 300.0 - 1) < 0.01 and outputs.max() <= OPENORCA.max_output
    _, fixed = CNN_DAILYMAIL.sample(50, 129.0, rng)
    assert set(fixed) == {CNN_DAILYMAIL.max_output}


def test_trace_is_poisson_at_the_rate_and_reproducible():
    point = POINTS[0]
    a, b = trace(point, 5.0, 4000, seed=3), trace(point, 5.0, 4000, seed=3)
    assert a == b
    times = [r["arrival_time"] for r in a]
    assert times == sorted(times) and abs(len(times) / times[-1] / 5.0 - 1) < 0.05


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.label)
def test_point_simulates_with_its_engine(point):
    rate = point.scheduled_qps / point.replicas
    pred = simulate(point, rate, 30)
    assert pred.num_requests == 30
    if point.dp > 1:  # one engine of DP ranks: its JSON reports each rank
        ranks = pred.raw["stages"]["replicas"]["replicas"]
        assert len(ranks) == point.dp
        assert all(
            r["policy"].startswith(point.policy) and r["deployment"] == f"{point.gpu}:tp{point.tp}"
            for r in ranks
        )
    else:
        assert pred.raw["config"]["policy"] == point.policy
        assert pred.raw["config"]["model"] == resolve_model_name(point.model)
        assert pred.raw["config"]["hardware"] == point.gpu
    assert 0 < pred.ttft_ms[0] <= pred.ttft_ms[1] and 0 < pred.tpot_ms[0] <= pred.tpot_ms[1]
    # VALID is MLPerf's rule on the p99s, nothing else
    lim_ttft, lim_tpot = point.limits
    assert pred.valid == (pred.ttft_ms[1] <= lim_ttft * 1e3 and pred.tpot_ms[1] <= lim_tpot * 1e3)


def test_a_heavier_load_is_never_faster():
    point = SMALL
    light = simulate(point, 1.0, 60, seed=1)
    heavy = simulate(point, 400.0, 60, seed=1)
    assert heavy.ttft_ms[1] > light.ttft_ms[1]


def test_capacity_is_a_rate_within_the_search_bounds():
    point = SMALL
    c, bound = capacity(point, span_s=2.0, steps=2)
    assert point.scheduled_qps / 4 <= c <= point.scheduled_qps * 2 and bound in ("", "<", ">")


def test_points_filter_by_name_or_part_of_the_label():
    assert [p.name for p in select("nvidia-b200-r1")] == ["nvidia-b200-r1"]
    assert {p.name for p in select("R1")} == {"nvidia-b200-r1", "nvidia-gb200-r1"}
    assert [p.name for p in select("redhat-h100, H200")] == ["cisco-h200", "redhat-h100"]  # POINTS' order
    assert select(None) == POINTS
    with pytest.raises(ValueError, match="no point matches nope; known: amd-mi300x"):
        select("r1,nope")


def test_an_attention_dp_point_is_one_engine_of_its_ranks():
    b200, gb200 = select("nvidia-b200-r1")[0], select("nvidia-gb200-r1")[0]
    assert (b200.replicas, b200.dp, gb200.replicas) == (1, 8, 9)
    # Little's law per engine: 8 GPUs' requests in flight, not one GPU's
    assert b200.in_flight == pytest.approx(5.02 * 248.934)


# --aisim-tables: each point priced from its own engine's AISimulate export (aisim_table.py), on
# tiny synthetic exports (AISimulate itself is not needed).
_MS = (1, 16, 64, 128, 256, 1024, 4096, 16384)
_NS = (4096, 8192, 16384, 32768, 65536)
_KS = (4096, 8192, 16384, 32768)


def _export(path, framework, gpu, formats):
    """An ``_aisim_tables.py`` export of ``gpu``: every (M, N, K) of the grid at a law slower with
    M than a constant rate, so that the table prices differently from the catalog's curve."""
    gemm = [
        [fmt, float(m), float(n), float(k), 1e3 * (4e-6 + 2.0 * m * n * k / 8e14)]  # ms
        for fmt in formats
        for n in _NS
        for k in _KS
        for m in _MS
    ]
    path.write_text(json.dumps({"framework": framework, "gpus": {gpu: {"gemm": gemm}}}))
    return str(path)


@pytest.fixture
def exports(tmp_path):
    return {
        "trtllm": _export(tmp_path / "trtllm.json", "trtllm", "h200_sxm", ("fp8", "bfloat16")),
        "vllm": _export(tmp_path / "vllm.json", "vllm", "h100_sxm", ("fp8", "bfloat16")),
    }


def test_aisim_tables_parse_engine_and_file():
    assert parse_tables("trtllm=/a.json, vllm=/b.json") == {"trtllm": "/a.json", "vllm": "/b.json"}
    for bad in ("trtllm", "trtllm=", "tensorrt=/a.json", "=/a.json"):
        with pytest.raises(ValueError, match="is not ENGINE=FILE"):
            parse_tables(bad)
    with pytest.raises(ValueError, match="trtllm named twice"):
        parse_tables("trtllm=/a.json,trtllm=/b.json")


def test_each_point_takes_its_own_engines_export(exports):
    cisco, redhat = with_tables(select("cisco-h200,redhat-h100"), exports)
    assert (cisco.kernels, redhat.kernels) == ("trtllm", "vllm")
    assert (
        cisco.calibration == f"aisim:{exports['trtllm']}" and redhat.calibration == f"aisim:{exports['vllm']}"
    )
    assert all(p.calibration == "" for p in POINTS)  # the published points stay uncalibrated


def test_points_the_tables_cannot_price_are_refused(exports, tmp_path):
    with pytest.raises(ValueError, match="redhat-h100 runs vllm's kernels: --aisim-tables has no vllm=FILE"):
        with_tables(select("redhat-h100"), {"trtllm": exports["trtllm"]})
    vllm_h200 = _export(tmp_path / "vllm_h200.json", "vllm", "h200_sxm", ("fp8",))
    with pytest.raises(ValueError, match=r"holds vllm's .*--framework trtllm"):
        with_tables(select("cisco-h200"), {"trtllm": vllm_h200})
    with pytest.raises(ValueError, match="amd-mi300x: AISimulate's tables time no MI300X GEMMs"):
        with_tables(select("amd-mi300x"), exports)


def test_a_point_on_the_tables_simulates_with_them(exports):
    point = with_tables(select("cisco-h200"), exports)[0]
    rate = point.scheduled_qps / point.replicas
    out = run(2.0, 40, False, 0, Console(file=io.StringIO()), (point,), steps=True)
    row = out["points"][0]
    assert row["calibration"] == point.calibration
    catalog = run(2.0, 40, False, 0, Console(file=io.StringIO()), select("cisco-h200"))["points"][0]
    assert "calibration" not in catalog and "simulated_step" not in catalog  # as before the option
    assert row["predicted"]["tpot_ms"] != catalog["predicted"]["tpot_ms"]
    # the tables reach the simulation: its JSON names the source
    assert simulate(point, rate, 20).raw["config"]["calibration"] == point.calibration
    step = row["simulated_step"]
    assert step["tokens"] >= step["requests"] > 0 and step["ms"] > 0


def test_the_typical_step_weighs_steps_by_their_decodes():
    lines = [
        {"num_prefill_tokens": 500, "num_decode_tokens": 0, "batch_size": 1, "duration": 0.050},
        {"num_prefill_tokens": 100, "num_decode_tokens": 10, "batch_size": 11, "duration": 0.020},
        {"num_prefill_tokens": 0, "num_decode_tokens": 30, "batch_size": 30, "duration": 0.010},
    ]
    assert step_summary(lines) == {"tokens": 50.0, "requests": 25.2, "ms": 12.5}


def test_step_terms_price_each_step_on_its_engines_tables(exports):
    from benchmarks.step_terms import H200, STEPS, calibrated, terms

    assert calibrated(H200, "trtllm", {}, "x") is H200
    dep = calibrated(H200, "trtllm", exports, "Cisco")
    assert dep.calibration == f"aisim:{exports['trtllm']}"
    cisco = next(s for s in STEPS if s.deployment == H200)
    before, after = terms(cisco), terms(replace(cisco, deployment=dep))
    assert after["GEMMs"] != before["GEMMs"] and after["decode attention"] == before["decode attention"]
    with pytest.raises(ValueError, match="has no trtllm=FILE"):
        calibrated(H200, "trtllm", {"vllm": exports["vllm"]}, "Cisco")
