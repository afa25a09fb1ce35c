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
