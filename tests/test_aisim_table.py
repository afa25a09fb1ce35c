"""``--calibration aisim:FILE[:GPU]``: dense GEMMs priced from AISimulate's measured GEMM tables
(aisim_table.py), on small synthetic exports (AISimulate itself is not needed)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tailserve.cli import main
from tailserve.executors.simulated.aisim_table import TableLayers, format_rows, load_gemm_times
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.gemm_table import one_join_time
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.precision import get_precision

H200 = get_hardware("H200")
MS = (1, 2, 4, 8, 16, 17, 32, 64, 128, 129, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
NS = (1024, 2048, 4096, 6144, 8192, 16384, 28672, 65536, 131072)
KS = (1024, 2048, 4096, 8192, 14336, 16384)


def _roofline(m, n, k, fmt="bf16"):
    prec = get_precision(fmt)
    compute = 2.0 * m * n * k / H200.peak_for(prec.compute)
    return np.maximum(compute, (n * k * prec.bytes + m * (n + k) * 2.0) / H200.memory_bandwidth)


def _affine_fraction(m, n, k):
    """A roofline fraction affine in log M, log N and log K: what the interpolation reproduces."""
    return 0.3 + 0.02 * np.log(m) + 0.015 * np.log(n / 1024) + 0.01 * np.log(k / 1024)


def _curve_time(m, n, k):
    """A realistic law: the one-join curve (row tile, p-norm, launch latency)."""
    return one_join_time(np.asarray(m, float), n, k, 2.0, H200.peak_flops, H200.memory_bandwidth,
                         0.75, 0.85, 3.0, 128, 6e-6)  # fmt: skip


def _rows(law, fmt="bf16", ns=NS, ks=KS):
    m = np.array(MS, dtype=float)
    return np.array([[*r] for n in ns for k in ks for r in zip(m, [n] * len(m), [k] * len(m), law(m, n, k))])


def test_an_affine_roofline_fraction_is_recovered_at_held_out_shapes():
    # train on every other K and N; price shapes between them and at M between the rows
    train = _rows(lambda m, n, k: _roofline(m, n, k) / _affine_fraction(m, n, k), ns=NS[::2], ks=KS[::2])
    table = format_rows("bf16", train, H200)
    for n, k in ((2048, 2048), (6144, 4096), (28672, 8192), (4096, 14336)):
        profile = table.profile(n, k)
        assert profile is not None
        m = np.array([1, 3, 100, 129, 700, 5000, 30000], dtype=float)
        want = _roofline(m, n, k) / _affine_fraction(m, n, k)
        assert table.seconds(m, n, k, profile) == pytest.approx(want, rel=1e-9)


def test_a_curve_law_is_recovered_within_a_few_percent():
    # the one-join curve with a launch latency on a grid 2-3.5x apart in N and K, as held out:
    # within 2.5% on average and 6% at worst on model-sized weights (N x K >= 2^24)
    train = _rows(lambda m, n, k: _curve_time(m, n, k), ns=NS[::2], ks=KS[::2])
    table = format_rows("bf16", train, H200)
    errors = []
    for n in NS[1::2]:
        for k in (2048, 4096, 8192):
            if n * k >= 2**24:
                m = np.array(MS, dtype=float)
                errors += list(table.seconds(m, n, k, table.profile(n, k)) / _curve_time(m, n, k) - 1)
    assert len(errors) == 9 * len(MS)
    assert np.mean(np.abs(errors)) < 0.025 and np.max(np.abs(errors)) < 0.06


def test_the_measured_times_themselves_at_measured_points():
    rows = _rows(lambda m, n, k: _curve_time(m, n, k))
    table = format_rows("bf16", rows, H200)
    m = np.array(MS, dtype=float)
    assert table.seconds(m, 4096, 14336, table.profile(4096, 14336)) == pytest.approx(
        _curve_time(m, 4096, 14336), rel=1e-12
    )
    # beyond the largest M the fraction is held: compute-bound time grows with M
    beyond = table.seconds(65536.0, 4096, 14336, table.profile(4096, 14336))
    assert beyond == pytest.approx(2 * _curve_time([32768], 4096, 14336)[0], rel=0.01)


def test_shapes_outside_the_table_are_none():
    table = format_rows("bf16", _rows(lambda m, n, k: _curve_time(m, n, k)), H200)
    assert table.profile(512, 4096) is None  # N below every measured N
    assert table.profile(4096, 65536) is None  # K beyond every measured K
    assert table.profile(200000, 4096) is None


def _export(tmp_path, formats=("bfloat16",), gpu="h200_sxm", ns=NS):
    law = lambda m, n, k: _curve_time(m, n, k)  # noqa: E731
    gemm = [[fmt, *map(float, r[:3]), float(r[3]) * 1e3] for fmt in formats for r in _rows(law, ns=ns)]
    path = tmp_path / "aisim.json"
    path.write_text(
        json.dumps({"framework": "vllm", "gpus": {gpu: {"gemm_version": "0.31.0", "gemm": gemm}}})
    )
    return path


def test_a_deployment_priced_from_the_table(tmp_path):
    path = _export(tmp_path)
    built = build_cost_model(
        Deployment(model="Llama-3-8B", hardware="H200", tp=1, calibration=f"aisim:{path}")
    )
    cm = built.cost_model
    assert built.notes[0] == "GEMMs priced from aisim.json: vllm's kernels measured on h200_sxm, bf16 rows"
    assert cm.table_outside == ()
    m = cm.model
    # the dense GEMMs at 2,048 tokens: the law's time of each shape, every layer
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    want = m.num_layers * sum(float(_curve_time([2048], n, k)[0]) for n, k in shapes)
    assert cm._table.layers(2048) == pytest.approx(want, rel=1e-9)
    assert cm.linear_time(2048) == pytest.approx(
        want + 2048 * cm._kv_bytes_per_token / cm._byte_rate, rel=1e-9
    )
    assert cm.linear_time(2048) == cm.linear_time(2048)  # memoised per token count


def test_a_gemm_outside_the_table_is_priced_on_the_catalog_curve_and_said_once(tmp_path):
    path = _export(tmp_path, ns=NS[:-1])  # N up to 65,536: the LM head's 128,256 is beyond
    built = build_cost_model(
        Deployment(model="Llama-3-8B", hardware="H200", tp=1, calibration=f"aisim:{path}")
    )
    assert built.notes[1] == "outside the measured shapes, on the catalog's curve: 128256 x 4096 bf16"
    head = built.cost_model._table.head
    assert head.profile is None
    g = H200.gemm
    want = one_join_time(np.array([64.0]), 128256, 4096, 2.0, H200.peak_flops, H200.memory_bandwidth,
                         g.compute, g.memory, g.sharpness, g.tile_m, g.gemm_latency)[0]  # fmt: skip
    assert built.cost_model._table.lm_head(64) == pytest.approx(want, rel=1e-12)


def test_cost_runs_end_to_end(tmp_path, capsys):
    path = _export(tmp_path)
    out = tmp_path / "cost.json"
    args = ["cost", "--model", "Llama-3-8B", "--hardware", "H200", "--tp", "1", "--json", str(out)]
    assert main([*args, "--calibration", f"aisim:{path}"]) == 0
    assert "note: GEMMs priced from aisim.json" in capsys.readouterr().err
    priced = json.loads(out.read_text())
    assert main([*args, "--calibration", "none"]) == 0
    catalog = json.loads(out.read_text())
    assert priced["prefill_s"] > 0 and priced["prefill_s"] != catalog["prefill_s"]
    # the GPU named after the file: the same rows, said to be another GPU's
    on_b200 = ["cost", "--model", "Llama-3-8B", "--hardware", "B200", "--json", str(out)]
    assert main([*on_b200, "--calibration", f"aisim:{path}:H200"]) == 0
    assert "timed on H200; their times are applied to B200" in capsys.readouterr().err


@pytest.mark.parametrize(
    "body,source,message",
    [
        (None, "aisim:{path}", "no such file"),
        ("not json", "aisim:{path}", "not a JSON file"),
        ('{"rows": []}', "aisim:{path}", "not a benchmarks/_aisim_tables.py export"),
        ("EXPORT", "aisim:{path}:b200_sxm", "no GEMM rows for b200_sxm (the file has h200_sxm (H200))"),
        (
            '{"gpus": {"h200_sxm": {"gemm": [["bfloat16", 1, 4096, 4096, 0]]}}}',
            "aisim:{path}",
            "is not [format",
        ),
    ],
)
def test_bad_sources_are_refused_with_one_line(tmp_path, body, source, message):
    path = tmp_path / "aisim.json"
    if body == "EXPORT":
        path = _export(tmp_path)
    elif body is not None:
        path.write_text(body)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build_cost_model(
            Deployment(model="Llama-3-8B", hardware="H200", tp=1, calibration=source.format(path=path))
        )


def test_a_format_the_file_lacks_is_refused(tmp_path):
    path = _export(tmp_path)
    with pytest.raises(ValueError, match="no fp8 GEMM rows for h200_sxm"):
        build_cost_model(
            Deployment(model="Llama-3-8B", hardware="H200", quantization="fp8", calibration=f"aisim:{path}")
        )
    # an MLA model's dense GEMMs take their format's rows too (its MLA block keeps the catalog's)
    with pytest.raises(ValueError, match="no fp8_block GEMM rows for h200_sxm"):
        build_cost_model(Deployment(model="DeepSeek-V3", hardware="H200", tp=8, calibration=f"aisim:{path}"))


def test_quantized_weights_take_their_format_rows(tmp_path):
    def fp8(m, n, k):
        return _curve_time(m, n, k) * 0.6

    path = tmp_path / "aisim.json"
    gemm = [[f, *map(float, r[:3]), float(r[3]) * 1e3] for f, law in (("bfloat16", None), ("fp8", fp8))
            for r in _rows(law or (lambda m, n, k: _curve_time(m, n, k)))]  # fmt: skip
    path.write_text(json.dumps({"gpus": {"h200_sxm": {"gemm": gemm}}}))
    times = load_gemm_times(path, "H200")
    assert set(times.formats) == {"bf16", "fp8"}
    layers = TableLayers.of(times, ((4096.0, 14336.0, 32, "fp8"),), None, H200)
    assert layers.layers(512) == pytest.approx(32 * 0.6 * float(_curve_time([512], 4096, 14336)[0]), rel=1e-9)
    assert layers.lm_head(16) == 0.0 and not math.isnan(layers.layers(1))


def test_a_format_whose_rows_do_not_grow_with_the_rows_is_left_out_for_the_curve():
    # A flat series (the vLLM export's B200 block-FP8 rows: ~the same time from 1 to 4,096 rows)
    # is not a GEMM kernel's timing: its GEMMs take the catalog's curve, said in a note.
    from tailserve.executors.simulated.aisim_table import flat_series

    ms = [1, 64, 512, 4096]
    rows = np.array([[m, n, k, 2e-4 * (1 + m / 40000)] for n, k in ((8192, 8192), (4096, 8192)) for m in ms])
    assert "1.1x" in flat_series(rows)
    growing = rows.copy()
    growing[:, 3] = 1e-5 + 2 * growing[:, 0] * growing[:, 1] * growing[:, 2] / 1e15
    assert flat_series(growing) == ""


def test_a_left_out_format_prices_on_the_catalog_curve_with_its_note(tmp_path):
    path = tmp_path / "aisim.json"
    flat = lambda m, n, k: 2e-4 * (1 + m / 40000)  # noqa: E731
    gemm = [[f, *map(float, r[:3]), float(r[3]) * 1e3] for f, law in (("bfloat16", None), ("fp8", flat))
            for r in _rows(law or (lambda m, n, k: _curve_time(m, n, k)))]  # fmt: skip
    path.write_text(json.dumps({"gpus": {"h200_sxm": {"gemm": gemm}}}))
    times = load_gemm_times(path, "H200")
    assert set(times.formats) == {"bf16"} and [f for f, _ in times.left_out] == ["fp8"]
    assert times.rows_for("fp8") is None
    layers = TableLayers.of(times, ((4096.0, 14336.0, 32, "fp8"),), None, H200)
    assert layers.outside == () and layers.gemms[0].profile is None
    assert layers.layers(512) > 0  # the catalog's FP8 curve
    built = build_cost_model(
        Deployment(model="Llama-3-8B", hardware="H200", tp=1, quantization="fp8", calibration=f"aisim:{path}")
    )
    assert any(n.startswith("h200_sxm's fp8 GEMM rows left out: 4,096 rows take") for n in built.notes)
