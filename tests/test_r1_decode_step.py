"""benchmarks/r1_decode_step.py: the R1 decode step's terms add up to the cost model's step, and
the point's mean context is the step-weighted one; behaviour only, never fidelity figures."""

from __future__ import annotations

import pytest
from benchmarks.fidelity_mlperf import DEEPSEEK_R1, POINTS
from benchmarks.r1_decode_step import published_estimate, step_context, tailserve_terms

PARTS = ("mla_block", "experts", "exchange", "dense", "lm_head", "overhead")


@pytest.mark.parametrize("gpu", ["B200", "GB200"])
def test_terms_add_up_to_the_step(gpu):
    t = tailserve_terms(gpu, 156, 256, 5000)
    assert t["step"] == pytest.approx(sum(t[k] for k in PARTS), rel=1e-9)
    assert t["mla_block"] == pytest.approx(
        t["mla_projections"] + t["mla_fixed_per_request"] + t["mla_attention"], rel=1e-12
    )
    assert all(t[k] > 0 for k in PARTS)


def test_the_graph_padding_costs_the_gemms_not_the_attention():
    real = tailserve_terms("B200", 156, 156, 5000)
    padded = tailserve_terms("B200", 156, 256, 5000)
    assert padded["step"] > real["step"]
    assert padded["experts"] > real["experts"] and padded["exchange"] > real["exchange"]
    assert padded["mla_attention"] == pytest.approx(real["mla_attention"], rel=1e-9)  # dummies hold no KV


def test_the_mean_context_is_weighted_by_decode_steps():
    point = next(p for p in POINTS if p.name == "nvidia-b200-r1")
    mean_in = sum(DEEPSEEK_R1.input_percentiles) / len(DEEPSEEK_R1.input_percentiles)
    context = step_context()
    # a long answer decodes more steps: the mean is above input + output / 2 of the mean request
    assert context > mean_in + point.out_mean / 2
    assert context < DEEPSEEK_R1.input_percentiles[-1] + DEEPSEEK_R1.max_output


def test_a_published_point_is_priced_between_its_decode_and_context_steps():
    e = published_estimate("DeepSeek-R1-FP4-v2", "fp8", 256)
    assert e["with_context_ms"] > e["decode_ms"]
    assert e["decode_ms"] < e["step_ms"] < e["with_context_ms"]
    assert e["context_share"] == pytest.approx(1 - (1 - 256 / 2049) ** 8)
    assert e["tok_s_gpu"] == pytest.approx(256 / e["step_ms"] * 1e3)
