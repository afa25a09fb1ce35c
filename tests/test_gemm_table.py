"""``--calibration gemm:FILE``: GEMMs timed on a GPU (scripts/gpu_gemm.py's JSON) fitted into the
cost model's GEMM curves (gemm_table.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.gemm_table import (
    calibrated_hardware,
    catalog_gpu,
    load_gemm_table,
    one_join_time,
)
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.precision import get_precision

TRUE = {
    "bf16": (0.70, 0.85, 3.0, 128, 5e-6),
    "fp8_row": (0.55, 0.75, 2.0, 64, 7e-6),
    "fp8": (0.9, 0.9, 6.0, 64, 3e-6),
}


def _write(tmp_path, kernels=("bf16", "fp8_row", "fp8"), gpu="NVIDIA H200"):
    hw = get_hardware("H200")
    rows = []
    for kernel in kernels:
        prec = get_precision("bf16" if kernel == "bf16" else "fp8")
        c, mem, p, tile, lat = TRUE[kernel]
        for n in (4096, 8192, 14336):
            for k in (4096, 8192, 14336):
                for m in (1, 8, 32, 128, 150, 300, 512, 1100, 2048, 8192):
                    t = one_join_time(np.array([m]), n, k, prec.bytes, hw.peak_for(prec.compute),
                                      hw.memory_bandwidth, c, mem, p, tile, lat)[0]  # fmt: skip
                    rows.append([kernel, m, n, k, float(t), 4])
        rows.append([kernel, 16, 1024, 1024, 1e-5, 128])  # not model-sized: read, not fitted
    rows.append(["quant", 16, 0, 4096, 2e-6, 128])
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"gpu": gpu, "sms": 132, "rows": rows}))
    return path


def test_the_fit_recovers_the_curve_that_made_the_times(tmp_path):
    hw, notes = calibrated_hardware(load_gemm_table(_write(tmp_path)), get_hardware("H200"))
    g = hw.gemm
    assert (g.compute, g.memory, g.sharpness, g.tile_m) == pytest.approx(TRUE["bf16"][:4], abs=1e-9)
    assert g.gemm_latency == pytest.approx(5e-6, rel=1e-3)
    assert g.tile_n == 0 and g.source == "gemm table gemm.json (NVIDIA H200), bf16"
    # FP8: the rowwise kernel's rows, not the per-tensor ones, become the format's own curve
    fp8 = g.curve_for("fp8")
    assert (fp8.compute, fp8.memory, fp8.sharpness, fp8.tile_m) == pytest.approx(
        TRUE["fp8_row"][:4], abs=1e-9
    )
    # formats the file lacks keep the catalog's curve
    assert g.curve_for("fp8_block") == get_hardware("H200").gemm.curve_for("fp8_block")
    assert len(notes) == 2 and "0.0% on the model-sized ones" in notes[0]


def test_per_tensor_rows_when_the_file_has_no_rowwise_ones(tmp_path):
    hw, _ = calibrated_hardware(load_gemm_table(_write(tmp_path, ("bf16", "fp8"))), get_hardware("H200"))
    fp8 = hw.gemm.curve_for("fp8")
    assert (fp8.compute, fp8.memory, fp8.sharpness, fp8.tile_m) == pytest.approx(TRUE["fp8"][:4], abs=1e-9)


def test_a_deployment_priced_with_the_file(tmp_path):
    path = _write(tmp_path, ("bf16",))
    none = build_cost_model(
        Deployment(model="Llama-3-8B", hardware="H200", tp=1, calibration="none")
    ).cost_model
    built = build_cost_model(
        Deployment(model="Llama-3-8B", hardware="H200", tp=1, calibration=f"gemm:{path}")
    )
    assert built.cost_model.efficiency.compute == pytest.approx(0.70)
    assert built.cost_model.linear_time(2048) != pytest.approx(none.linear_time(2048), rel=1e-3)
    assert any("fitted to 91 bf16 GEMMs" in n for n in built.notes)


def test_another_gpus_table_says_so(tmp_path):
    _, notes = calibrated_hardware(load_gemm_table(_write(tmp_path, ("bf16",))), get_hardware("B200"))
    assert notes[0] == "the GEMMs were timed on NVIDIA H200; their curves are applied to B200"


@pytest.mark.parametrize(
    "body,message",
    [
        (None, "no such file"),
        ("not json", "not a JSON file"),
        ('{"rows": []}', "not a scripts/gpu_gemm.py result"),
        ('{"gpu": "x", "rows": [["bf16", 1, 2]]}', "row 0 is not [format, m, n, k, seconds > 0]"),
        ('{"gpu": "x", "rows": [["bf16", 1, 4096, 4096, 0]]}', "row 0 is not"),
    ],
)
def test_bad_files_are_refused_with_one_line(tmp_path, body, message):
    path = tmp_path / "g.json"
    if body is not None:
        path.write_text(body)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_gemm_table(path)


def test_too_few_model_sized_rows_or_no_bf16(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"gpu": "x", "rows": [["bf16", 1, 1024, 1024, 1e-5, 1]]}))
    with pytest.raises(ValueError, match="too few to fit"):
        calibrated_hardware(load_gemm_table(path), get_hardware("H200"))
    path.write_text(json.dumps({"gpu": "x", "rows": [["fp8", 1, 4096, 4096, 1e-5, 1]]}))
    with pytest.raises(ValueError, match="no bf16 rows"):
        calibrated_hardware(load_gemm_table(path), get_hardware("H200"))


@pytest.mark.parametrize(
    "device,entry",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA B200", "B200"),
        ("AMD Instinct MI355X", "MI355X"),
        ("NVIDIA H100 PCIe", None),  # the catalog's H100 is the SXM part
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_a_cuda_device_name_maps_to_its_catalog_entry(device, entry):
    assert catalog_gpu(device) == entry
