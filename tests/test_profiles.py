"""Measured-profile loader and fits: malformed files named with file:line, fits recover known
curves, the GEMM row tile makes a step at the tile boundary, vidur:DIR as a calibration source."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from tailserve.executors.simulated.cost_model import CostModel, Efficiency, padded_tokens
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import ModelSpec, get_model
from tailserve.executors.simulated.profile_fit import (
    _LinearTerms,
    all_reduce_time,
    fit_all_reduce,
    fit_linear,
    linear_errors,
)
from tailserve.executors.simulated.profiles import (
    LinearProfile,
    LinearSample,
    ProfileError,
    load_all_reduce,
    load_linear_profile,
)
from vidur_helpers import write_mlp as write_op_mlp

SHAPE = {"n_head": 32, "n_kv_head": 8, "n_embd": 4096, "n_expanded_embd": 14336, "vocab_size": 128256}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 136, 192, 256, 264, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]


def write_mlp(path: Path, rows: list[tuple[int, int, float]]) -> Path:
    """An mlp.csv in Vidur's layout: (num_tokens, tp, total linear ms split over the four ops)."""
    return write_op_mlp(path, SHAPE, [(n, tp, (ms / 4,) * 4) for n, tp, ms in rows])


def layer_spec() -> ModelSpec:
    return ModelSpec("layer", 4096, 1, 32, 8, 14336, 128256, 1)


def synthetic_rows(eff: Efficiency, hw_name: str = "A100-80GB") -> list[tuple[int, int, float]]:
    samples = tuple(LinearSample(n, tp, 1.0) for tp in (1, 2, 4) for n in TOKENS)
    terms = _LinearTerms(LinearProfile("x", layer_spec(), samples), get_hardware(hw_name))
    return [(s.num_tokens, s.tp, t * 1e3) for s, t in zip(samples, terms.times(eff))]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda lines: lines.__setitem__(2, lines[2].replace("0.25", "abc", 1)), r"mlp\.csv:3: column .* not a number: 'abc'"),
        (lambda lines: lines.__setitem__(0, lines[0].replace("num_tokens", "tokens")), r"mlp\.csv:1: header lacks column\(s\) num_tokens"),
        (lambda lines: lines.__setitem__(3, lines[3].rsplit(",", 2)[0]), r"mlp\.csv:4: .*columns expected"),
        (lambda lines: lines.__setitem__(2, lines[2].rsplit(",", 2)[0] + ",-3,1"), r"mlp\.csv:3: column 'num_tokens' must be a finite number >= 0"),
        (lambda lines: lines.__setitem__(2, lines[2].replace("4096", "2048", 1)), r"mlp\.csv:3: model shape .* differs"),
        (lambda lines: lines.__delitem__(slice(1, None)), r"mlp\.csv:2: no data rows"),
    ],
)  # fmt: skip
def test_malformed_mlp_csv_is_rejected_with_file_and_line(tmp_path, edit, message):
    path = write_mlp(tmp_path / "m" / "mlp.csv", [(1, 1, 1.0), (2, 1, 1.0), (4, 1, 1.0)])
    lines = path.read_text().splitlines()
    edit(lines)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProfileError, match=message):
        load_linear_profile(path)


