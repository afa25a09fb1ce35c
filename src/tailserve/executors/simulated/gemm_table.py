"""A GPU's GEMM curves fitted to GEMMs timed on it: ``--calibration gemm:FILE``.

``tailserve calibrate --time-gemms FILE`` (or ``scripts/gpu_gemm.py``; ``fidelity/gpu_gemm.py``)
times ``x[M, K] @ W[N, K]^T`` on the GPU at hand (bf16 through ``F.linear``, FP8 through
``torch._scaled_mm``; 48 weight shapes x 13 or 73 token counts, under two minutes) and writes
them as JSON. This module reads that file and fits the cost model's GEMM
curve to it — one p-norm join of compute and memory time per GEMM at fitted fractions of the
GPU's peak FLOP/s and bandwidth, rows padded to a row tile, a launch latency — so the deployment
is priced with the user's own GPU and GEMM library instead of the catalog's curve for that GPU
(fitted to other machines' tables, or the generic default where the catalog has none):

- the bf16 rows become the GPU's curve (``Hardware.gemm``; the cost model joins a layer's four
  GEMMs in one, which equals the sum of per-GEMM joins when, as here, they turn compute-bound at
  the same token count), keeping the catalog's factors and curves for formats the file lacks;
- FP8 rows become the ``fp8`` format's own curve (per GEMM, at the FP8 peak): the rowwise-scaled
  kernel's rows where the file has them (PyTorch's CUTLASS kernel, within 6.5% of vLLM's CUTLASS
  ``scaled_mm`` on an H200, docs/fidelity.md), else the per-tensor cuBLASLt ones.

Only weights of model size (N x K >= 2^24) are fitted: no layer of a >= 7B model at TP <= 8 runs
a smaller GEMM. On the H200 measured in docs/fidelity.md, a curve fitted to half the shapes
priced the other half 7.3% off on average, 6.2% time-weighted (the catalog's: 12.6%, 8.3%).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tailserve.executors.simulated.gemm import join_array, padded_rows
from tailserve.executors.simulated.hardware import HARDWARE, GemmCurve, Hardware
from tailserve.executors.simulated.precision import get_precision

PREFIX = "gemm:"
MODEL_SIZED = 2**24  # N x K of the smallest GEMM a >= 7B model runs at TP <= 8
SHARPNESS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, math.inf)
TILES = (64, 128, 256)
ACT_BYTES = 2.0  # activations in and out in bf16
# the file's kernels -> the catalog's format, first found wins
FORMAT_ROWS = {"bf16": ("bf16",), "fp8": ("fp8_row", "fp8")}


@dataclass(frozen=True, slots=True)
class GemmTable:
    """One ``gpu_gemm.py`` file: the GPU it ran on and, per kernel, rows [m, n, k, seconds]."""

    path: str
    gpu: str
    sms: int
    rows: dict[str, np.ndarray]


def load_gemm_table(path: str | Path) -> GemmTable:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"gemm:{path}: no such file (scripts/gpu_gemm.py writes one on a GPU)")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"gemm:{path}: not a JSON file ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("rows"), list) or "gpu" not in d:
        raise ValueError(f"gemm:{path}: not a scripts/gpu_gemm.py result (no 'gpu' and 'rows')")
    rows: dict[str, list] = {}
    for i, r in enumerate(d["rows"]):
        ok = isinstance(r, list) and len(r) >= 5 and isinstance(r[0], str)
        if not ok or not all(isinstance(x, (int, float)) and x > 0 for x in r[1:5] if r[0] != "quant"):
            raise ValueError(f"gemm:{path}: row {i} is not [format, m, n, k, seconds > 0]: {r!r}")
        rows.setdefault(r[0], []).append(r[1:5])
    return GemmTable(str(p), str(d["gpu"]), int(d.get("sms") or 0),
                     {f: np.array(v, dtype=float) for f, v in rows.items()})  # fmt: skip


def one_join_time(m, n, k, weight_bytes, peak, bandwidth, compute, memory, sharpness, tile, latency):
    """One GEMM's time in the curve's form: rows padded to ``tile``, compute and memory joined."""
    rows = padded_rows(m, tile) if tile > 1 else m
    t_compute = 2.0 * rows * n * k / (peak * compute)
    t_memory = (n * k * weight_bytes + m * (k + n) * ACT_BYTES) / (bandwidth * memory)
    return join_array(t_compute, t_memory, sharpness) + latency


def fit_one_join(m, n, k, y, weight_bytes: float, peak: float, bandwidth: float) -> dict:
    """The curve with the smallest mean |relative error|: a grid over the row tile, the sharpness
    and the two efficiencies, the latency least squares in relative terms for each candidate,
    then a finer grid of the efficiencies around the best. The memory efficiencies of one
    (tile, sharpness, compute) are scored together, one row each of a 2-D array (the same
    arithmetic, row by row, as one at a time: a fit took seconds, and every cost model built on
    ``gemm:FILE`` in a sweep's worker fits it)."""
    best: tuple[float, dict | None] = (math.inf, None)
    w = 1.0 / y  # relative error: minimise sum ((base + lat) / y - 1)^2
    moved = n * k * weight_bytes + m * (k + n) * ACT_BYTES
    flops = {tile: 2.0 * (padded_rows(m, tile) if tile > 1 else m) * n * k for tile in TILES}

    def consider(c: float, mems: np.ndarray, p: float, tile: int) -> None:
        nonlocal best
        base = join_array(flops[tile] / (peak * c), moved[None, :] / (bandwidth * mems)[:, None], p)
        lat = np.maximum(0.0, np.sum(w * (1 - base * w), axis=1) / np.sum(w * w))
        err = np.mean(np.abs((base + lat[:, None]) / y - 1), axis=1)
        for i, mem in enumerate(mems):
            if err[i] < best[0]:
                best = (float(err[i]), dict(compute=float(c), memory=float(mem), sharpness=p, tile_m=tile,
                                            gemm_latency=float(lat[i])))  # fmt: skip

    for tile in TILES:
        for p in SHARPNESS:
            for c in np.linspace(0.3, 1.0, 15):
                consider(c, np.linspace(0.4, 1.0, 13), p, tile)
    b = best[1]
    assert b is not None
    for c in np.linspace(b["compute"] - 0.05, b["compute"] + 0.05, 11):
        if 0 < c <= 1.2:
            mems = np.linspace(b["memory"] - 0.05, b["memory"] + 0.05, 11)
            consider(c, mems[(mems > 0) & (mems <= 1.2)], b["sharpness"], b["tile_m"])
    assert best[1] is not None
    return best[1]


def fit_rows(rows: np.ndarray, fmt: str, hardware: Hardware) -> tuple[dict, float]:
    """The fitted curve's parameters for one format's model-sized rows, and its mean |error|."""
    sized = rows[rows[:, 1] * rows[:, 2] >= MODEL_SIZED]
    if len(sized) < 8:
        raise ValueError(f"{len(sized)} model-sized {fmt} GEMMs (N x K >= 2^24): too few to fit a curve")
    prec = get_precision(fmt)
    peak = hardware.peak_for(prec.compute)
    m, n, k, y = sized.T
    params = fit_one_join(m, n, k, y, prec.bytes, peak, hardware.memory_bandwidth)
    pred = one_join_time(m, n, k, prec.bytes, peak, hardware.memory_bandwidth, *_args(params))
    return params, float(np.mean(np.abs(pred / y - 1)))


def _args(p: dict) -> tuple:
    return p["compute"], p["memory"], p["sharpness"], p["tile_m"], p["gemm_latency"]


def catalog_gpu(device_name: str) -> str | None:
    """The catalog entry a CUDA device name is (``NVIDIA H200`` -> ``H200``, ``NVIDIA H100 80GB
    HBM3`` -> ``H100-SXM``, ``NVIDIA A100-SXM4-80GB`` -> ``A100-80GB``), or None: the entry whose
    model token (the name before its first ``-``) is a word of the device's name, and where
    several are (A100-40GB, A100-80GB), the one whose other parts appear in it too."""
    name = device_name.lower()
    words = set(name.replace("-", " ").split())
    found = [n for n in HARDWARE if n.split("-")[0].lower() in words]
    if "pcie" in words:  # the catalog's entries are the SXM parts: another peak and bandwidth
        found = [n for n in found if "pcie" in n.lower()]
    if len(found) > 1:
        found = [n for n in found if all(p.lower() in name for p in n.split("-")[1:])]
    return found[0] if len(found) == 1 else None


def calibrated_hardware(table: GemmTable, hardware: Hardware) -> tuple[Hardware, tuple[str, ...]]:
    """``hardware`` with its GEMM curves fitted to the table, and one note per fitted format."""
    notes = []
    if catalog_gpu(table.gpu) != hardware.name:
        notes.append(f"the GEMMs were timed on {table.gpu}; their curves are applied to {hardware.name}")
    src = f"{Path(table.path).name} ({table.gpu})"
    kernels = {fmt: next((k for k in names if k in table.rows), None) for fmt, names in FORMAT_ROWS.items()}
    if kernels["bf16"] is None:
        raise ValueError(f"gemm:{table.path}: no bf16 rows (scripts/gpu_gemm.py --formats bf16,...)")
    params, err = fit_rows(table.rows["bf16"], "bf16", hardware)
    old = hardware.gemm
    curve = GemmCurve(params["compute"], params["memory"], params["sharpness"], params["tile_m"],
                      params["gemm_latency"], f"gemm table {src}, bf16")  # fmt: skip
    if old is not None:  # formats the file lacks keep the catalog's factors and curves
        curve = replace(old, compute=curve.compute, memory=curve.memory, sharpness=curve.sharpness,
                        tile_m=curve.tile_m, gemm_latency=curve.gemm_latency, source=curve.source,
                        tile_n=0, wave_alpha=1.0, m_tiles=())  # fmt: skip
    notes.append(_note("bf16", "bf16", params, err, len(table.rows["bf16"])))
    if kernels["fp8"] is not None:
        params, err = fit_rows(table.rows[kernels["fp8"]], "fp8", hardware)
        own = GemmCurve(params["compute"], params["memory"], params["sharpness"], params["tile_m"],
                        params["gemm_latency"], f"gemm table {src}, {kernels['fp8']}")  # fmt: skip
        others = tuple((name, c) for name, c in curve.format_curves if name != "fp8")
        curve = replace(curve, format_curves=(*others, ("fp8", own)))
        notes.append(_note("fp8", kernels["fp8"], params, err, len(table.rows[kernels["fp8"]])))
    hw = replace(hardware, gemm=curve, sms=hardware.sms or table.sms)
    return hw, tuple(notes)


def table_hardware(path: str | Path, hardware: Hardware) -> tuple[Hardware, tuple[str, ...]]:
    """``calibrated_hardware`` of the file at ``path``, fitted once per process for the file as it
    is now: every policy of a ``compare`` or ``tune`` builds its cost model, and a fit takes
    seconds."""
    p = Path(path)
    if not p.is_file():
        load_gemm_table(p)  # raises the one-line error
    st = p.stat()
    return _fitted(str(p.resolve()), st.st_mtime_ns, st.st_size, hardware)


@functools.lru_cache(maxsize=8)
def _fitted(path: str, mtime_ns: int, size: int, hardware: Hardware) -> tuple[Hardware, tuple[str, ...]]:
    return calibrated_hardware(load_gemm_table(path), hardware)


def _note(fmt: str, kernel: str, p: dict, err: float, rows: int) -> str:
    return (
        f"{fmt} GEMM curve fitted to {rows:,} {kernel} GEMMs: compute {p['compute']:.3f}, memory "
        f"{p['memory']:.3f}, sharpness {p['sharpness']:g}, tile {p['tile_m']}, launch "
        f"{p['gemm_latency'] * 1e6:.2f} us; mean |error| {err:.1%} on the model-sized ones"
    )
