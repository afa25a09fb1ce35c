"""The MLA block's decode path (``hardware.MlaKernel``): its per-request terms, and the fast
paths' decode prices equal to the general one, float for float."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model

DEEPSEEK = get_model("deepseek-v3")  # block-scaled FP8 weights, as published
DEEPSEEK_BF16 = replace(DEEPSEEK, weight_dtype="")


@pytest.mark.parametrize("gpu", ["H200", "B200"])
@pytest.mark.parametrize("tp", [1, 8])
def test_decode_fast_paths_price_as_iteration_time(gpu: str, tp: int) -> None:
    cm = CostModel(DEEPSEEK, get_hardware(gpu), tp)
    for n, context in ((1, 5), (7, 3_000), (64, 64 * 4_096)):
        steps = cm.decode_step_times(n, context, 5)
        run = cm.decode_run_times(n, context, 5)
        assert steps == [float(x) for x in run]
        for i, t in enumerate(steps):
            kv = context + n * i
            assert t == cm._iteration_time(n, n, 0, 0, kv)


def test_decode_path_grows_with_requests_heads_and_context() -> None:
    hw = get_hardware("B200")
    cm = CostModel(DEEPSEEK_BF16, hw, 8)
    mla, layers, heads = hw.mla, cm.model.num_layers, cm.model.num_heads / 8
    assert mla.decode_request > 0 and mla.decode_head > 0 and mla.decode_context > 0
    one = cm.mla_fixed_time(BatchShape.of([], [100]))
    many = cm.mla_fixed_time(BatchShape.of([], [100] * 64))
    per_decode = layers * (mla.decode_request + heads * mla.decode_head)
    assert many - one == pytest.approx(63 * per_decode)
    long = cm.mla_fixed_time(BatchShape.of([], [100_000]))
    assert long - one == pytest.approx(layers * mla.decode_context * (100_001 - 101))
    assert cm.mla_fixed_time(BatchShape.of([(512, 0)], [])) == pytest.approx(layers * mla.prefill_latency)


def test_without_the_terms_the_decode_path_is_its_fixed_time() -> None:
    hw = get_hardware("B200")
    bare = replace(hw, mla=replace(hw.mla, decode_request=0.0, decode_head=0.0, decode_context=0.0))
    cm = CostModel(DEEPSEEK_BF16, bare, 8)
    shape = BatchShape.of([], [2_000] * 32)
    assert cm.mla_fixed_time(shape) == pytest.approx(cm.model.num_layers * hw.mla.decode_latency)
    assert np.isfinite(cm.iteration_time(shape))


def test_fp8_weights_add_their_format_terms() -> None:
    hw = get_hardware("B200")
    bf16 = CostModel(DEEPSEEK_BF16, hw, 8)
    fp8 = CostModel(DEEPSEEK, hw, 8)
    layers, mla = bf16.model.num_layers, hw.mla
    assert mla.format_latency("fp8_block") > 0 and mla.format_latency("bf16") == 0.0
    shape = BatchShape.of([], [100] * 16)
    extra = layers * (mla.format_latency("fp8_block") + 16 * mla.format_request("fp8_block"))
    assert fp8.mla_fixed_time(shape) - bf16.mla_fixed_time(shape) == pytest.approx(extra)