def test_missing_profile_and_all_reduce_errors(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        load_linear_profile(tmp_path / "nope.csv")
    bad = tmp_path / "all_reduce.csv"
    bad.write_text("time_stats.all_reduce.median,num_workers,size,devices_per_node\n0.1,2,x,2\n")
    with pytest.raises(ProfileError, match=r"all_reduce\.csv:2: column 'size' is not a number"):
        load_all_reduce(bad)


def test_duplicate_rows_take_the_median_and_the_shape_comes_from_the_file(tmp_path):
    path = write_mlp(tmp_path / "m" / "mlp.csv", [(8, 1, 1.0), (8, 1, 3.0), (8, 1, 2.0), (16, 2, 4.0)])
    prof = load_linear_profile(path)
    assert [(s.num_tokens, s.tp, s.seconds) for s in prof.samples] == [(8, 1, 0.002), (16, 2, 0.004)]
    assert (
        prof.model.num_kv_heads == 8 and prof.model.intermediate_size == 14336 and prof.model.num_layers == 1
    )


def test_linear_fit_recovers_a_known_curve(tmp_path):
    truth = Efficiency(compute=0.72, memory=0.81, sharpness=2.5, tile_m=128, gemm_latency=5e-6)
    prof = load_linear_profile(write_mlp(tmp_path / "m" / "mlp.csv", synthetic_rows(truth)))
    fitted = fit_linear([prof], get_hardware("A100-80GB"))
    assert (fitted.tile_m, fitted.sharpness) == (128, 2.5)
    assert fitted.compute == pytest.approx(0.72, abs=0.003)
    assert fitted.memory == pytest.approx(0.81, abs=0.003)
    assert fitted.gemm_latency == pytest.approx(5e-6, rel=0.05)
    assert linear_errors(prof, get_hardware("A100-80GB"), fitted).max_abs < 0.01


def test_vectorised_fit_terms_equal_the_cost_models_linear_time():
    eff = Efficiency(compute=0.7, memory=0.8, sharpness=2.75, tile_m=128, gemm_latency=6e-6)
    hw = get_hardware("H100-SXM")
    samples = tuple(LinearSample(n, tp, 1.0) for tp in (1, 4) for n in (1, 100, 129, 3000))
    terms = _LinearTerms(LinearProfile("x", layer_spec(), samples), hw)
    for s, t in zip(samples, terms.times(eff)):
        assert CostModel(layer_spec(), hw, s.tp, eff).linear_time(s.num_tokens) == pytest.approx(t, rel=1e-12)


def test_row_tile_makes_a_step_at_the_tile_boundary():
    # The A100's fitted curve on Llama-3-8B: 128 -> 129 tokens runs a second 128-row tile (Vidur's
    # profile measures 12.1 -> 16.9 ms for the 32 layers at 128 -> 136 tokens); within a tile,
    # more tokens cost almost nothing more.
    cm = CostModel(get_model("Llama-3-8B"), get_hardware("A100-80GB"), 1)
    t127, t128, t129, t136 = (cm.linear_time(n) for n in (127, 128, 129, 136))
    assert t129 / t128 > 1.3
    assert t128 / t127 < 1.01 and t136 / t129 < 1.01
    assert [padded_tokens(n, 128) for n in (1, 15, 17, 100, 128, 129, 300)] == [
        16,
        16,
        32,
        128,
        128,
        256,
        384,
    ]
    # The plain roofline (tile 1) has no step.
    plain = CostModel(get_model("Llama-3-8B"), get_hardware("A100-80GB"), 1, Efficiency())
    assert plain.linear_time(129) / plain.linear_time(128) < 1.01


def test_all_reduce_fit_recovers_latency_per_tp_and_link_efficiency():
    from dataclasses import replace

    from tailserve.executors.simulated.profiles import AllReduceSample

    hw = replace(get_hardware("A100-80GB"), allreduce_latency_by_tp=((2, 12e-6), (4, 30e-6), (8, 41e-6)))
    sizes = np.geomspace(8192, 2**27, 30).astype(int)
    samples = [
        AllReduceSample(n, int(b), float(all_reduce_time(hw, 0.55, n, np.array([b]))[0]))
        for n in (2, 4, 8)
        for b in sizes
    ]
    lats, eff = fit_all_reduce(samples, get_hardware("A100-80GB"))
    assert eff == pytest.approx(0.55, rel=1e-6)
    assert lats == pytest.approx({2: 12e-6, 4: 30e-6, 8: 41e-6}, rel=1e-6)


def test_vidur_dir_is_a_calibration_source(tmp_path):
    truth = Efficiency(compute=0.65, memory=0.75, sharpness=2.0, tile_m=64, gemm_latency=4e-6)
    write_mlp(
        tmp_path / "compute" / "a100" / "meta-llama" / "Meta-Llama-3-8B" / "mlp.csv", synthetic_rows(truth)
    )
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, f"vidur:{tmp_path}"))
    eff = built.cost_model.efficiency
    assert (eff.tile_m, eff.sharpness) == (64, 2.0)
    assert eff.compute == pytest.approx(0.65, abs=0.003)
    assert any("GEMM curve fitted to 1 profile" in n for n in built.notes)
    with pytest.raises(ValueError, match=r"no mlp\.csv under it"):
        build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, f"vidur:{tmp_path / 'empty'}"))


def test_vidur_dir_fits_the_all_reduce_bands_when_the_root_has_the_gpus_nccl_profile(tmp_path):
    from tailserve.executors.simulated.hardware import AllReduceBand
    from tailserve.executors.simulated.profile_fit import all_reduce_band_time

    truth = Efficiency(compute=0.65, memory=0.75, sharpness=2.0, tile_m=64, gemm_latency=4e-6)
    write_mlp(
        tmp_path / "compute" / "a100" / "meta-llama" / "Meta-Llama-3-8B" / "mlp.csv", synthetic_rows(truth)
    )
    hw = get_hardware("A100-80GB")
    bands = {
        tp: (AllReduceBand(tp, 512 * 1024, 20e-6, 0.3), AllReduceBand(tp, 8 * 2**20, 25e-6, 0.6),
             AllReduceBand(tp, 2**27, 40e-6, 0.8))
        for tp in (2, 4, 8)
    }  # fmt: skip
    sizes = np.geomspace(8192, 2**27, 40)
    path = tmp_path / "network" / "a100_dgx" / "all_reduce.csv"
    path.parent.mkdir(parents=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time_stats.all_reduce.median", "num_workers", "size", "devices_per_node"])
        for tp, these in bands.items():
            for b, t in zip(sizes, all_reduce_band_time(these, hw.interconnect_bandwidth, sizes)):
                w.writerow([t * 1e3, tp, int(b), tp])
    # The GPU's folder as DIR: the network profile is found at the root above it.
    built = build_cost_model(
        Deployment("Llama-3-70B", "A100-80GB", 4, f"vidur:{tmp_path / 'compute' / 'a100'}")
    )
    fitted = built.cost_model.hardware.allreduce_bands_at(4)
    assert [b.latency for b in fitted] == pytest.approx([20e-6, 25e-6, 40e-6], rel=1e-2)
    assert any("all-reduce fitted per message-size band to a100_dgx" in n for n in built.notes)
    # No NCCL profile for the H100 there: its catalog all-reduce stays.
    plain = build_cost_model(
        Deployment("Llama-3-70B", "H100-SXM", 4, f"vidur:{tmp_path / 'compute' / 'a100'}")
    )
    assert plain.cost_model.hardware.allreduce_bands == ()
