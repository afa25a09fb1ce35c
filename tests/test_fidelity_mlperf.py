"""The MLPerf point definitions (benchmarks/fidelity_mlperf.py) load, are self-consistent, and
simulate through the CLI's path; behaviour only, never timing or fidelity figures."""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks.fidelity_mlperf import (
    CNN_DAILYMAIL,
    DEEPSEEK_R1,
    LIMITS,
    OPENORCA,
    POINTS,
    capacity,
    select,
    simulate,
    trace,
)

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
