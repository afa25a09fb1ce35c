"""fidelity_aisim's MLA fit recovers a known ``MlaKernel`` from rows the cost model priced with
it: the prefill path's time per chunk and head, and the decode terms' knee."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from benchmarks.fidelity_aisim import _fit_mla, _mla_layer, _mla_parts, _mla_shape

from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import MlaKernel, get_hardware

# On the fit's grids (factors 1, knee 128, half a decode past it), so the fit can land on it.
KNOWN = MlaKernel(
    (("bf16", 1.0),), 1.0, 1.0, 18e-6, 16e-6, "known", decode_request=50e-9, decode_head=5e-9,
    decode_context=250e-12, prefill_head=40e-9, decode_knee=128, decode_beyond=0.5,
)  # fmt: skip
HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def _rows(hw, phase: str) -> list[tuple[int, int, int, float]]:
    """(heads, batch, length, ms) as the known kernel prices them."""
    grid = (
        [(b, n) for b in (1, 4, 16, 64, 256) for n in (16, 128, 512, 2048)]
        if phase == "context"
        else [(b, n) for b in (1, 8, 64, 128, 256, 512, 1024) for n in (2, 1024, 16384)]
    )
    rows = []
    for h in HEADS:
        cm = CostModel(_mla_layer(h, "bf16"), replace(hw, mla=KNOWN), 1)
        for b, n in grid:
            s = _mla_shape(phase, b, n)
            rows.append(
                (
                    h,
                    b,
                    n,
                    1e3 * (cm.linear_time(s.num_tokens, 0) + cm.attention_time(s) + cm.mla_fixed_time(s)),
                )
            )
    return rows


def test_the_fit_recovers_the_per_chunk_prefill_and_the_knee() -> None:
    hw = get_hardware("B200")
    parts, train = {}, {}
    for phase in ("context", "generation"):
        rows = _rows(hw, phase)
        parts[(phase, "bf16")] = _mla_parts(hw, rows, phase, "bf16")
        train[phase] = np.isin([r[0] for r in rows], HEADS[::2])
    fit = _fit_mla(parts, train)
    assert fit.prefill_head == pytest.approx(KNOWN.prefill_head, rel=0.02)
    assert fit.prefill_request == pytest.approx(0.0, abs=1e-9)
    assert (fit.decode_knee, fit.decode_beyond) == (KNOWN.decode_knee, KNOWN.decode_beyond)
    assert fit.decode_request == pytest.approx(KNOWN.decode_request, rel=0.02)
    assert fit.decode_head == pytest.approx(KNOWN.decode_head, rel=0.02)


def test_block_fp8_on_its_format_curve_gets_its_launches_and_per_token_work_back() -> None:
    # On the H200 block-scaled FP8 has its own GEMM curve: with MlaKernel.curve_terms the MLA
    # block's projections leave the layer join (its launches and activation bytes), so the curve
    # path's terms carry them; the fit must recover a per-layer latency and a per-token time the
    # cost model prices on that path, beside the layer join path's own terms.
    from benchmarks.fidelity_aisim import _mla_linear

    from tailserve.executors.simulated.hardware import MlaCurveTerms

    hw = get_hardware("H200")
    grid = np.geomspace(0.1, 1.0, 60)  # the fit's grid
    terms = MlaCurveTerms(float(grid[47]), 30e-6, 0.0, 8e-9)
    known = replace(
        KNOWN, gemm_factors=(("bf16", 1.0), ("fp8_block", float(grid[40]))),
        latency_by_format=(("fp8_block", 5e-6),), curve_terms=(("fp8_block", terms),),
    )  # fmt: skip
    join_known = replace(known, curve_terms=())

    def rows_for(phase: str, weights: str, kernel) -> list:
        rows = []
        for h in HEADS:
            cm = CostModel(_mla_layer(h, weights), replace(hw, mla=kernel), 1)
            assert (cm.format_curve is not None) == (weights == "fp8_block" and kernel is known)
            for b, n in [(1, 16), (4, 512), (64, 2048)] if phase == "context" else [(1, 2), (64, 1024)]:
                s = _mla_shape(phase, b, n)
                rows.append(
                    (
                        h,
                        b,
                        n,
                        1e3 * (_mla_linear(cm, s.num_tokens) + cm.attention_time(s) + cm.mla_fixed_time(s)),
                    )
                )
        return rows

    parts, curve_parts, train = {}, {}, {}
    for phase in ("context", "generation"):
        for weights in ("bf16", "fp8_block"):
            rows = rows_for(phase, weights, join_known)
            parts[(phase, weights)] = _mla_parts(hw, rows, phase, weights)
            train[phase if weights == "bf16" else f"{phase}8"] = np.isin([r[0] for r in rows], HEADS[::2])
        rows = rows_for(phase, "fp8_block", known)
        curve_parts[(phase, "fp8_block")] = _mla_parts(hw, rows, phase, "fp8_block", curve=True)
    fit = _fit_mla(parts, train, curve_parts)
    assert fit.gemm_factor("fp8_block") == pytest.approx(grid[40], rel=1e-6)
    assert fit.format_latency("fp8_block") == pytest.approx(5e-6, rel=0.02)
    got = fit.curve_terms_for("fp8_block")
    assert got.gemm_factor == pytest.approx(terms.gemm_factor, rel=1e-6)
    assert got.latency == pytest.approx(30e-6, rel=0.02)
    assert got.token == pytest.approx(8e-9, rel=0.02)
    assert _fit_mla(parts, train).curve_terms == ()
