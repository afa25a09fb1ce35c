"""Per-GEMM series from Vidur's profiles: each op on its own shape, kernel-choice jumps found
where they are planted (and not at the curve's own tile steps), and a training series of the
same shape transferring its jumps to a held-out one."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.executors.simulated.cost_model import Efficiency
from tailserve.executors.simulated.gemm_regimes import (
    GemmSeries,
    curve_times,
    jumps,
    layer_times,
    load_gemm_series,
    pair_agreement,
    same_shape_pairs,
    transfer_times,
)
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.profiles import ProfileError
from vidur_helpers import write_mlp

H100 = get_hardware("H100-SXM")
EFF = Efficiency(
    compute=0.75, memory=0.86, sharpness=6.0, tile_m=128, tile_n=128, wave_alpha=0.3, gemm_latency=3e-6
)
TOKENS = np.array([1, 8, 16, 64, 128, 136, 256, 384, 512, 520, 576, 640, 648, 1024, 2048])


LLAMA70 = {"n_head": 64, "n_kv_head": 8, "n_embd": 8192, "n_expanded_embd": 28672, "vocab_size": 32000}


def test_each_op_becomes_its_own_series_with_its_shard_shape(tmp_path):
    rows = [(n, tp, (0.1 * n, 0.2, 0.3, 0.4)) for tp in (1, 2) for n in (1, 8, 16)]
    series = load_gemm_series(write_mlp(tmp_path / "m" / "mlp.csv", LLAMA70, rows))
    shapes = {(s.op, s.tp): s.shape for s in series}
    assert shapes[("qkv", 1)] == (8192 + 2 * 1024, 8192)
    assert shapes[("o", 2)] == (8192, 4096)
    assert shapes[("up", 2)] == (28672, 8192)
    assert shapes[("down", 1)] == (8192, 28672)
    qkv = next(s for s in series if s.op == "qkv" and s.tp == 1)
    assert qkv.tokens.tolist() == [1, 8, 16]
    assert qkv.seconds.tolist() == pytest.approx([1e-4, 8e-4, 16e-4])


def test_a_malformed_profile_is_rejected_with_file_and_line(tmp_path):
    path = write_mlp(
        tmp_path / "m" / "mlp.csv", LLAMA70, [(1, 1, (0.1, 0.2, 0.3, 0.4)), (8, 1, (1, 1, 1, 1))]
    )
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace("1,1,1,1", "1,x,1,1", 1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProfileError, match=r"mlp\.csv:3: column .* not a number: 'x'"):
        load_gemm_series(path)


def _series(model: str, n: int, k: int, factor: np.ndarray) -> GemmSeries:
    s = GemmSeries(model, "down", 1, n, k, TOKENS, np.ones(len(TOKENS)))
    return GemmSeries(model, "down", 1, n, k, TOKENS, curve_times(s, H100, EFF) * factor)


def test_a_planted_kernel_jump_is_found_and_the_curves_own_steps_are_not():
    flat = _series("a", 8192, 28672, np.ones(len(TOKENS)))
    # The curve itself steps by more than the threshold (512 -> 520 tokens: a fifth row tile);
    # that is the curve's own step, not a jump.
    curve = curve_times(flat, H100, EFF)
    assert (curve[1:] / curve[:-1]).max() > 1.15
    assert jumps(flat, H100, EFF) == []
    # A slow kernel between 520 and 640 tokens (2.5x the curve): a jump in and a jump out.
    factor = np.where((TOKENS >= 520) & (TOKENS <= 640), 2.5, 1.0)
    assert jumps(_series("a", 8192, 28672, factor), H100, EFF) == [520, 648]


def test_a_training_gemm_of_the_same_shape_carries_its_jumps_to_a_held_out_one():
    factor = np.where((TOKENS >= 520) & (TOKENS <= 640), 2.5, 1.0)
    train = [_series("train", 8192, 8192, factor), _series("train", 10240, 8192, np.ones(len(TOKENS)))]
    held = _series("held", 8192, 8192, factor)
    np.testing.assert_allclose(transfer_times(held, train, H100, EFF, "exact"), held.seconds, rtol=1e-12)
    # Another shape: ``exact`` keeps the curve; ``nearest`` borrows the nearest shape's ratios.
    other = _series("held", 8192, 22016, factor)
    np.testing.assert_allclose(
        transfer_times(other, train, H100, EFF, "exact"), curve_times(other, H100, EFF), rtol=1e-12
    )
    np.testing.assert_allclose(transfer_times(other, train, H100, EFF, "nearest"), other.seconds, rtol=1e-12)
    # by-tokens: the median ratio of the training GEMMs at each count (here 1.75 inside the band).
    by_tokens = transfer_times(other, train, H100, EFF, "by-tokens") / curve_times(other, H100, EFF)
    assert by_tokens.tolist() == pytest.approx(np.where(factor > 1, 1.75, 1.0).tolist())
    with pytest.raises(ValueError, match="unknown transfer mode"):
        transfer_times(other, train, H100, EFF, "closest")


def test_same_shape_pairs_and_layer_sums():
    a = _series("a", 8192, 8192, np.ones(len(TOKENS)))
    b = _series("b", 8192, 8192, np.full(len(TOKENS), 1.1))
    c = _series("b", 4096, 8192, np.ones(len(TOKENS)))
    pairs = same_shape_pairs([a, b, c])
    assert [(x.model, y.model) for x, y in pairs] == [("a", "b")]
    assert pair_agreement(a, b) == pytest.approx(np.full(len(TOKENS), 0.1))
    pred, meas = layer_times([a, c], H100, EFF, None, "exact")
    np.testing.assert_allclose(pred, meas, rtol=1e-12)
    np.testing.assert_allclose(meas, a.seconds + c.seconds)
    with pytest.raises(ValueError, match="wave form"):
        curve_times(a, H100, Efficiency(tile_m=128))


def test_tile_choice_prices_the_fastest_tile_and_its_fit_recovers_planted_factors():
    from dataclasses import replace

    from tailserve.executors.simulated.tile_choice import TileChoice, fit_tile_choice, tile_choice_times

    s = _series("a", 57344, 8192, np.ones(len(TOKENS)))
    one = TileChoice(EFF, ((EFF.tile_m, EFF.tile_n),), (1.0,))
    np.testing.assert_allclose(tile_choice_times(s, H100, one), curve_times(s, H100, EFF), rtol=1e-12)
    # A 64-row tile at 0.9 of the efficiency beside the 128-row one: at 136 tokens (the 128 tile
    # pads to 256 rows, the 64 tile to 192) the small tile wins on this compute-bound GEMM, and
    # the step the fixed tile puts at 136 shrinks.
    two = TileChoice(replace(EFF, tile_m=128), ((64, 128), (128, 128)), (0.9, 1.0))
    fixed = curve_times(s, H100, replace(EFF, tile_m=128))
    chosen = tile_choice_times(s, H100, two)
    assert np.all(chosen <= fixed * (1 + 1e-12))
    i = int(np.searchsorted(TOKENS, 136))
    assert chosen[i] < 0.95 * fixed[i]
    # Layers measured as that form: the fit finds the planted factors (grid points) and latency.
    layers = []
    for n, k in ((10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)):
        g = GemmSeries("m", "down", 1, n, k, TOKENS, np.ones(len(TOKENS)))
        layers.append(GemmSeries("m", "down", 1, n, k, TOKENS, tile_choice_times(g, H100, two)))
    fitted = fit_tile_choice([layers], H100, replace(EFF, tile_m=128), tiles=two.tiles, grid=(0.6, 0.9, 1.0))
    assert fitted.scales == (0.9, 1.0)
    assert fitted.eff.gemm_latency == pytest.approx(EFF.gemm_latency)
    with pytest.raises(ValueError, match="no training layers"):
        fit_tile_choice([], H100, EFF)


def test_the_tile_choice_cost_model_prices_iterations_with_the_same_gemms():
    from dataclasses import replace

    from tailserve.executors.simulated.cost_model import CostModel
    from tailserve.executors.simulated.models import ModelSpec
    from tailserve.executors.simulated.tile_choice import TileChoice, TileChoiceCostModel, tile_choice_times

    layer = ModelSpec("layer", 8192, 1, 64, 8, 28672, 32000, 1)
    eff = replace(EFF, tile_m=128)
    tiles, scales = ((64, 128), (128, 128)), (0.9, 1.0)
    cm = TileChoiceCostModel(layer, H100, 2, eff, tiles, scales)
    base = CostModel(layer, H100, 2, eff)
    series = [
        GemmSeries(
            "layer",
            op,
            2,
            int(n),
            int(k),
            TOKENS,
            np.ones(len(TOKENS)),
            base._kv_bytes_per_token if i == 0 else 0.0,
        )
        for i, (op, (n, k)) in enumerate(zip(("qkv", "o", "up", "down"), base._gemm_shapes))
    ]
    want = sum(tile_choice_times(s, H100, TileChoice(eff, tiles, scales)) for s in series)
    got = np.array([cm.linear_time(int(n)) for n in TOKENS])
    np.testing.assert_allclose(got, want, rtol=1e-9)
    # One tile at the curve's efficiency is the wave form itself; never slower than it.
    same = TileChoiceCostModel(layer, H100, 2, eff, ((128, 128),), (1.0,))
    assert [same.linear_time(int(n), 4) for n in TOKENS] == pytest.approx(
        [base.linear_time(int(n), 4) for n in TOKENS]
    )
    assert all(cm.linear_time(int(n), 4) <= base.linear_time(int(n), 4) * (1 + 1e-12) for n in TOKENS)
    with pytest.raises(ValueError, match="wave form"):
        TileChoiceCostModel(layer, H100, 2, Efficiency(tile_m=128), tiles, scales)


def test_the_aisim_wave_fit_recovers_a_planted_curve_with_its_quantization_kernel():
    from benchmarks.fidelity_aisim import fit_waves, wave_parts, wave_time

    hw = get_hardware("H200")
    m, n, k = (
        np.array(v, dtype=float).ravel()
        for v in np.meshgrid([1, 16, 64, 129, 512, 2049, 8192], [256, 1024, 4096, 16384], [2048, 7168, 28672])
    )
    planted = dict(tile_m=64, tile_n=128, wave_alpha=0.3, quant_bytes=3.0)
    args = (m, n, k, 1.0, hw.peak_for("fp8"), hw, 64, 128, 0.3)
    y = wave_time(wave_parts(*args, 3.0), 0.6, 0.8, 3.0, 5e-6)
    got = fit_waves(m, n, k, y, 1.0, hw.peak_for("fp8"), hw, (0.0, 3.0))
    assert {key: got[key] for key in planted} == planted
    assert (got["compute"], got["memory"], got["sharpness"]) == pytest.approx((0.6, 0.8, 3.0))
    assert got["gemm_latency"] == pytest.approx(5e-6, rel=1e-6)
    # without the quantization kernel's bytes the same times fit worse: the term is seen in them
    without = fit_waves(m, n, k, y, 1.0, hw.peak_for("fp8"), hw, (0.0,))
    pred = wave_time(wave_parts(*args[:6], without["tile_m"], without["tile_n"], without["wave_alpha"], 0.0),
                     without["compute"], without["memory"], without["sharpness"], without["gemm_latency"])  # fmt: skip
    assert np.mean(np.abs(pred / y - 1)) > 0.01


def test_the_aisim_moe_rows_of_a_format_are_one_kernels():
    from benchmarks.fidelity_aisim import main_kernel

    def row(kernel, hidden, tokens):  # the export's columns: format, tokens, shape, TP, EP, kernel, ms
        return ["fp8", tokens, hidden, 1024, 2, 8, 1, 1, kernel, 0.1]

    rows = [row("triton", h, t) for h in (1024, 2048, 4096) for t in (1, 2)] + [
        row("cutlass", h, t) for h in (1024, 2048) for t in (1, 2, 4, 8)
    ]
    kernel, kept = main_kernel(rows)
    assert kernel == "triton" and len(kept) == 6 and all(r[8] == "triton" for r in kept)


# ---- a weight format's own GEMM curve (GemmCurve.format_curves) --------------------------------


def _fp8_llama(hw_name="H100-SXM"):
    from dataclasses import replace

    from tailserve.executors.simulated.models import get_model

    return replace(get_model("Llama-3-8B"), weight_dtype="fp8"), get_hardware(hw_name)


def _with_curves(hw, curves):
    from dataclasses import replace

    return replace(hw, gemm=replace(hw.gemm, format_curves=curves))


FP8_CURVE_ARGS = (0.6, 0.8, 3.0, 64, 6e-6, "test")


def test_a_format_curve_prices_each_dense_gemm_in_its_own_wave_form():
    from tailserve.executors.simulated.cost_model import CostModel
    from tailserve.executors.simulated.gemm import curve_gemm_time, gemm_shapes
    from tailserve.executors.simulated.hardware import GemmCurve

    model, hw = _fp8_llama()
    curve = GemmCurve(*FP8_CURVE_ARGS, tile_n=128, wave_alpha=0.7)
    cm = CostModel(model, _with_curves(hw, (("fp8", curve),)))
    assert cm.format_curve is curve
    tokens = 161
    shapes = gemm_shapes(model.hidden_size, 4096, 1024, 14336, True)
    kv = tokens * cm._kv_bytes_per_token / (4 * model.num_layers)
    layer = sum(
        curve_gemm_time(tokens, n, k, curve, hw.peak_for("fp8"), hw.memory_bandwidth, hw.sms, 1.0, 2.0, kv)
        for n, k in shapes
    )
    assert cm.linear_time(tokens) == pytest.approx(model.num_layers * layer, rel=1e-12)
    # the term is used: another partial-wave cost or column tile moves the price
    for other in (
        GemmCurve(*FP8_CURVE_ARGS, tile_n=128, wave_alpha=0.0),
        GemmCurve(*FP8_CURVE_ARGS, tile_n=256),
    ):
        assert CostModel(model, _with_curves(hw, (("fp8", other),))).linear_time(tokens) != pytest.approx(
            cm.linear_time(tokens), rel=1e-3
        )


def test_a_format_without_its_own_curve_and_a_calibrated_efficiency_keep_the_factors():
    from dataclasses import replace

    from tailserve.executors.simulated.cost_model import CostModel
    from tailserve.executors.simulated.hardware import GemmCurve

    model, hw = _fp8_llama()
    bare = _with_curves(hw, ())
    other = _with_curves(hw, (("nvfp4", GemmCurve(*FP8_CURVE_ARGS, tile_n=128)),))
    own = _with_curves(hw, (("fp8", GemmCurve(*FP8_CURVE_ARGS, tile_n=128)),))
    for tokens, logits in ((1, 1), (161, 8), (4096, 0)):
        before = CostModel(model, bare).linear_time(tokens, logits)
        assert CostModel(model, other).linear_time(tokens, logits) == before  # exactly
        assert CostModel(model, own).linear_time(tokens, logits) != before
        calibrated = replace(Efficiency.for_hardware(own), compute=0.5)
        assert CostModel(model, own, efficiency=calibrated).linear_time(tokens, logits) == CostModel(
            model, bare, efficiency=calibrated
        ).linear_time(tokens, logits)


def test_the_tile_by_shape_table_picks_the_first_matching_entry():
    from tailserve.executors.simulated.gemm import curve_gemm_time, shape_tiles
    from tailserve.executors.simulated.hardware import GemmCurve

    table = ((16, 0, 16, 64), (64, 1280, 16, 64), (64, 0, 64, 64), (128, 0, 64, 128))
    tm, tn = shape_tiles(np.array([1, 16, 17, 40, 64, 65, 128, 129, 9000]), 1024, table, 128, 256)
    assert list(tm) == [16, 16, 16, 16, 16, 64, 64, 128, 128]
    assert list(tn) == [64, 64, 64, 64, 64, 128, 128, 256, 256]
    tm, tn = shape_tiles(np.array([17, 64]), 4096, table, 128, 256)
    assert list(tm) == [64, 64] and list(tn) == [64, 64]
    hw = get_hardware("H200")
    fixed = GemmCurve(0.6, 0.8, 3.0, 128, 5e-6, "test", tile_n=128, wave_alpha=1.0)
    tiled = GemmCurve(0.6, 0.8, 3.0, 128, 5e-6, "test", tile_n=128, wave_alpha=1.0, m_tiles=table)
    args = (hw.peak_for("fp8"), hw.memory_bandwidth, hw.sms, 1.0, 2.0)
    # a narrow N, long K GEMM of 16 rows: 64-column tiles run 4 tiles where 128-column ones run 2
    assert curve_gemm_time(16, 256, 65536, tiled, *args) < curve_gemm_time(16, 256, 65536, fixed, *args)
    assert curve_gemm_time(4096, 4096, 4096, tiled, *args) == curve_gemm_time(4096, 4096, 4096, fixed, *args)
    with pytest.raises(ValueError, match="m_tiles"):
        GemmCurve(0.6, 0.8, 3.0, 128, 5e-6, "test", m_tiles=table)


def test_moe_and_mla_models_take_the_format_curve():
    from dataclasses import replace

    from tailserve.executors.simulated.cost_model import CostModel
    from tailserve.executors.simulated.models import get_model

    hw = get_hardware("H200")
    bare = replace(hw, gemm=replace(hw.gemm, format_curves=()))
    deepseek = get_model("deepseek-v3")  # MLA, block-scaled FP8, a fitted MLA block on the H200
    cm = CostModel(deepseek, hw, 8)
    assert cm.format_curve is hw.gemm.curve_for("fp8_block")
    # the MLA projections stay with the block: the 3 dense MLPs, each MoE layer's shared expert
    # and router are the dense GEMMs on the curve
    assert [c for _, _, c in cm._dense_gemms] == [3, 3, 58, 58, 58]
    for tokens in (8, 8192):
        assert cm.linear_time(tokens, 8) != CostModel(deepseek, bare, 8).linear_time(tokens, 8)
    # without a fitted MLA block, or one without terms for the curve's path, the projections
    # sit in the layer join: the factors price it, with the block's join-path terms
    assert CostModel(deepseek, replace(hw, mla=None), 8).format_curve is None
    join_only = replace(hw, mla=replace(hw.mla, curve_terms=()))
    assert CostModel(deepseek, join_only, 8).format_curve is None
    assert CostModel(deepseek, join_only, 8).linear_time(64, 8) == CostModel(deepseek, bare, 8).linear_time(
        64, 8
    )
    # the curve path's own terms: the block's launches per layer and a time per new token
    terms = hw.mla.curve_terms_for("fp8_block")
    assert terms.token > 0 and terms.latency > hw.mla.format_latency("fp8_block")
    assert CostModel(deepseek, bare, 8)._mla_per_token == 0.0 < cm._mla_per_token
    qwen = replace(get_model("Qwen3-235B-A22B"), weight_dtype="fp8")  # GQA MoE
    cm = CostModel(qwen, hw, 4)
    # attention QKV and output every layer, the router every MoE layer; no shared expert, no dense MLP
    assert [c for _, _, c in cm._dense_gemms] == [94, 94, 94]
    assert cm.linear_time(64) != CostModel(qwen, bare, 4).linear_time(64)


def test_the_aisim_catalog_prices_are_the_factors_before_and_the_cost_models_gemm_now():
    from benchmarks.fidelity_aisim import catalog_time, gemm_time

    from tailserve.executors.simulated.gemm import curve_gemm_time

    hw = get_hardware("H200")
    m, n, k = np.array([1.0, 161.0, 4096.0]), np.full(3, 1280.0), np.full(3, 8192.0)
    g, peak = hw.gemm, hw.peak_for("fp8")
    fc, fm = g.factors_for("fp8")
    factors = gemm_time(
        m, n, k, 1.0, peak, hw, g.compute * fc, g.memory * fm, g.sharpness, g.tile_m, g.gemm_latency
    )
    assert list(catalog_time(m, n, k, hw, "fp8", 1.0, peak, own=False)) == list(factors)
    own = curve_gemm_time(m, n, k, g.curve_for("fp8"), peak, hw.memory_bandwidth, hw.sms, 1.0, 2.0)
    assert list(catalog_time(m, n, k, hw, "fp8", 1.0, peak, own=True)) == list(own)
    assert not np.allclose(own, factors, rtol=1e-3)
    # a format without its own curve (B200's block-scaled FP8) stays on the factors either way
    b200 = get_hardware("B200")
    assert b200.gemm.curve_for("fp8_block") is None
    peak = b200.peak_for("fp8")
    assert list(catalog_time(m, n, k, b200, "fp8_block", 1.0, peak, own=True)) == list(
        catalog_time(m, n, k, b200, "fp8_block", 1.0, peak, own=False)
    )
