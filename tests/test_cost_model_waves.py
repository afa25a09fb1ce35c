"""The per-GEMM wave form and the banded all-reduce: a wave step at the SM count, the fit's
vectorised terms equal the cost model, fits recover known curves and bands, the vectorised
decode path stays bit-identical to the per-iteration one, bad settings are refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
from tailserve.executors.simulated.gemm import padded_rows, padded_tokens, wave_flops
from tailserve.executors.simulated.hardware import (
    H100_ALLREDUCE_BANDS,
    H100_GEMM_WAVES,
    AllReduceBand,
    get_hardware,
)
from tailserve.executors.simulated.models import ModelSpec, get_model
from tailserve.executors.simulated.profile_fit import (
    _LinearTerms,
    all_reduce_band_time,
    fit_all_reduce_bands,
    fit_linear,
    linear_errors,
)
from tailserve.executors.simulated.profiles import AllReduceSample, LinearProfile, LinearSample

WAVES = Efficiency(compute=0.75, memory=0.85, sharpness=4.0, tile_m=128, tile_n=128, wave_alpha=1.0)


def test_a_partial_wave_costs_alpha_of_a_whole_one():
    # 108 SMs (A100), 128x128 tiles, N = 108 tiles wide: 128 rows fill one wave exactly; 129 rows
    # need a second row of tiles, a second wave, twice the flops of the first.
    n, k, sms = 108 * 128, 4096, 108
    one = wave_flops(128, n, k, 128, 128, sms, 1.0)
    assert one == 2.0 * 128 * n * k  # a full wave does exactly the GEMM's work
    assert wave_flops(padded_tokens(129, 128), n, k, 128, 128, sms, 1.0) == 2 * one
    # 110 tiles (N one tile wider): 1.02 waves of work, 2 waves of time when partial waves cost
    # in full, 1.02 when they are free (alpha 0), 1.51 at alpha 0.5.
    wide = n + 2 * 128
    x = 110 / 108
    for alpha, waves in ((1.0, 2.0), (0.0, x), (0.5, x + 0.5 * (2 - x))):
        assert wave_flops(128, wide, k, 128, 128, sms, alpha) == pytest.approx(
            waves * sms * 2 * 128 * 128 * k
        )


def test_wave_step_shows_in_the_cost_model_at_the_sm_count():
    hw = get_hardware("A100-80GB")
    assert hw.sms == 108
    # qkv of Llama-3-8B at TP 1 is 48 tiles of 128 columns: 2 row tiles (96 tiles) fit one wave
    # of 108 SMs, 3 row tiles (144) need two; the time steps where the row tiles do.
    cm = CostModel(get_model("Llama-3-8B"), hw, 1, WAVES)
    n, k = cm._gemm_shapes[0]
    assert (n, k) == (6144, 4096)
    t = {m: cm._gemm(m, n, k, 0.0) for m in (250, 256, 257, 384)}
    assert t[257] / t[256] > 1.6  # one wave -> two
    assert t[256] / t[250] < 1.02 and t[384] / t[257] < 1.02  # within a wave: the same time


def test_fit_terms_equal_the_cost_models_linear_time_in_the_wave_form():
    hw = get_hardware("H100-SXM")
    spec = ModelSpec("layer", 4096, 1, 32, 8, 14336, 128256, 1)
    samples = tuple(LinearSample(n, tp, 1.0) for tp in (1, 2, 8) for n in (1, 7, 100, 129, 300, 3000))
    eff = replace(WAVES, tile_m=256, wave_alpha=0.3, gemm_latency=3e-6)
    terms = _LinearTerms(LinearProfile("x", spec, samples), hw)
    for s, t in zip(samples, terms.times(eff)):
        assert CostModel(spec, hw, s.tp, eff).linear_time(s.num_tokens) == pytest.approx(t, rel=1e-12)
    rows = np.array([1, 15, 17, 100, 128, 129, 300])
    assert padded_rows(rows, 128).tolist() == [padded_tokens(int(r), 128) for r in rows]


def test_wave_fit_recovers_a_known_curve():
    hw = get_hardware("A100-80GB")
    spec = ModelSpec("layer", 4096, 1, 32, 8, 14336, 128256, 1)
    truth = Efficiency(
        compute=0.74, memory=0.82, sharpness=4.0, tile_m=128, tile_n=256, wave_alpha=0.3, gemm_latency=5e-6
    )
    grid = (1, 8, 64, 128, 136, 256, 300, 512, 700, 1024, 2048, 4096)
    samples = tuple(LinearSample(n, tp, 1.0) for tp in (1, 2, 4) for n in grid)
    times = _LinearTerms(LinearProfile("x", spec, samples), hw).times(truth)
    prof = LinearProfile("x", spec, tuple(replace(s, seconds=float(t)) for s, t in zip(samples, times)))
    fitted = fit_linear([prof], hw, ((128, 128, 0.3), (128, 256, 0.3), (128, 256, 0.0)))
    assert (fitted.tile_n, fitted.wave_alpha, fitted.sharpness) == (256, 0.3, 4.0)
    assert fitted.compute == pytest.approx(0.74, abs=0.003)
    assert fitted.memory == pytest.approx(0.82, abs=0.003)
    assert linear_errors(prof, hw, fitted).max_abs < 0.01


def test_band_fit_recovers_known_bands_and_the_model_prices_each_band():
    hw = get_hardware("A100-80GB")
    truth = (
        AllReduceBand(4, 512 * 1024, 20e-6, 0.3),
        AllReduceBand(4, 8 * 2**20, 25e-6, 0.6),
        AllReduceBand(4, 2**27, 40e-6, 0.8),
    )
    sizes = np.geomspace(8192, 2**27, 60)
    times = all_reduce_band_time(truth, hw.interconnect_bandwidth, sizes)
    samples = [AllReduceSample(4, int(b), float(t)) for b, t in zip(sizes, times)]
    bands = fit_all_reduce_bands(samples, hw)
    assert [b.max_bytes for b in bands[:2]] == [512 * 1024, 8 * 2**20]
    for got, want in zip(bands, truth):
        assert got.latency == pytest.approx(want.latency, rel=1e-3)
        assert got.efficiency == pytest.approx(want.efficiency, rel=1e-3)
    # The cost model: two all-reduces per layer of (tokens x hidden x 2 bytes), each in its band.
    spec = get_model("Llama-3-70B")
    cm = CostModel(spec, replace(hw, allreduce_bands=truth), 4)
    for tokens in (1, 16, 64, 1000, 8192):
        msg = tokens * spec.hidden_size * spec.dtype_bytes
        one = all_reduce_band_time(truth, hw.interconnect_bandwidth, np.array([float(msg)]))[0]
        assert cm._comm(tokens) == pytest.approx(2 * spec.num_layers * one, rel=1e-12)


@pytest.mark.parametrize("variant", ["waves", "bands", "both"])
def test_vectorised_decode_path_is_bit_identical(variant):
    hw = get_hardware("H100-SXM")
    if variant in ("waves", "both"):
        hw = replace(hw, gemm=H100_GEMM_WAVES)
    if variant in ("bands", "both"):
        hw = replace(hw, allreduce_bands=H100_ALLREDUCE_BANDS)
    cm = CostModel(get_model("Llama-3-70B"), hw, 4)
    for n in (1, 7, 64, 300):
        run = cm.decode_run_times(n, 5000, 9)
        steps = cm.decode_step_times(n, 5000, 9)
        one_by_one = [cm.iteration_time(BatchShape(n, n, 0, 0, 5000 + n * i)) for i in range(9)]
        assert run.tolist() == steps == one_by_one
    assert cm._comm(np.array([3, 3000])).tolist() == [cm._comm(3), cm._comm(3000)]


def test_bad_wave_settings_are_refused():
    with pytest.raises(ValueError, match="tile_n must be >= 0"):
        Efficiency(tile_n=-1)
    with pytest.raises(ValueError, match=r"wave_alpha must be in \[0, 1\]"):
        Efficiency(wave_alpha=1.5)
    no_sms = replace(get_hardware("A100-80GB"), sms=0)
    with pytest.raises(ValueError, match="needs its SM count"):
        CostModel(get_model("Llama-3-8B"), no_sms, 1, WAVES)
