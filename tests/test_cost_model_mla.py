"""The MLA block's paths (``hardware.MlaKernel``): the per-request terms of each (prefill
chunks, decodes: ``BatchShape``'s counts, not its logits), the decode terms' knee, and the fast
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
    for n, context in ((1, 5), (7, 3_000), (64, 64 * 4_096), (1_024, 1_024 * 60)):  # 1,024: past the knee
        steps = cm.decode_step_times(n, context, 5)
        run = cm.decode_run_times(n, context, 5)
        assert steps == [float(x) for x in run]
        for i, t in enumerate(steps):
            kv = context + n * i
            assert t == cm._iteration_time(n, n, 0, 0, kv, 0, n)


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
    one_chunk = layers * (mla.prefill_latency + mla.prefill_request + heads * mla.prefill_head)
    assert cm.mla_fixed_time(BatchShape.of([(512, 0)], [])) == pytest.approx(one_chunk)


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


def _per_prefill(cm: CostModel, mla) -> float:
    return cm.model.num_layers * (mla.prefill_request + cm.model.num_heads / cm.tp * mla.prefill_head)


@pytest.mark.parametrize("gpu", ["B200", "GB200", "B300"])
def test_prefill_path_pays_per_chunk(gpu: str) -> None:
    """Blackwell's FLASH_ATTN prefill: 256 prompts of 16 tokens cost more than 8 of 512 (the
    same tokens) by a time per chunk and head; the path's fixed time once either way."""
    hw = get_hardware(gpu)
    cm = CostModel(DEEPSEEK_BF16, hw, 8)
    assert hw.mla.prefill_head > 0
    short = cm.mla_fixed_time(BatchShape.of([(16, 0)] * 256, []))
    long = cm.mla_fixed_time(BatchShape.of([(512, 0)] * 8, []))
    assert short - long == pytest.approx(248 * _per_prefill(cm, hw.mla))
    assert long == pytest.approx(cm.model.num_layers * hw.mla.prefill_latency + 8 * _per_prefill(cm, hw.mla))
    assert cm.iteration_time(BatchShape.of([(16, 0)] * 256, [])) > cm.iteration_time(
        BatchShape.of([(512, 0)] * 8, [])
    )
    bare = CostModel(
        DEEPSEEK_BF16, replace(hw, mla=replace(hw.mla, prefill_request=0.0, prefill_head=0.0)), 8
    )
    assert (
        bare.mla_fixed_time(BatchShape.of([(16, 0)] * 256, []))
        == cm.model.num_layers * hw.mla.prefill_latency
    )


@pytest.mark.parametrize("gpu", ["H200", "B200"])
def test_mixed_batch_counts_its_decodes_not_its_logits(gpu: str) -> None:
    """Three prompts finishing beside ten decodes: 13 logits, 10 decodes, 3 prefill chunks. The
    two paths' terms are those of the prefill part and the decode part priced apart."""
    cm = CostModel(DEEPSEEK_BF16, get_hardware(gpu), 8)
    prefill, decodes = [(512, 0)] * 3, [100] * 10
    mixed = BatchShape.of(prefill, decodes)
    assert (mixed.num_logits, mixed.num_prefills, mixed.num_decodes) == (13, 3, 10)
    apart = cm.mla_fixed_time(BatchShape.of(prefill, [])) + cm.mla_fixed_time(BatchShape.of([], decodes))
    assert cm.mla_fixed_time(mixed) == pytest.approx(apart)
    as_logits = replace(mixed, num_decodes=mixed.num_logits)  # what counting the logits priced
    assert cm.mla_fixed_time(as_logits) > cm.mla_fixed_time(mixed)


@pytest.mark.parametrize("gpu", ["H100-SXM", "H200", "B200"])
def test_decode_terms_bend_past_the_knee(gpu: str) -> None:
    """At equal per-request context, each decode past the knee adds ``decode_beyond`` of one
    before it (Hopper: nothing past 512)."""
    hw = get_hardware(gpu)
    mla = hw.mla
    cm = CostModel(DEEPSEEK_BF16, hw, 8)
    per_decode = cm.model.num_layers * (mla.decode_request + cm.model.num_heads / 8 * mla.decode_head)
    k = mla.decode_knee
    assert k > 0
    at = cm.mla_fixed_time(BatchShape.of([], [100] * k))
    below = cm.mla_fixed_time(BatchShape.of([], [100] * (k // 2)))
    past = cm.mla_fixed_time(BatchShape.of([], [100] * (2 * k)))
    assert at - below == pytest.approx(k // 2 * per_decode)
    assert past - at == pytest.approx(k * mla.decode_beyond * per_decode)
    straight = CostModel(DEEPSEEK_BF16, replace(hw, mla=replace(mla, decode_knee=0)), 8)
    assert straight.mla_fixed_time(BatchShape.of([], [100] * (2 * k))) - at == pytest.approx(k * per_decode)


def test_a_shape_without_its_decode_count_is_refused() -> None:
    """Decode KV with no decodes is a shape built without its counts (five positional fields):
    the MLA decode terms would count one decode for the whole batch."""
    cm = CostModel(DEEPSEEK_BF16, get_hardware("H200"), 8)
    with pytest.raises(ValueError, match="num_decodes 0"):
        cm.iteration_time(BatchShape(16, 16, 0, 0, 16 * 1001))
    assert cm.iteration_time(BatchShape(16, 16, 0, 0, 16 * 1001, 0, 16)) == cm.iteration_time(
        BatchShape.of([], [1000] * 16)
    )
