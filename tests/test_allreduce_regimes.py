"""vLLM's all-reduce kernel choice (allreduce_regimes.py) and the catalog's regime lines."""

from __future__ import annotations

import pytest

from tailserve.executors.simulated.allreduce_regimes import GPU_CAPABILITY, vllm_allreduce
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model

KIB, MIB = 1024, 1024 * 1024
V024, V031, V032 = (vllm_allreduce(v) for v in ("0.24.0", "0.31.0", "0.32.0"))


@pytest.mark.parametrize(
    ("rules", "cap", "tp", "nbytes", "regime"),
    [
        # csrc/custom_all_reduce.cuh: one stage at TP 2 always, < 512 KiB at TP <= 4, < 256 KiB at 8
        (V024, "10.0", 2, 2 * MIB - 16, "custom_1stage"),
        (V024, "10.0", 4, 512 * KIB - 16, "custom_1stage"),
        (V024, "10.0", 4, 512 * KIB, "custom_2stage"),
        (V024, "10.0", 8, 256 * KIB - 16, "custom_1stage"),
        (V024, "10.0", 8, 256 * KIB, "custom_2stage"),
        # custom below CUSTOM_ALL_REDUCE_MAX_SIZES (strict), then symmetric memory up to its max
        (V024, "10.0", 2, 2 * MIB, "symm_two_shot"),
        (V024, "10.0", 2, 8 * MIB, "symm_two_shot"),
        (V024, "10.0", 2, 8 * MIB + 16, "nccl"),
        (V024, "10.0", 8, 1 * MIB, "symm_multimem"),  # multimem at TP 6 and 8 on sm_100
        (V024, "10.0", 8, 128 * MIB, "symm_multimem"),
        (V024, "10.0", 8, 128 * MIB + 16, "nccl"),
        (V024, "10.0", 4, 32 * MIB, "symm_two_shot"),
        (V024, "10.0", 4, 32 * MIB + 16, "nccl"),
        # 0.31 / 0.32: FlashInfer first, up to its workspace (inclusive); one shot while bytes x TP <= 1 MiB
        (V031, "9.0", 8, 128 * KIB, "flashinfer_oneshot"),
        (V031, "9.0", 8, 128 * KIB + 16, "flashinfer_twoshot"),
        (V031, "9.0", 8, 512 * KIB, "flashinfer_twoshot"),
        (V031, "9.0", 8, 512 * KIB + 16, "symm_multimem"),  # custom's 256 KiB cap is below
        (V031, "9.0", 8, 64 * MIB, "symm_multimem"),
        (V031, "9.0", 8, 64 * MIB + 16, "nccl"),
        (V031, "9.0", 4, 256 * KIB, "flashinfer_oneshot"),
        (V031, "9.0", 4, 2 * MIB, "flashinfer_twoshot"),
        (V031, "9.0", 4, 2 * MIB + 16, "custom_2stage"),
        (V031, "9.0", 4, 8 * MIB - 16, "custom_2stage"),  # min(32 MiB, the 8 MiB max_size)
        (V031, "9.0", 4, 8 * MIB, "symm_multimem"),
        (V031, "9.0", 4, 32 * MIB, "symm_multimem"),
        (V031, "9.0", 4, 32 * MIB + 16, "nccl"),
        (V031, "9.0", 2, 512 * KIB, "flashinfer_oneshot"),
        (V031, "9.0", 2, 64 * MIB, "flashinfer_twoshot"),
        (V031, "9.0", 2, 64 * MIB + 16, "nccl"),
        (V032, "10.3", 8, 4 * MIB, "flashinfer_twoshot"),
        (V032, "10.3", 8, 4 * MIB + 16, "symm_multimem"),
        (V032, "10.0", 4, 32 * MIB + 16, "nccl"),
    ],
)
def test_regime_boundaries_are_where_vllm_puts_them(rules, cap, tp, nbytes, regime) -> None:
    assert rules.regime(cap, tp, nbytes) == regime


def test_edges_list_each_regime_once_with_its_last_size() -> None:
    assert V031.edges("9.0", 8) == (
        ("flashinfer_oneshot", 128 * KIB),
        ("flashinfer_twoshot", 512 * KIB),
        ("symm_multimem", 64 * MIB),
        ("nccl", 1 << 40),
    )
    assert V024.edges("10.0", 4) == (
        ("custom_1stage", 512 * KIB - 16),
        ("custom_2stage", 2 * MIB - 16),
        ("symm_two_shot", 32 * MIB),
        ("nccl", 1 << 40),
    )


@pytest.mark.parametrize(("gpu", "version"), [("B200", "0.24.0"), ("GB200", "0.31.0"), ("B300", "0.31.0")])
def test_catalog_band_edges_are_the_source_boundaries(gpu: str, version: str) -> None:
    hw = get_hardware(gpu)
    rules = vllm_allreduce(version)
    tps = sorted({b.tp for b in hw.allreduce_bands})
    assert tps
    for tp in tps:
        edges = [top for _, top in rules.edges(GPU_CAPABILITY[gpu], tp)]
        assert [b.max_bytes for b in hw.allreduce_bands_at(tp)] == edges


def test_cost_model_prices_each_token_count_on_its_kernels_line() -> None:
    # Llama-3-70B (hidden 8,192, bf16): 16 tokens = 256 KiB, B200 TP 8's first two-stage size
    m = get_model("Llama-3-70B")
    hw = get_hardware("B200")
    cm = CostModel(m, hw, 8)
    ring = 2 * 7 / 8
    for tokens, band in ((15, 0), (16, 1), (64, 2)):
        b = hw.allreduce_bands_at(8)[band]
        one = b.latency + ring * tokens * 8192 * 2 / (hw.interconnect_bandwidth * b.efficiency)
        assert cm._comm(tokens) == pytest.approx(2 * m.num_layers * one, rel=1e-12)


def test_bad_input_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"no vLLM all-reduce rules for version '0\.9\.0'"):
        vllm_allreduce("0.9.0")
    with pytest.raises(ValueError, match=r"compute capability '8\.0'"):
        V031.regime("8.0", 2, 1024)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        V031.regime("9.0", 1, 1024)
