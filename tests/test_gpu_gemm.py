"""The GPU GEMM sweep (fidelity/gpu_gemm.py, `tailserve calibrate --time-gemms`): what runs
without a GPU — its shapes, its refusal on a CPU — and, marked `gpu`, a quick sweep on one."""

from __future__ import annotations

import json

import pytest
import torch

from tailserve.cli import main as cli_main
from tailserve.fidelity import gpu_gemm


def test_dense_token_counts_are_aisimulates_grid():
    ms = gpu_gemm.M_DENSE
    assert len(ms) == 73 and len(set(ms)) == 73 and list(ms) == sorted(ms)
    assert ms[:17] == tuple(range(1, 18)) and ms[-2:] == (8192, 16384)
    assert {32, 33, 128, 129, 160, 161, 256, 257, 512, 513, 4352, 4353} <= set(ms)


def test_model_shapes_are_each_layers_four_gemms_on_its_shard():
    assert gpu_gemm.model_shapes(["Llama-3-8B"], [1]) == sorted(
        [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    )
    tp2 = gpu_gemm.model_shapes(["Llama-3-8B"], [2])
    assert (3072, 4096) in tp2 and (4096, 7168) in tp2 and (4096, 2048) in tp2


def test_without_a_gpu_it_refuses_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "g.json"
    assert cli_main(["calibrate", "--time-gemms", str(out)]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    assert not out.exists()


def test_unknown_format_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_gemm.main(["--formats", "bf16,int3"]) == 2
    assert "unknown format 'int3'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_sweep_on_a_gpu_writes_rows_gemm_calibration_reads(tmp_path):
    out = tmp_path / "g.json"
    assert gpu_gemm.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r[0] for r in rows} >= {"bf16", "quant"} and all(r[4] > 0 for r in rows)


def test_after_the_sweep_it_prints_the_curves_for_the_gpu_timed(monkeypatch, capsys, tmp_path):
    from tests.test_gemm_table import _write

    table = _write(tmp_path, ("bf16", "fp8_row"))
    out = tmp_path / "timed.json"

    def fake_sweep(argv):  # what the sweep writes on a GPU (an H200's name in it)
        assert argv[:2] == ["--out", str(out)]
        out.write_text(table.read_text())
        return 0

    monkeypatch.setattr(gpu_gemm, "main", fake_sweep)
    assert cli_main(["calibrate", "--time-gemms", str(out)]) == 0
    text = capsys.readouterr().out
    assert "note: bf16 GEMM curve fitted to 91 bf16 GEMMs" in text
    assert "note: fp8 GEMM curve fitted to 91 fp8_row GEMMs" in text
    # no --hardware given: the GPU timed, not the default A100
    assert f"price with: --hardware H200 --calibration gemm:{out}" in text
