"""The GPU cost model against AISimulate's silicon tables: GEMMs per number format and fused MoE
layers on Hopper and Blackwell GPUs that no Vidur profile covers.

AISimulate (NVIDIA) bundles operator latencies measured with vLLM's own kernels on real GPUs
(``aisimulate_core/systems/data/<gpu>/{gemm,moe}/vllm/<version>/*.parquet``). Read as data,
never as a model:

- **gemm**: for each GPU and format (bf16, FP8 per-tensor, FP8 block-scaled as DeepSeek-V3 ships,
  NVFP4), the GEMM curve of ``hardware.GemmCurve`` (compute and memory efficiency, the p-norm
  sharpness, the row tile, a launch latency) is fitted on half of the (N, K) weight shapes and the
  error reported on the other half (held out), beside the generic default efficiencies
  (uncalibrated: what ``tailserve`` prices a GPU with no fitted curve at). Then the per-GEMM wave
  form with and without the activations' quantization kernel; for each quantized format the form
  the catalog holds (``GemmCurve.format_curves``: the wave form fitted without that kernel) and the
  catalog itself before (the bf16 curve with the format's factors) and now; on Hopper FP8, the
  CUTLASS kernel's tile by M (``HOPPER_FP8_TILES``) as a candidate.
- **moe**: every fused-MoE row with uniform routing and no expert parallelism (model shapes from
  Mixtral to Kimi K2, 1 to 16,384 tokens, expert TP 1-32) priced by ``moe.grouped_gemm_parts``
  (what the simulator prices) with the GEMM curve fitted above for that GPU and format: first as
  is, then with two factors on its rates and a per-layer latency for the fused MoE kernel fitted
  on half the model shapes, the error reported on the other half. A format's rows are those of
  the kernel vLLM 0.32 runs for it (``VLLM_MOE_KERNELS``; the format's other kernels' rows are
  priced by the catalog beside them), and where vLLM runs another kernel under expert
  parallelism (``VLLM_MOE_EP_KERNELS``: Hopper block FP8) that kernel's rows at EP 2-64 too
  (``fp8_block@ep``, each rank its ``E / EP`` whole experts).
- **allreduce**: vLLM's custom all-reduce under CUDA graphs (the decode path), bf16, per GPU and
  TP degree: the catalog's latency and link efficiency, then one latency per TP and one link
  efficiency per GPU fitted on every other message size and tested on the rest, then one line per
  kernel vLLM picks for the size (``allreduce_regimes.py``: FlashInfer one- or two-shot, custom
  one- or two-stage, symmetric memory, NCCL; the boundaries are vLLM's) on the same split.
- **mla**: vLLM's whole MLA attention block of one layer (down- and up-projections, the attention
  kernel, o_proj, and the norms, RoPE and cache writes between them), DeepSeek-V3's shapes at
  1-128 heads (a TP shard), prefill (batch x prompt) and decode (batch x context), bf16 KV,
  weights in bf16 or block-scaled FP8: the cost model as is (the GPU's GEMM curve and the
  roofline attention), then with the MLA block's factors, fixed times and per-request terms
  (``hardware.MlaKernel``: per prefill chunk, per decode with its knee, per context token)
  fitted on half the head counts and tested on the other half.
- **a2a**: DeepEP's dispatch and combine as vLLM runs them (high-throughput and low-latency, one
  node, EP 8; GB200: 4), per phase ``latency + bytes / (link x efficiency)`` with the bytes of
  ``moe_comm.py``, fitted on half the model shapes (hidden, top-k, experts) and tested on the
  rest; and NCCL's all-gather and reduce-scatter (vLLM's default allgather_reducescatter
  exchange) per group size, fitted on every other message size and tested on the rest.

With ``--framework vllm,trtllm,sglang`` the GEMM and fused-MoE parts also run on TensorRT-LLM's
and SGLang's tables (their own kernels, ``aisimulate_core/systems/data/<gpu>/{gemm,moe}/<engine>``),
each held-out row also priced with vLLM's fitted curve and factors, and the fitted curves printed
in the catalog's form (``hardware.EngineKernels``).

Needs AISimulate's venv (``scripts/setup-peers.sh aisimulate``); the tables are exported by
``benchmarks/_aisim_tables.py`` run in it.

    python -m benchmarks.fidelity_aisim [--gpus h200_sxm,b200_sxm,...] [--parts mla,...]
        [--framework vllm,trtllm,sglang] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._allreduce_fit import regime_fit
from benchmarks._common import cpu_line, missing_peer, module_cmd, module_env, peer_venv, save_results
from tailserve.executors.simulated.aisim_moe_table import (
    FP8_STATIC_KERNELS,
    VLLM_EP_KERNELS,
    VLLM_KERNELS,
)
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.gemm import (
    curve_gemm_time,
    join_array,
    padded_rows,
    shape_tiles,
    wave_flops,
)
from tailserve.executors.simulated.gemm_table import (
    ACT_BYTES,
    MODEL_SIZED,
    SHARPNESS,
    TILES,
    fit_one_join,
    one_join_time,
)
from tailserve.executors.simulated.hardware import (
    GemmCurve,
    Hardware,
    LinkFit,
    MlaCurveTerms,
    MlaKernel,
    MoeCurve,
    get_hardware,
)
from tailserve.executors.simulated.model_spec import ModelSpec
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.moe import grouped_gemm_parts
from tailserve.executors.simulated.moe_comm import FP8_WITH_SCALES, remote_ranks
from tailserve.executors.simulated.precision import get_precision

_AISIM_SRC = "AISimulate silicon tables"
GPUS = {  # AISimulate's system name -> tailserve's catalog name
    "h100_sxm": "H100-SXM",
    "h200_sxm": "H200",
    "b200_sxm": "B200",
    "gb200": "GB200",
    "b300_sxm": "B300",
}
FRAMEWORK_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "sglang": "SGLang"}
# AISimulate's format names -> tailserve's (weights' bytes and tensor-core rate)
FORMATS = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8_block", "nvfp4": "nvfp4"}
# MoE formats: the GEMM curve they take and their weights' format
MOE_FORMATS = {
    "bfloat16": ("bfloat16", "bf16"),
    "fp8": ("fp8", "fp8"),
    "fp8_block": ("fp8_block", "fp8_block"),
    "fp8_static": ("fp8", "fp8_static"),  # the tables' fp8 rows of the static-scale kernels
    "nvfp4": ("nvfp4", "nvfp4"),
    "int4_wo": ("bfloat16", "int4"),  # weight-only: bf16 math on int4 weights
    "w4a16_mxfp4": ("bfloat16", "mxfp4"),  # gpt-oss on Hopper: bf16 math on MXFP4 weights
}
# A model's projections: every GEMM of a >= 7B model at TP <= 8 has N x K >= 2^24 weights. The
# tables also time tiny GEMMs (N = 8, K = 32) that no layer runs; they are reported, not fitted.
# The grid, the one-join form and its fit are the ones ``--calibration gemm:FILE`` fits with.
HOPPER = ("h100_sxm", "h200_sxm")


def gemm_time(m, n, k, wb, peak, hw: Hardware, c, mem, p, tile, lat) -> np.ndarray:
    return one_join_time(m, n, k, wb, peak, hw.memory_bandwidth, c, mem, p, tile, lat)


def fit(m, n, k, y, wb, peak, hw) -> dict:
    """``gemm_table.fit_one_join`` at the GPU's bandwidth."""
    return fit_one_join(m, n, k, y, wb, peak, hw.memory_bandwidth)


# The wave form's column tiles and partial-wave costs tried (gemm.py), and the bytes per activation
# element each format's quantization kernel moves before its GEMM (reads bf16, writes the format
# and its scales): vLLM runs it as a kernel of its own in these isolated-op tables.
TILES_N = (64, 128, 256)
ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
QUANT_BYTES = {
    "bfloat16": 0.0,
    "fp8": 2.0 + 1.0,
    "fp8_block": 2.0 + 1.0 + 4 / 128,
    "nvfp4": 2.0 + 0.5 + 1 / 16,
}


# vLLM's CUTLASS FP8 (per tensor) kernel on Hopper picks its tile by M, and by N up to 64 rows
# (csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh, cutlass_gemm_sm90_fp8_dispatch):
# up to 64 rows it swaps A and B, so its 64 x 16 tile is 16 rows by 64 columns (64 x 64 above 16
# rows with N > 1280); 64 x 128 up to 128 rows; 128 x 128 beyond (256 x 128 from 8,192 rows with
# K >= 6,144, left out: the fitted default tile stands for both). (rows at most, N at most, tile
# M, tile N) as ``GemmCurve.m_tiles``.
HOPPER_FP8_TILES = ((16, 0, 16, 64), (64, 1280, 16, 64), (64, 0, 64, 64), (128, 0, 64, 128))


def wave_parts(m, n, k, wb, peak, hw: Hardware, tile, tile_n, alpha, quant, m_tiles=()) -> tuple:
    """(seconds at peak FLOP/s, seconds at full bandwidth, the quantization kernel's seconds at
    full bandwidth) per row: output tiles in waves over the SMs (``tile_n`` 0: no waves), each
    GEMM's tile by its shape where ``m_tiles`` has one."""
    tm, tn = shape_tiles(m, n, m_tiles, tile, tile_n)
    rows = padded_rows(m, tm)
    flops = wave_flops(rows, n, k, tm, tn, hw.sms, alpha) if tile_n else 2.0 * rows * n * k
    memory = (n * k * wb + m * (k + n) * ACT_BYTES) / hw.memory_bandwidth
    return flops / peak, memory, m * k * quant / hw.memory_bandwidth


def wave_time(parts: tuple, c, mem, p, lat) -> np.ndarray:
    compute, memory, quant = parts
    return join_array(compute / c, memory / mem, p) + quant / mem + lat


def fit_waves(m, n, k, y, wb, peak, hw, quant_choices, m_tiles=()) -> dict:
    """``fit`` with the per-GEMM wave form (column tile, partial-wave cost) and the activations'
    quantization kernel (its bytes per element: each of ``quant_choices``) on top. Every shape
    (row and column tile, partial-wave cost, quantization bytes) scored on a coarse grid of the
    rates and sharpness; the best three searched on the full grid, the latency least squares in
    relative terms throughout, then a finer grid around the best."""
    w = 1.0 / y

    def score(parts, c, mem, p, shape):
        base = wave_time(parts, c, mem, p, 0.0)
        lat = max(0.0, float(np.sum(w * (1 - base * w)) / np.sum(w * w)))
        err = float(np.mean(np.abs((base + lat) / y - 1)))
        return err, dict(shape, compute=c, memory=mem, sharpness=p, gemm_latency=lat)

    def search(parts, shape, sharpness, cs, mems):
        return min((score(parts, c, mem, p, shape) for p in sharpness for c in cs for mem in mems),
                   key=lambda t: t[0])  # fmt: skip

    coarse = []
    for quant in quant_choices:
        for tile in TILES:
            for tile_n in TILES_N if m_tiles else (0, *TILES_N):
                for alpha in ALPHAS if tile_n else (1.0,):
                    shape = dict(tile_m=tile, tile_n=tile_n, wave_alpha=alpha, quant_bytes=quant)
                    parts = wave_parts(m, n, k, wb, peak, hw, tile, tile_n, alpha, quant, m_tiles)
                    err, _ = search(
                        parts, shape, (1.5, 3.0, 6.0), np.linspace(0.3, 1.2, 7), np.linspace(0.5, 1.0, 4)
                    )
                    coarse.append((err, shape, parts))
    coarse.sort(key=lambda t: t[0])
    best = min(((*search(parts, shape, SHARPNESS, np.linspace(0.3, 1.2, 10), np.linspace(0.4, 1.0, 7)), parts)
                for _, shape, parts in coarse[:3]), key=lambda t: t[0])  # fmt: skip
    b, parts = best[1], best[2]
    shape = {key: b[key] for key in ("tile_m", "tile_n", "wave_alpha", "quant_bytes")}
    fine = [c for c in np.linspace(b["compute"] - 0.08, b["compute"] + 0.08, 17) if 0 < c <= 1.3]
    fine_m = [v for v in np.linspace(b["memory"] - 0.08, b["memory"] + 0.08, 17) if 0 < v <= 1.2]
    return min(best[:2], search(parts, shape, (b["sharpness"],), fine, fine_m), key=lambda t: t[0])[1]


def waves_curve(fit: dict, m_tiles=()) -> GemmCurve:
    """A ``fit_waves`` result as the catalog holds it (its quantization bytes aside)."""
    return GemmCurve(
        fit["compute"], fit["memory"], fit["sharpness"], fit["tile_m"], fit["gemm_latency"], _AISIM_SRC,
        tile_n=fit["tile_n"], wave_alpha=fit["wave_alpha"], m_tiles=m_tiles,
    )  # fmt: skip


def curve_time(m, n, k, curve: GemmCurve, wb, peak, hw: Hardware, quant=0.0) -> np.ndarray:
    """``gemm.curve_gemm_time`` (what the cost model prices a GEMM of a format with its own curve
    with), plus the quantization kernel's bytes at the curve's memory rate."""
    t = curve_gemm_time(m, n, k, curve, peak, hw.memory_bandwidth, hw.sms, wb, ACT_BYTES)
    return t + m * k * quant / (hw.memory_bandwidth * curve.memory)


def catalog_time(m, n, k, hw: Hardware, fmt: str, wb, peak, own: bool) -> np.ndarray:
    """A GEMM as the catalog prices it: the format's own curve when it has one and ``own``, else
    the GPU's curve with the format's factors in one join (the form before format curves)."""
    g = hw.gemm
    curve = g.curve_for(fmt) if own else None
    if curve is not None:
        return curve_time(m, n, k, curve, wb, peak, hw)
    fc, fm = g.factors_for(fmt)
    return gemm_time(
        m, n, k, wb, peak, hw, g.compute * fc, g.memory * fm, g.sharpness, g.tile_m, g.gemm_latency
    )


def stats(pred: np.ndarray, y: np.ndarray) -> dict:
    """|relative error|: mean, p90, max, signed bias, and weighted by each row's time (the
    error of a sum of such GEMMs, as an iteration is)."""
    e = pred / y - 1
    return {
        "n": len(e),
        "mean": float(np.mean(np.abs(e))),
        "time_weighted": float(np.sum(np.abs(e) * y) / np.sum(y)),
        "p90": float(np.quantile(np.abs(e), 0.9)),
        "max": float(np.max(np.abs(e))),
        "bias": float(np.mean(e)),
    }


def gemm_part(
    tables: dict, console: Console, framework: str = "vllm", reference: dict | None = None, waves: bool = True
) -> dict:
    """Each GPU and format's curve fitted and held out. ``reference``: vLLM's results of the same
    run; each held-out row is also priced with vLLM's fitted curve (what the catalog prices an
    engine with when it has no curve of its own). ``waves``: the wave-form fit too (slow)."""
    out: dict = {}
    table = Table(
        title=f"GEMM ({FRAMEWORK_NAMES[framework]}'s kernels): held-out |error| on model-sized weights "
        "(N x K >= 2^24; fit on half the (N, K) shapes, tested on the other half); 'all sizes': every "
        "held-out shape, tiny ones too"
    )
    for col in (
        "GPU",
        "format",
        "rows",
        "generic mean",
        "fitted mean / p90 / max",
        "time-weighted",
        "fit",
        "all sizes",
        *(("vLLM's curve: mean / bias",) if reference is not None else ()),
        *(("waves + quant: mean / p90 / max", "time-weighted ", "waves fit") if waves else ()),
    ):
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS or not entry.get("gemm"):
            continue
        hw = get_hardware(GPUS[gpu])
        rows = entry["gemm"]
        for fmt in FORMATS:
            sel = [r for r in rows if r[0] == fmt and r[4] > 0]
            if not sel:
                continue
            prec = get_precision(FORMATS[fmt])
            peak = hw.peak_for(prec.compute)
            m, n, k, y = (np.array([r[i] for r in sel], dtype=float) for i in (1, 2, 3, 4))
            y = y * 1e-3  # milliseconds
            shapes = sorted({(a, b) for a, b in zip(n, k)})
            test_shapes = set(shapes[1::2])
            test = np.array([(a, b) in test_shapes for a, b in zip(n, k)])
            sized = n * k >= MODEL_SIZED
            train = ~test & sized
            params = fit(m[train], n[train], k[train], y[train], prec.bytes, peak, hw)
            pred = gemm_time(m, n, k, prec.bytes, peak, hw, **_curve(params))
            generic = gemm_time(m, n, k, prec.bytes, peak, hw, 0.6, 0.8, math.inf, 1, 0.0)
            held = test & sized
            res: dict = {}
            if waves:
                q = QUANT_BYTES[fmt]
                wfit = fit_waves(
                    m[train], n[train], k[train], y[train], prec.bytes, peak, hw, (0.0, q) if q else (0.0,)
                )
                wparts = (m, n, k, prec.bytes, peak, hw, wfit["tile_m"], wfit["tile_n"], wfit["wave_alpha"])
                wpred = wave_time(wave_parts(*wparts, wfit["quant_bytes"]), wfit["compute"], wfit["memory"],
                                  wfit["sharpness"], wfit["gemm_latency"])  # fmt: skip
                if fmt != "bfloat16":
                    # The catalog's form: the wave form without the quantization kernel (served, vLLM
                    # fuses it into the norm or activation before), so the fit takes its time into
                    # the rates and launch latency; then the catalog itself, before (the GPU's curve
                    # with the format's factors) and now (the format's own curve where it has one).
                    served = fit_waves(m[train], n[train], k[train], y[train], prec.bytes, peak, hw, (0.0,))
                    spred = curve_time(m, n, k, waves_curve(served), prec.bytes, peak, hw)
                    before = catalog_time(m, n, k, hw, FORMATS[fmt], prec.bytes, peak, own=False)
                    after = catalog_time(m, n, k, hw, FORMATS[fmt], prec.bytes, peak, own=True)
                    res.update(
                        served_fit=served,
                        served_held_out=stats(spred[held], y[held]),
                        catalog_before_held_out=stats(before[held], y[held]),
                        catalog_held_out=stats(after[held], y[held]),
                        catalog_has_curve=hw.gemm.curve_for(FORMATS[fmt]) is not None,
                    )
                    if fmt == "fp8" and gpu in HOPPER:
                        tiled = fit_waves(
                            m[train],
                            n[train],
                            k[train],
                            y[train],
                            prec.bytes,
                            peak,
                            hw,
                            (0.0,),
                            HOPPER_FP8_TILES,
                        )
                        tpred = curve_time(
                            m, n, k, waves_curve(tiled, HOPPER_FP8_TILES), prec.bytes, peak, hw
                        )
                        res.update(tiles_fit=tiled, tiles_held_out=stats(tpred[held], y[held]),
                                   tiles_train=stats(tpred[train], y[train]))  # fmt: skip
                        console.print(
                            f"{GPUS[gpu]} fp8 tile by M: held-out {res['tiles_held_out']['mean']:.1%} / "
                            f"max {res['tiles_held_out']['max']:.0%} (one tile: {res['served_held_out']['mean']:.1%} / "
                            f"{res['served_held_out']['max']:.0%}); fit {tiled}"
                        )
                    sh, cb, ca = (
                        res["served_held_out"],
                        res["catalog_before_held_out"],
                        res["catalog_held_out"],
                    )
                    console.print(
                        f"{GPUS[gpu]} {fmt}: served fit {sh['mean']:.1%} / {sh['max']:.0%} "
                        f"(c {served['compute']:.2f} m {served['memory']:.2f} p {served['sharpness']} tile "
                        f"{served['tile_m']}x{served['tile_n']} a {served['wave_alpha']} "
                        f"lat {served['gemm_latency'] * 1e6:.2f} us); catalog before {cb['mean']:.1%} / {cb['max']:.0%}, "
                        f"now {ca['mean']:.1%} / {ca['max']:.0%} p90 {ca['p90']:.1%}"
                    )
                res |= {
                    "waves_fit": wfit,
                    "waves_held_out": stats(wpred[held], y[held]),
                    "waves_train": stats(wpred[train], y[train]),
                    "waves_held_out_all_sizes": stats(wpred[test], y[test]),
                }
            ref = (reference or {}).get(gpu, {}).get(fmt)
            if ref is not None:  # this engine's rows priced with vLLM's curve
                vpred = gemm_time(m, n, k, prec.bytes, peak, hw, **_curve(ref["fit"]))
                res["vllm_curve_held_out"] = stats(vpred[held], y[held])
            res |= {
                "fit": params,
                "train": stats(pred[train], y[train]),
                "held_out": stats(pred[held], y[held]),
                "generic_held_out": stats(generic[held], y[held]),
                "held_out_all_sizes": stats(pred[test], y[test]),
                "peak_tflops": peak / 1e12,
                "weight_bytes": prec.bytes,
            }
            out.setdefault(gpu, {})[fmt] = res
            h, g = res["held_out"], res["generic_held_out"]
            cells = [
                GPUS[gpu],
                fmt,
                str(h["n"]),
                f"{g['mean']:.1%}",
                f"{h['mean']:.1%} / {h['p90']:.1%} / {h['max']:.0%}",
                f"{h['time_weighted']:.1%}",
                f"c {params['compute']:.2f} m {params['memory']:.2f} p {params['sharpness']} "
                f"tile {params['tile_m']} lat {params['gemm_latency'] * 1e6:.1f} us",
                f"{res['held_out_all_sizes']['mean']:.1%}",
            ]
            if reference is not None:
                v = res.get("vllm_curve_held_out")
                cells.append(f"{v['mean']:.1%} / {v['bias']:+.1%}" if v else "-")
            if waves:
                wh, wfit = res["waves_held_out"], res["waves_fit"]
                cells += [
                    f"{wh['mean']:.1%} / {wh['p90']:.1%} / {wh['max']:.0%}",
                    f"{wh['time_weighted']:.1%}",
                    f"c {wfit['compute']:.2f} m {wfit['memory']:.2f} p {wfit['sharpness']} tile "
                    f"{wfit['tile_m']}x{wfit['tile_n']} a {wfit['wave_alpha']} q {wfit['quant_bytes']:.2f} "
                    f"lat {wfit['gemm_latency'] * 1e6:.1f} us",
                ]
            table.add_row(*cells)
    console.print(table)
    return out


def _curve(p: dict) -> dict:
    return dict(c=p["compute"], mem=p["memory"], p=p["sharpness"], tile=p["tile_m"], lat=p["gemm_latency"])


def _fit_moe(
    c: np.ndarray, b: np.ndarray, y: np.ndarray, p: float, rows: np.ndarray | None = None, cap: float = 1.5
) -> dict:
    """Factors on the GEMM curve's compute and memory rates for the fused MoE kernel (routing,
    permutation and weight-only dequantization make it slower than a dense GEMM) and a fixed time
    per layer: the smallest mean |relative error|, a log grid then a finer one. With ``rows``
    (routed rows x hidden size per layer), also a time per such element (the rows' gather,
    activation and scatter around the grouped GEMMs, which tensor parallelism does not split):
    non-negative least squares in relative terms with the fixed time. ``cap``: the factors'
    largest value (1: the fused kernel never faster than the dense curve)."""
    best = (math.inf, None)
    columns = np.column_stack([np.ones_like(y)] + ([rows] if rows is not None else []))

    def score(fc: float, fm: float) -> tuple[float, dict]:
        base = join_array(c / fc, b / fm, p)
        coef, err = _fixed_terms(base, y, columns)
        return err, {"compute_factor": fc, "memory_factor": fm, "layer_latency": float(coef[0]),
                     "row_element": float(coef[1]) if rows is not None else 0.0}  # fmt: skip

    grid = np.geomspace(0.05, 1.5, 24)
    grid = np.append(grid[grid < cap], cap) if cap < grid[-1] else grid
    for fc in grid:
        for fm in grid:
            cand = score(float(fc), float(fm))
            if cand[0] < best[0]:
                best = cand
    b0 = best[1]
    for fc in np.minimum(b0["compute_factor"] * np.geomspace(0.85, 1.15, 9), cap):
        for fm in np.minimum(b0["memory_factor"] * np.geomspace(0.85, 1.15, 9), cap):
            cand = score(float(fc), float(fm))
            if cand[0] < best[0]:
                best = cand
    return best[1]


# The fused-MoE kernel vLLM 0.32 runs by default for a format on a GPU family (tensor parallel, no
# expert parallelism, FlashInfer installed as in vLLM's image), where the tables hold several:
# its rows are the ground truth, the others are reported beside them. FP8 per tensor is what
# ``--quantization fp8`` makes of a bf16 checkpoint (vllm/model_executor/model_loader/
# weight_utils.py:351-358@v0.32.0: online fp8_per_tensor), dynamic per-tensor activations
# (online/fp8.py:517-523): FlashInfer's CUTLASS and TRT-LLM kernels take only static activation
# scales (experts/flashinfer_cutlass_moe.py:153-161, experts/trtllm_fp8_moe.py:379-388), so the
# oracle's first supported backend is Triton (oracle/fp8.py:86-102, 515-526; triton_moe.py:160-166),
# the tables' ``fused_moe`` rows. Block FP8 under TP: Triton on Hopper (oracle/fp8.py:120-130),
# FlashInfer's TRT-LLM monolithic kernel on Blackwell (first in the order; trtllm_fp8_moe.py:213-222).
# FP8 per tensor with the checkpoint's static activation scales (``fp8_static``: ModelOpt FP8,
# keyed (kFp8StaticTensorSym, kFp8StaticTensorSym), quantization/modelopt.py:495-501): FlashInfer's
# CUTLASS kernel on Hopper (the first in the order that takes static per-tensor scales on sm90,
# experts/flashinfer_cutlass_moe.py:146-175), FlashInfer's TRT-LLM monolithic kernel on Blackwell
# (first in the order, sm100 only, static per-tensor scales, routing Renormalize / DeepSeekV3 /
# Llama4 / ...: experts/trtllm_fp8_moe.py:165-172, 379-388, 399-432), under TP and EP alike (no
# EP reordering for per-tensor FP8, oracle/fp8.py:119-130). The tables' rows of these kernels
# are all ModelOpt layers (``modeloptfp8moe_*``).
# With expert parallelism vLLM 0.32 on Hopper moves FlashInfer's CUTLASS kernel first for block
# FP8 (oracle/fp8.py:120-130@v0.32.0): the tables time it at EP 2-256 only. The tables themselves
# live in src (aisim_moe_table.py), which --calibration aisim:FILE prices the experts with.
VLLM_MOE_KERNELS = VLLM_KERNELS
VLLM_MOE_EP_KERNELS = VLLM_EP_KERNELS


def engine_kernel(
    framework: str, gpu: str, fmt: str, rows: list, expert_parallel: bool = False
) -> tuple[str, list]:
    """The kernel whose rows price the format: vLLM's default (``VLLM_MOE_KERNELS``, with
    ``expert_parallel`` ``VLLM_MOE_EP_KERNELS``) where the tables have its rows, else the kernel
    with the most model shapes (``main_kernel``)."""
    kernels = VLLM_MOE_EP_KERNELS if expert_parallel else VLLM_MOE_KERNELS
    kernel = kernels.get((gpu, fmt)) if framework == "vllm" else None
    own = [r for r in rows if r[8] == kernel]
    return (kernel, own) if own else main_kernel(rows)


def main_kernel(rows: list) -> tuple[str, list]:
    """The kernel with the most model shapes among a format's fused-MoE rows (ties: the most
    rows) and its rows. A format's rows come from several kernels across vLLM versions (on the
    H200, FP8 per tensor from the generic Triton ``fused_moe`` and FlashInfer's CUTLASS kernel)
    that differ by up to 3x on one shape; mixed, no single curve fits either."""
    shapes: dict = {}
    for r in rows:
        shapes.setdefault(r[8], set()).add((r[2], r[3], r[4], r[5]))
    kernel = max(shapes, key=lambda kn: (len(shapes[kn]), sum(r[8] == kn for r in rows), kn))
    return kernel, [r for r in rows if r[8] == kernel]


def moe_curve(curve: dict, fit: dict, math: str) -> MoeCurve:
    """A format's fitted fused-MoE kernel in the catalog's form (``hardware.MoeCurve``): the
    dense curve's efficiencies times the kernel's factors, its sharpness and row tile."""
    return MoeCurve(
        round(min(1.0, curve["compute"] * fit["compute_factor"]), 3),
        round(min(1.0, curve["memory"] * fit["memory_factor"]), 3),
        curve["sharpness"], int(curve["tile_m"]), round(fit["layer_latency"], 7),
        round(fit["row_element"], 15), math,
    )  # fmt: skip


def catalog_moe_time(hw: Hardware, weights: str, rows: list, expert_parallel: bool = False) -> np.ndarray:
    """Each fused-MoE row as the cost model prices one MoE layer on ``hw`` (``CostModel._experts``:
    the kernel's curve for the format, else its factors on the GPU's curve), the experts in
    ``weights`` sliced over the row's expert TP, or with ``expert_parallel`` placed whole on the
    row's EP ranks (rows at expert TP 1)."""
    models: dict = {}
    out = []
    for _, tokens, hidden, inter, topk, experts, tp, ep, _kernel, _latency in rows:
        key = (int(hidden), int(inter), int(topk), int(experts), int(ep if expert_parallel else tp))
        cm = models.get(key)
        if cm is None:
            spec = ModelSpec(
                f"moe-{key}", key[0], 1, 64, 64, 1, 1, 4096, num_experts=key[3], experts_per_token=key[2],
                moe_intermediate_size=key[1], expert_dtype="" if weights == "bf16" else weights,
            )  # fmt: skip
            cm = models[key] = CostModel(spec, hw, key[4], expert_parallel=expert_parallel)
        out.append(cm._experts(int(tokens)))
    return np.array(out)


def moe_part(
    tables: dict, gemm: dict, console: Console, framework: str = "vllm", reference: tuple | None = None
) -> dict:
    """Each fused-MoE row (EP 1) priced with the GEMM curve of its GPU and format, first as is,
    then with the MoE kernel's factors fitted on half the model shapes and tested on the rest.
    ``reference``: vLLM's (gemm, moe) results; each held-out row is also priced with vLLM's
    curve and vLLM's MoE factors for the format."""
    out: dict = {}
    table = Table(
        title=f"Fused MoE layer (EP 1, {FRAMEWORK_NAMES[framework]}'s kernels): |error| with the dense "
        "GEMM curve, then with MoE factors fitted on half the model shapes (held out: the other half)"
    )
    for col in ("GPU", "format", "kernel", "shapes", "rows held out", "GEMM curve: mean", "fitted: mean / p90 / max",
                "time-weighted", "monotone floor mean / max", "factors c / m, latency",
                *(("vLLM's curve and factors: mean / bias",) if reference is not None else ())):  # fmt: skip
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS or gpu not in gemm:
            continue
        hw = get_hardware(GPUS[gpu])
        by_fmt: dict = {}
        for r in entry.get("moe", []):
            if r[7] == 1 and r[9] > 0:  # EP 1: the all-to-all is not in these rows
                by_fmt.setdefault(r[0], []).append(r)
        jobs = [(fmt, fmt, rows) for fmt, rows in sorted(by_fmt.items())]
        if framework == "vllm" and (gpu, "fp8_static") in FP8_STATIC_KERNELS and "fp8" in by_fmt:
            # static-scale FP8 (ModelOpt) checkpoints: the tables' fp8 rows of their kernel
            jobs.append(("fp8_static", "fp8_static", by_fmt["fp8"]))
        if framework == "vllm":
            # the kernel vLLM runs with expert parallelism where it is another (VLLM_MOE_EP_KERNELS),
            # on the tables' rows of that kernel at EP 2-64 (each rank its E / EP whole experts)
            for (g, fmt), kn in VLLM_MOE_EP_KERNELS.items():
                table_fmt = "fp8" if fmt == "fp8_static" else fmt
                ep_rows = [r for r in entry.get("moe", []) if g == gpu and r[0] == table_fmt and r[8] == kn
                           and 1 < r[7] <= 64 and r[6] == 1 and r[5] % r[7] == 0 and r[9] > 0]  # fmt: skip
                if ep_rows:
                    jobs.append((f"{fmt}@ep", fmt, ep_rows))
        for label, fmt, all_rows in jobs:
            if fmt not in MOE_FORMATS or MOE_FORMATS[fmt][0] not in gemm[gpu]:
                continue
            expert_parallel = label.endswith("@ep")
            kernel, rows = engine_kernel(framework, gpu, fmt, all_rows, expert_parallel)
            if fmt == "fp8_static" and not kernel.startswith("vllm_modelopt"):
                continue  # no rows of the static-scale kernel here
            curve_fmt, weights = MOE_FORMATS[fmt]
            curve = gemm[gpu][curve_fmt]["fit"]
            prec = get_precision(weights)
            flops_rate = hw.peak_for(get_precision(FORMATS[curve_fmt]).compute) * curve["compute"]
            byte_rate = hw.memory_bandwidth * curve["memory"]
            c, b, y, shape, series, toks, elements = [], [], [], [], [], [], []
            for _, tokens, hidden, inter, topk, experts, tp, ep, _kernel, latency in rows:
                flops, moved = grouped_gemm_parts(
                    int(tokens), int(experts), int(topk), int(hidden), int(inter),
                    weight_bytes=prec.bytes, act_bytes=ACT_BYTES, tile_m=curve["tile_m"], moe_tp=int(tp),
                    ep=int(ep),
                )  # fmt: skip
                c.append(flops / flops_rate)
                b.append(moved / byte_rate)
                y.append(latency * 1e-3)
                shape.append((hidden, inter, topk, experts))
                series.append((hidden, inter, topk, experts, tp, ep))
                toks.append(tokens)
                elements.append(tokens * topk * hidden / ep)  # each rank's mean share (CostModel's)
            c_a, b_a, y_a = (np.array(v, dtype=float) for v in (c, b, y))
            p = curve["sharpness"]
            as_is = join_array(c_a, b_a, p) + 2 * curve["gemm_latency"]
            shapes = sorted(set(shape))
            test_shapes = set(shapes[1::2])
            test = np.array([s_ in test_shapes for s_ in shape])
            res: dict = {"rows": len(y_a), "shapes": len(shapes), "kernel": kernel,
                         "kernels": sorted({r[8] for r in all_rows}), "gemm_curve": stats(as_is, y_a)}  # fmt: skip
            if len(shapes) >= 2:
                el = np.array(elements, dtype=float)
                f0 = _fit_moe(c_a[~test], b_a[~test], y_a[~test], p)  # without the rows' term
                pred0 = (
                    join_array(c_a / f0["compute_factor"], b_a / f0["memory_factor"], p) + f0["layer_latency"]
                )
                f = _fit_moe(c_a[~test], b_a[~test], y_a[~test], p, el[~test])
                pred = join_array(c_a / f["compute_factor"], b_a / f["memory_factor"], p) + f["layer_latency"]
                pred = pred + el * f["row_element"]
                res.update(fit=f, held_out=stats(pred[test], y_a[test]), train=stats(pred[~test], y_a[~test]),
                           fit_without_rows=f0, held_out_without_rows=stats(pred0[test], y_a[test]))  # fmt: skip
                # the factors capped at 1: the fused kernel never faster than the dense curve
                fcap = _fit_moe(c_a[~test], b_a[~test], y_a[~test], p, el[~test], cap=1.0)
                pcap = join_array(c_a / fcap["compute_factor"], b_a / fcap["memory_factor"], p)
                pcap = pcap + fcap["layer_latency"] + el * fcap["row_element"]
                res.update(fit_capped=fcap, held_out_capped=stats(pcap[test], y_a[test]))
                if framework == "vllm":
                    # the catalog as users get it: on the kernel's factors (before), on the
                    # format's own curve where the catalog holds one (now), and this fit's curve
                    math = "bf16" if curve_fmt == "bfloat16" else get_precision(weights).compute
                    own = moe_curve(curve, f, math)
                    res["catalog_curve"] = {"compute": own.compute, "memory": own.memory,
                                            "sharpness": own.sharpness, "tile_m": own.tile_m,
                                            "layer_latency": own.layer_latency,
                                            "row_element": own.row_element, "math": own.math}  # fmt: skip
                    moe = hw.moe
                    before = (
                        replace(hw, moe=replace(moe, format_curves=(), ep_format_curves=())) if moe else hw
                    )
                    cat_before = catalog_moe_time(before, weights, rows, expert_parallel)
                    cat_now = catalog_moe_time(hw, weights, rows, expert_parallel)
                    res["catalog_before"] = stats(cat_before[test], y_a[test])
                    res["catalog_now"] = stats(cat_now[test], y_a[test])
                    res["catalog_own_curve"] = bool(moe and moe.curve_for(weights, expert_parallel))
                    if weights == "fp8_static":
                        # until fp8_static, a static-scale checkpoint was read as fp8 (Triton's curve)
                        as_fp8 = catalog_moe_time(hw, "fp8", rows, expert_parallel)
                        res["catalog_as_fp8"] = stats(as_fp8[test], y_a[test])
                    # the format's other kernels (another vLLM version's or another checkpoint
                    # format's, e.g. FlashInfer's CUTLASS kernel for static FP8 scales on Hopper),
                    # every row priced by the catalog now: what a deployment on them would miss by
                    for other in sorted({r[8] for r in all_rows} - {kernel} if not expert_parallel else ()):
                        o_rows = [r for r in all_rows if r[8] == other]
                        o_y = np.array([r[9] * 1e-3 for r in o_rows])
                        res.setdefault("other_kernels", {})[other] = stats(
                            catalog_moe_time(hw, weights, o_rows), o_y
                        )
                # what no model monotone in the tokens can beat: each (shape, TP) series' own scatter
                noise = _monotone_floor(np.array(toks, dtype=float), y_a, series)[test]
                res["monotone_floor"] = {"mean": float(noise.mean()), "max": float(noise.max())}
                if reference is not None:
                    cross = _vllm_moe_pred(reference, gpu, fmt, hw, rows)
                    if cross is not None:
                        res["vllm_curve_held_out"] = stats(cross[test], y_a[test])
            out.setdefault(gpu, {})[label] = res
            h = res.get("held_out")
            f = res.get("fit")
            table.add_row(
                GPUS[gpu],
                label,
                kernel.removeprefix("vllm_"),
                str(len(shapes)),
                str(h["n"]) if h else "-",
                f"{res['gemm_curve']['mean']:.1%}",
                f"{h['mean']:.1%} / {h['p90']:.1%} / {h['max']:.0%}" if h else "one shape: not held out",
                f"{h['time_weighted']:.1%}" if h else "-",
                f"{res['monotone_floor']['mean']:.1%} / {res['monotone_floor']['max']:.0%}" if h else "-",
                f"{f['compute_factor']:.2f} / {f['memory_factor']:.2f}, {f['layer_latency'] * 1e6:.1f} us, "
                f"{f['row_element'] * 1e12:.2f} ps/row element (without: {res['held_out_without_rows']['mean']:.1%})"
                if f
                else "-",
                *((f"{res['vllm_curve_held_out']['mean']:.1%} / {res['vllm_curve_held_out']['bias']:+.1%}"
                   if "vllm_curve_held_out" in res else "-",) if reference is not None else ()),
            )  # fmt: skip
    console.print(table)
    if framework == "vllm":
        console.print(_moe_catalog_table(out))
        for gpu, by_fmt in out.items():
            for fmt, res in by_fmt.items():
                if "catalog_as_fp8" in res:
                    a, n = res["catalog_as_fp8"], res["catalog_now"]
                    console.print(f"{GPUS[gpu]} {fmt}: held out ({n['n']} rows) as fp8 (before): {a['mean']:.1%} / "
                                  f"{a['p90']:.1%} / {a['max']:.0%}, bias {a['bias']:+.1%}; now: {n['mean']:.1%} / "
                                  f"{n['p90']:.1%} / {n['max']:.0%}, bias {n['bias']:+.1%}")  # fmt: skip
                for other, o in res.get("other_kernels", {}).items():
                    console.print(f"{GPUS[gpu]} {fmt}: {other.removeprefix('vllm_')} ({o['n']} rows) priced by the "
                                  f"catalog: {o['mean']:.1%} mean / {o['max']:.0%} max, bias {o['bias']:+.1%}")  # fmt: skip
    return out


def _moe_catalog_table(out: dict) -> Table:
    """The held-out fused-MoE rows as the catalog prices them, before (the kernel's factors on
    the GPU's curve) and now (the format's own curve where the catalog holds one), beside this
    fit with its factors capped at 1, and the fit in the catalog's form."""
    table = Table(title="Fused MoE held out, as the catalog prices it (vLLM kernels)")
    for col in ("GPU", "format", "factors capped at 1: mean / max", "uncapped fit: mean / max",
                "catalog before: mean / p90 / max", "catalog now: mean / p90 / max", "own curve",
                "fit as hardware.MoeCurve"):  # fmt: skip
        table.add_column(col)
    for gpu, by_fmt in out.items():
        for fmt, res in by_fmt.items():
            if "catalog_now" not in res:
                continue
            hc, h, b, n, c = (res[k] for k in ("held_out_capped", "held_out", "catalog_before", "catalog_now",
                                                "catalog_curve"))  # fmt: skip
            table.add_row(
                GPUS[gpu], fmt, f"{hc['mean']:.1%} / {hc['max']:.0%}", f"{h['mean']:.1%} / {h['max']:.0%}",
                f"{b['mean']:.1%} / {b['p90']:.1%} / {b['max']:.0%}",
                f"{n['mean']:.1%} / {n['p90']:.1%} / {n['max']:.0%}", "yes" if res["catalog_own_curve"] else "no",
                f"MoeCurve({c['compute']}, {c['memory']}, {c['sharpness']}, {c['tile_m']}, "
                f"{c['layer_latency'] * 1e6:.1f}e-6, {c['row_element'] * 1e12:.2f}e-12, {c['math']!r})",
            )  # fmt: skip
    return table


def _vllm_moe_pred(reference: tuple, gpu: str, fmt: str, hw: Hardware, rows: list) -> np.ndarray | None:
    """The rows priced with vLLM's GEMM curve and vLLM's fitted MoE factors for the GPU and
    format (None: vLLM's tables lack them)."""
    vgemm, vmoe = reference
    curve_fmt, weights = MOE_FORMATS[fmt]
    curve = vgemm.get(gpu, {}).get(curve_fmt, {}).get("fit")
    f = vmoe.get(gpu, {}).get(fmt, {}).get("fit")
    if curve is None or f is None:
        return None
    prec = get_precision(weights)
    flops_rate = hw.peak_for(get_precision(FORMATS[curve_fmt]).compute) * curve["compute"]
    byte_rate = hw.memory_bandwidth * curve["memory"]
    pred = []
    for _, tokens, hidden, inter, topk, experts, tp, _ep, _kernel, _latency in rows:
        flops, moved = grouped_gemm_parts(
            int(tokens), int(experts), int(topk), int(hidden), int(inter),
            weight_bytes=prec.bytes, act_bytes=ACT_BYTES, tile_m=curve["tile_m"], moe_tp=int(tp),
        )  # fmt: skip
        c = flops / flops_rate / f["compute_factor"]
        b = moved / byte_rate / f["memory_factor"]
        pred.append(float(join_array(np.array([c]), np.array([b]), curve["sharpness"])[0])
                    + f["layer_latency"] + tokens * topk * hidden * f["row_element"])  # fmt: skip
    return np.array(pred)


# The all-reduce messages a layer sends: tokens x hidden elements, up to 8,192 x 8,192; the tables
# go on to 2^29 elements, which no iteration sends.
MAX_ALLREDUCE_ELEMENTS = 2**26


def allreduce_part(tables: dict, console: Console) -> dict:
    """vLLM's custom all-reduce (CUDA graphs, bf16) per GPU: the catalog's figures, then one
    latency per TP degree and one link efficiency per GPU fitted on the even-indexed message
    sizes and tested on the odd ones (the form ``hardware.Hardware`` held before), then one line
    per kernel regime on the same split (``_allreduce_fit.regime_fit``; ``Hardware.allreduce_bands``)."""
    out: dict = {}
    table = Table(
        title="TP all-reduce (vLLM custom, CUDA graphs, bf16, messages <= 2^26 elements): |error| "
        "held out on every other message size"
    )
    for col in (
        "GPU",
        "TP",
        "sizes held out",
        "catalog mean / max",
        "fitted mean / max",
        "fit: latency, link eff",
        "regimes mean / max",
        "regimes (training sizes)",
    ):
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS or not entry.get("allreduce"):
            continue
        hw = get_hardware(GPUS[gpu])
        rows = sorted(
            (int(t), int(n), float(ms) * 1e-3)
            for t, n, ms in entry["allreduce"]
            if n <= MAX_ALLREDUCE_ELEMENTS
        )
        tps = sorted({t for t, _, _ in rows})
        data = {}
        for tp in tps:
            sel = [(n, y) for t, n, y in rows if t == tp]
            n = np.array([x for x, _ in sel], dtype=float)
            y = np.array([v for _, v in sel], dtype=float)
            ring = 2.0 * (tp - 1) / tp * 2.0 * n / hw.interconnect_bandwidth  # seconds at full link
            test = np.arange(len(n)) % 2 == 1
            data[tp] = (n, y, ring, test)
        best = (math.inf, 0.0, {})
        for eff in np.linspace(0.05, 1.0, 96):
            lats, errs = {}, []
            for tp, (_n, y, ring, test) in data.items():
                base = ring[~test] / eff
                w = 1.0 / y[~test]
                lat = max(0.0, float(np.sum(w * (1 - base * w)) / np.sum(w * w)))
                lats[tp] = lat
                errs.append(np.abs((base + lat) / y[~test] - 1))
            err = float(np.mean(np.concatenate(errs)))
            if err < best[0]:
                best = (err, float(eff), lats)
        _, eff, lats = best
        cat_eff = hw.comm_efficiency or 0.8
        res: dict = {"link_efficiency": eff, "version": entry.get("allreduce_version"), "by_tp": {}}
        bands = []
        for tp, (n, y, ring, test) in data.items():
            pred = lats[tp] + ring / eff
            catalog = hw.allreduce_latency_at(tp) + ring / cat_eff
            reg = regime_fit(GPUS[gpu], res["version"], tp, n, y, ring, test, lats[tp], eff)
            bands += reg["bands"]
            res["by_tp"][tp] = {
                "latency_s": lats[tp],
                "held_out": stats(pred[test], y[test]),
                "catalog_held_out": stats(catalog[test], y[test]),
                "regimes_held_out": stats(reg["pred"][test], y[test]),
                "regimes": reg["regimes"],
                # each size: elements, measured and regime-priced seconds, held out or not
                "points": [
                    [int(a), float(b), float(c), bool(t)] for a, b, c, t in zip(n, y, reg["pred"], test)
                ],
            }
            h, c = res["by_tp"][tp]["held_out"], res["by_tp"][tp]["catalog_held_out"]
            r = res["by_tp"][tp]["regimes_held_out"]
            table.add_row(
                GPUS[gpu], str(tp), str(h["n"]), f"{c['mean']:.1%} / {c['max']:.0%}",
                f"{h['mean']:.1%} / {h['max']:.0%}", f"{lats[tp] * 1e6:.1f} us, {eff:.2f}",
                f"{r['mean']:.1%} / {r['max']:.0%}",
                ", ".join(f"{k} ({v['train']})" for k, v in reg["regimes"].items()),
            )  # fmt: skip
        res["bands"] = [[b.tp, b.max_bytes, b.latency, b.efficiency] for b in bands]
        out[gpu] = res
    console.print(table)
    console.print(
        "Regime lines in the catalog's form (hardware.AllReduceBand: tp, max bytes, latency, efficiency):"
    )
    for gpu, res in out.items():
        console.print(f"  {GPUS[gpu]} (vLLM {res['version']}): " + ", ".join(
            f"AllReduceBand({tp}, {int(top)}, {lat:.3g}, {eff:.3f})" for tp, top, lat, eff in res["bands"]
        ), soft_wrap=True)  # fmt: skip
    return out


MLA_FORMATS = {"bfloat16": "bf16", "fp8_block": "fp8_block"}
NEUTRAL_MLA = MlaKernel((), 1.0, 1.0, 0.0, 0.0, "neutral: the parts as the curves price them")
# the same with block FP8's dense GEMMs on its own curve (where the GPU has one)
NEUTRAL_MLA_CURVE = replace(NEUTRAL_MLA, curve_terms=(("fp8_block", MlaCurveTerms(1.0, 0.0, 0.0, 0.0)),))


def _mla_layer(heads: int, weights: str):
    """One MLA layer of DeepSeek-V3's shapes with ``heads`` heads, no MLP worth pricing (one
    intermediate unit) and no LM head: the module the table times, as one TP shard at TP 1."""
    ds = get_model("deepseek-v3")
    return replace(
        ds, name=f"mla-{heads}", num_layers=1, num_heads=heads, num_kv_heads=heads, num_experts=0,
        experts_per_token=0, moe_intermediate_size=0, shared_intermediate_size=0, first_dense_layers=0,
        intermediate_size=1, vocab_size=1, weight_dtype="" if weights == "bf16" else weights,
        expert_dtype="", kv_dtype="",
    )  # fmt: skip


def _mla_shape(phase: str, batch: int, length: int) -> BatchShape:
    if phase == "context":
        return BatchShape.of([(length, 0)] * batch, [])
    return BatchShape.of([], [length] * batch)


def _mla_linear(cm: CostModel, num_tokens: int) -> float:
    """The one-layer MLA model's GEMMs as the module's share of them: the layer join, which
    holds the block's four launches (the fit absorbs them); on the weights' format curve the
    projections alone (the stand-in MLP's GEMMs would bring launches of their own, which the
    module does not run; its launches go to the fitted fixed times)."""
    if cm.format_curve is not None:
        return cm._mla_projections(num_tokens)
    return cm.linear_time(num_tokens, 0)


def _mla_parts(
    hw: Hardware, rows: list, phase: str, weights: str, curve: bool = False
) -> tuple[np.ndarray, ...]:
    """Per row: (the rest of the layer, the projections' join, the attention) as the cost model
    prices them with a neutral MLA kernel, the measured seconds, the decode path's per-request
    columns (``_mla_columns``) and the new tokens. ``curve``: the dense GEMMs on the format's
    own curve (``MlaKernel.curve_terms``)."""
    neutral = replace(hw, mla=NEUTRAL_MLA_CURVE if curve else NEUTRAL_MLA)
    rest, proj, attn, y, per_request, tokens = [], [], [], [], [], []  # the neutral kernel: no fixed time
    models: dict[int, CostModel] = {}
    for heads, batch, length, ms in rows:
        cm = models.get(heads)
        if cm is None:
            cm = models[heads] = CostModel(_mla_layer(heads, weights), neutral, 1)
        shape = _mla_shape(phase, batch, length)
        p = cm._mla_projections(shape.num_tokens)
        rest.append(_mla_linear(cm, shape.num_tokens) - p)
        proj.append(p)
        attn.append(cm.attention_time(shape))
        y.append(ms * 1e-3)
        prefills, decodes = shape.num_prefills, shape.num_decodes
        context = shape.decode_kv_tokens / decodes if decodes else 0.0
        per_request.append((prefills, prefills * heads, decodes, decodes * heads, context))
        tokens.append(shape.num_tokens)
    return tuple(np.array(v, dtype=float) for v in (rest, proj, attn, y, per_request, tokens))


def _fixed_terms(base: np.ndarray, y: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative coefficients of ``columns`` (one row per measurement) minimising the squared
    relative error of ``base + columns @ coef``, and the mean |relative error|."""
    w = 1.0 / y
    scale = np.maximum(np.abs(columns).max(axis=0), 1e-300)  # columns of unit size for lstsq
    active = [j for j in range(columns.shape[1]) if columns[:, j].any()]
    coef = np.zeros(columns.shape[1])
    while active:
        a = columns[:, active] / scale[active] * w[:, None]
        sol, *_ = np.linalg.lstsq(a, 1.0 - base * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol / scale[active]
            break
        active.pop(int(np.argmin(sol)))  # drop the most negative term and refit the others
    pred = base + columns @ coef
    return coef, float(np.mean(np.abs(pred / y - 1)))


def _mla_columns(
    phases: np.ndarray, per_request: np.ndarray, knee: tuple[int, float] = (0, 1.0)
) -> np.ndarray:
    """The fixed-time terms' columns: the prefill path, the decode path, the prefill path's
    chunks and chunks x heads (``hardware.MlaKernel``'s prefill_request and prefill_head; 0 on
    decode rows), and the decode path's decodes, decodes x heads and mean context
    (decode_request, decode_head and decode_context; 0 on prefill rows), the decodes past
    ``knee``'s count counted at its share (decode_knee, decode_beyond)."""
    per_request = per_request.copy()
    if knee[0]:
        n = per_request[:, 2]
        beyond = np.maximum(n - knee[0], 0)
        scale = np.divide(n - beyond + beyond * knee[1], n, out=np.zeros_like(n), where=n > 0)
        per_request[:, 2] *= scale
        per_request[:, 3] *= scale
    return np.column_stack([(phases == 0).astype(float), (phases == 1).astype(float), per_request])


# The decode path's knee: past KNEE decodes, each adds BEYOND of a decode's per-request time
# (0: no knee). The tables' batches are powers of two, so a knee between them is not told apart.
DECODE_KNEES = (0, 128, 256, 512)
DECODE_BEYOND = np.linspace(0.0, 1.0, 21)


# The prefill attention factor is fitted only where the rows say something of it: when the
# roofline attention is under this share of every training row's time it stays 1 (the Hopper
# tables stop at 512-token prompts, where attention is ~3% of the block: a free factor there
# drifts to 0.3, pricing a 32K-token prompt's attention at three times the roofline on
# evidence from short ones).
MIN_ATTENTION_SHARE = 0.1


def _fit_mla(parts: dict, train: dict, curve_parts: dict | None = None) -> MlaKernel:
    """The bf16 rows of both phases give the projections' factor (one GEMM curve for both), the
    prefill and decode attention factors (<= 1: never faster than the roofline), each path's
    fixed time per layer and the decode path's per-request terms; then, the factors held, the
    prefill path's fixed time and per-request terms on the prefill rows alone (fitted jointly,
    the per-request terms moved the shared projections' factor on H200 from 0.82 to 0.90, and
    the decode rows lost what the prefill rows gained); the FP8 rows then their own projection
    factor, the rest held. (A time per new token was tried as a prefill term: the prefill rows,
    up to 131,072 tokens, fit it to 0.)"""
    rc, pc, ac, yc, qc, _ = (v[train["context"]] for v in parts[("context", "bf16")])
    rg, pg, ag, yg, qg, _ = (v[train["generation"]] for v in parts[("generation", "bf16")])
    y = np.concatenate((yc, yg))
    phases = np.concatenate((np.zeros(len(yc)), np.ones(len(yg))))
    cols = _mla_columns(phases, np.concatenate((qc, qg)))
    prefill_requests = [2, 3]  # the per-request prefill columns, fitted second
    first = cols.copy()
    first[:, prefill_requests] = 0.0  # an all-zero column gets no coefficient
    best = (math.inf, None)
    grid = np.geomspace(0.05, 1.0, 24)
    identified = float(np.max(ac / (rc + pc + ac))) >= MIN_ATTENTION_SHARE
    fp_grid = grid if identified else np.array([1.0])
    for f in np.geomspace(0.2, 1.0, 17):
        for fp in fp_grid:
            base_c = rc + pc / f + ac / fp
            for fd in grid:
                base = np.concatenate((base_c, rg + pg / f + ag / fd))
                coef, err = _fixed_terms(base, y, first)
                if err < best[0]:
                    best = (err, (float(f), float(fp), float(fd), coef))
    f, fp, fd, coef = best[1]
    prefill_terms = [0, *prefill_requests]
    coef[prefill_terms], _ = _fixed_terms(rc + pc / f + ac / fp, yc, cols[: len(yc)][:, prefill_terms])
    # The decode path's knee, the factors held: its terms refitted on the decode rows alone.
    decode_terms = [1, 4, 5, 6]
    base_g, phases_g = rg + pg / f + ag / fd, np.ones(len(yg))
    best_knee = (math.inf, (0, 1.0), coef[decode_terms])
    for k in DECODE_KNEES:
        for beyond in DECODE_BEYOND if k else (1.0,):
            c, err = _fixed_terms(base_g, yg, _mla_columns(phases_g, qg, (k, float(beyond)))[:, decode_terms])
            if err < best_knee[0]:
                best_knee = (err, (k, float(beyond)), c)
    knee, coef[decode_terms] = best_knee[1], best_knee[2]
    factors = [("bf16", f)]
    format_requests: tuple[tuple[str, float], ...] = ()
    format_latency: tuple[tuple[str, float], ...] = ()
    curve_terms: tuple[tuple[str, MlaCurveTerms], ...] = ()
    if ("context", "fp8_block") in parts:
        sel = (train["context8"], train["generation8"])
        f8, latency, per_decode, _ = _fit_mla_format(parts, sel, coef, knee, fp, fd, tokens=False)
        factors.append(("fp8_block", f8))
        format_latency = (("fp8_block", latency),)
        format_requests = (("fp8_block", per_decode),)
        if curve_parts:
            curve_terms = (
                ("fp8_block", MlaCurveTerms(*_fit_mla_format(curve_parts, sel, coef, knee, fp, fd))),
            )
    return MlaKernel(
        tuple(factors), fp, fd, float(coef[0]), float(coef[1]), "fit",
        decode_request=float(coef[4]), decode_head=float(coef[5]), decode_context=float(coef[6]),
        decode_request_by_format=format_requests, latency_by_format=format_latency,
        prefill_request=float(coef[2]), prefill_head=float(coef[3]), decode_knee=knee[0],
        decode_beyond=knee[1], curve_terms=curve_terms,
    )  # fmt: skip


def _fit_mla_format(
    parts: dict, sel: tuple, coef: np.ndarray, knee: tuple, fp: float, fd: float, tokens: bool = True
) -> tuple[float, float, float, float]:
    """Block-scaled FP8's own terms on its training rows, the bf16 terms held: the projections'
    factor, a time per layer on either path (its activation-quantization kernels beside each
    GEMM), per decode, and with ``tokens`` per new token (on the format's own GEMM curve: the
    block's work between its projections that the layer join's activation bytes priced)."""
    c8, g8 = parts[("context", "fp8_block")], parts[("generation", "fp8_block")]
    sel_c, sel_g = sel
    y8 = np.concatenate((c8[3][sel_c], g8[3][sel_g]))
    phases8 = np.concatenate((np.zeros(int(sel_c.sum())), np.ones(int(sel_g.sum()))))
    cols8 = _mla_columns(phases8, np.concatenate((c8[4][sel_c], g8[4][sel_g])), knee)
    fixed8 = cols8 @ coef
    tokens8 = np.concatenate((c8[5][sel_c], g8[5][sel_g])) * tokens
    extra_cols = np.column_stack((np.ones(len(y8)), cols8[:, 4], tokens8))
    best8 = (math.inf, 1.0, np.zeros(3))
    for f8 in np.geomspace(0.1, 1.0, 60):
        pred = np.concatenate((
            c8[0][sel_c] + c8[1][sel_c] / f8 + c8[2][sel_c] / fp,
            g8[0][sel_g] + g8[1][sel_g] / f8 + g8[2][sel_g] / fd,
        )) + fixed8  # fmt: skip
        extra, err = _fixed_terms(pred, y8, extra_cols)
        if err < best8[0]:
            best8 = (err, float(f8), extra)
    return best8[1], float(best8[2][0]), float(best8[2][1]), float(best8[2][2])


def mla_part(tables: dict, console: Console) -> dict:
    """vLLM's MLA block per layer: the cost model as is, then with ``MlaKernel`` fitted on half
    the head counts (both phases, bf16 weights; FP8's projection factor on its own rows) and
    tested on the other half, each row priced by the cost model itself with the fitted kernel."""
    out: dict = {}
    table = Table(
        title="MLA attention block per layer (vLLM, DeepSeek-V3 shapes, bf16 KV): |error| as is, then "
        "held out on half the head counts"
    )
    for col in ("GPU", "phase", "weights", "rows held out", "as is: mean", "fitted: mean / p90 / max",
                "time-weighted", "bias", "fit"):  # fmt: skip
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS or not entry.get("mla_context") or not entry.get("mla_generation"):
            continue
        hw = get_hardware(GPUS[gpu])
        parts: dict = {}
        rows_of: dict = {}
        heads_of: dict = {}
        for phase in ("context", "generation"):
            for table_fmt, weights in MLA_FORMATS.items():
                rows = [r[1:] for r in entry[f"mla_{phase}"] if r[0] == table_fmt and r[4] > 0]
                if rows:
                    parts[(phase, weights)] = _mla_parts(hw, rows, phase, weights)
                    rows_of[(phase, weights)] = rows
                    heads_of[(phase, weights)] = np.array([r[0] for r in rows])
        heads = sorted(set(heads_of[("context", "bf16")]))
        test_heads = heads[1::2]
        test = {k: np.isin(v, test_heads) for k, v in heads_of.items()}
        train = {
            "context": ~test[("context", "bf16")],
            "generation": ~test[("generation", "bf16")],
            "context8": ~test.get(("context", "fp8_block"), np.array([], dtype=bool)),
            "generation8": ~test.get(("generation", "fp8_block"), np.array([], dtype=bool)),
        }
        # block-scaled FP8 also on its own GEMM curve where the GPU has one (the catalog's path)
        curve_hw = replace(hw, mla=NEUTRAL_MLA_CURVE)
        curve_parts = None
        if ("context", "fp8_block") in parts and CostModel(
            _mla_layer(1, "fp8_block"), curve_hw, 1
        ).format_curve:
            curve_parts = {
                (phase, "fp8_block"): _mla_parts(hw, rows_of[(phase, "fp8_block")], phase, "fp8_block", True)
                for phase in ("context", "generation")
            }
        kernel = replace(_fit_mla(parts, train, curve_parts), source=f"{_AISIM_SRC}: MLA module, {GPUS[gpu]}")
        fitted = replace(hw, mla=kernel)
        res: dict = {"fit": {"gemm_factors": dict(kernel.gemm_factors), "prefill_attention": kernel.prefill_attention,
                             "decode_attention": kernel.decode_attention, "prefill_latency_s": kernel.prefill_latency,
                             "decode_latency_s": kernel.decode_latency, "decode_request_s": kernel.decode_request,
                             "decode_head_s": kernel.decode_head, "decode_context_s": kernel.decode_context,
                             "prefill_request_s": kernel.prefill_request, "prefill_head_s": kernel.prefill_head,
                             "decode_knee": kernel.decode_knee, "decode_beyond": kernel.decode_beyond,
                             "decode_request_by_format_s": dict(kernel.decode_request_by_format),
                             "latency_by_format_s": dict(kernel.latency_by_format),
                             "curve_terms": {k: asdict(v) for k, v in kernel.curve_terms}},
                     "version": entry.get("mla_context_version")}  # fmt: skip
        for (phase, weights), (rest, proj, attn, y, _per_request, _tokens) in parts.items():
            rows = [r[1:] for r in entry[f"mla_{phase}"] if r[0] == {v: k for k, v in MLA_FORMATS.items()}[weights]
                    and r[4] > 0]  # fmt: skip
            as_is = rest + proj + attn
            models: dict[int, CostModel] = {}
            pred = []
            for h, batch, length, _ms in rows:
                cm = models.get(h)
                if cm is None:
                    cm = models[h] = CostModel(_mla_layer(h, weights), fitted, 1)
                shape = _mla_shape(phase, batch, length)
                pred.append(
                    _mla_linear(cm, shape.num_tokens) + cm.attention_time(shape) + cm.mla_fixed_time(shape)
                )
            pred_a = np.array(pred)
            t = test[(phase, weights)]
            r = {
                "as_is": stats(as_is, y),
                "held_out": stats(pred_a[t], y[t]),
                "train": stats(pred_a[~t], y[~t]),
            }
            if kernel.curve_terms_for(weights):
                # the layer join's path (a calibrated efficiency, another engine's GEMM set)
                join_hw = replace(fitted, mla=replace(kernel, curve_terms=()))
                pj = []
                for h, batch, length, _ms in rows:
                    cm = CostModel(_mla_layer(h, weights), join_hw, 1)
                    shape = _mla_shape(phase, batch, length)
                    pj.append(
                        _mla_linear(cm, shape.num_tokens)
                        + cm.attention_time(shape)
                        + cm.mla_fixed_time(shape)
                    )
                r["held_out_join_path"] = stats(np.array(pj)[t], y[t])
            res[f"{phase}/{weights}"] = r
            h = r["held_out"]
            table.add_row(
                GPUS[gpu], phase, weights, str(h["n"]), f"{r['as_is']['mean']:.1%}",
                f"{h['mean']:.1%} / {h['p90']:.1%} / {h['max']:.0%}", f"{h['time_weighted']:.1%}",
                f"{h['bias']:+.1%}",
                f"gemm {kernel.gemm_factor(weights):.2f}, attn {kernel.prefill_attention:.2f}/"
                f"{kernel.decode_attention:.2f}, {kernel.prefill_latency * 1e6:.1f}/{kernel.decode_latency * 1e6:.1f}"
                f" (+{kernel.format_latency(weights) * 1e6:.1f}) us"
                f"; per decode {kernel.decode_request * 1e9:.1f} (+{kernel.format_request(weights) * 1e9:.1f} "
                f"{weights}) + {kernel.decode_head * 1e9:.2f}/head ns, "
                f"{kernel.decode_context * 1e12:.0f} ps/context token",
            )  # fmt: skip
        out[gpu] = res
    console.print(table)
    return out


def _fit_link(x: np.ndarray, y: np.ndarray) -> LinkFit:
    """``latency + x / efficiency`` (x: seconds at the full link) by the smallest mean |relative
    error|: a grid over the efficiency, the latency least squares in relative terms for each."""
    best = (math.inf, LinkFit(0.0, 1.0))
    for eff in np.geomspace(0.02, 1.0, 200):  # never faster than the link
        base = x / eff
        w = 1.0 / y
        lat = max(0.0, float(np.sum(w * (1 - base * w)) / np.sum(w * w)))
        err = float(np.mean(np.abs((base + lat) / y - 1)))
        if err < best[0]:
            best = (err, LinkFit(lat, float(eff)))
    return best[1]


def _fit_phase(tokens: np.ndarray, x: np.ndarray, y: np.ndarray) -> LinkFit:
    """A DeepEP phase: ``max(floor, latency + tokens x per_token + x / efficiency)`` (x: seconds
    at the full link) by the smallest mean |relative error|: the floor from a grid of the training
    times' quantiles (and none), for each the three coefficients non-negative least squares in
    relative terms over the rows above it (efficiency at most 1: never faster than the link)."""
    cols = np.column_stack([np.ones_like(x), tokens, x])
    best = (math.inf, LinkFit(0.0, 1.0))
    for floor in np.concatenate(([0.0], np.quantile(y, np.linspace(0.02, 0.6, 30)))):
        above = np.ones(len(y), dtype=bool)
        for _ in range(5):  # the rows above the floor decide the line; refit until they settle
            coef, _ = _fixed_terms(np.zeros(int(above.sum())), y[above], cols[above])
            if coef[2] < 1.0:  # faster than the link: the link at full speed, the rest refitted
                rest, _ = _fixed_terms(x[above], y[above], cols[above][:, :2])
                coef = np.array([rest[0], rest[1], 1.0])
            now = cols @ coef > floor
            if now.sum() < 3 or (now == above).all():
                break
            above = now
        pred = np.maximum(floor, cols @ coef)
        err = float(np.mean(np.abs(pred / y - 1)))
        if err < best[0]:
            best = (err, LinkFit(float(coef[0]), float(1.0 / coef[2]), float(coef[1]), float(floor)))
    return best[1]


def _fit_protocols(x: np.ndarray, y: np.ndarray) -> tuple[LinkFit, ...]:
    """An NCCL collective as the faster of two ``latency + x / efficiency`` lines (NCCL's tuner
    picks a protocol per size: LL's latency, then LL128's or Simple's bandwidth): every split of
    the sizes (at least three on each side) fits a line to each side, the split whose minimum of
    the two has the smallest mean |relative error| wins; one line when that is better."""
    order = np.argsort(x)
    x, y = x[order], y[order]
    one = _fit_link(x, y)
    best = (float(np.mean(np.abs((one.latency + x / one.efficiency) / y - 1))), (one,))
    for j in range(3, len(x) - 2):
        small, large = _fit_link(x[:j], y[:j]), _fit_link(x[j:], y[j:])
        pred = np.minimum(small.latency + x / small.efficiency, large.latency + x / large.efficiency)
        err = float(np.mean(np.abs(pred / y - 1)))
        if err < best[0]:
            best = (err, (small, large))
    return best[1]


def _monotone_floor(tokens: np.ndarray, y: np.ndarray, shape: list) -> np.ndarray:
    """|relative error| of the best curve non-decreasing in tokens fitted to each shape's own rows
    (pool-adjacent-violators on log time): what no model monotone in the tokens can beat, the
    tables' own scatter (a DeepEP low-latency phase's times jump by 20-60% between neighbours)."""
    err = np.zeros(len(y))
    for s_ in set(shape):
        idx = sorted((i for i, v in enumerate(shape) if v == s_), key=lambda i: tokens[i])
        blocks: list[list[float]] = []  # [mean log time, rows]
        for v in np.log(y[idx]):
            blocks.append([float(v), 1.0])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                v2, n2 = blocks.pop()
                blocks[-1] = [
                    (blocks[-1][0] * blocks[-1][1] + v2 * n2) / (blocks[-1][1] + n2),
                    blocks[-1][1] + n2,
                ]
        fitted = np.exp(np.repeat([b[0] for b in blocks], [int(b[1]) for b in blocks]))
        err[idx] = np.abs(fitted / y[idx] - 1)
    return err


# The all-gather / reduce-scatter buffers an MoE layer sends: dp x tokens x hidden elements, from
# 2 x 1 x 2,048 up; the tables go on to 2^28 elements.
MIN_GATHER_ELEMENTS = 2**12


def a2a_part(tables: dict, console: Console) -> dict:
    out: dict = {}
    table = Table(
        title="MoE token exchange: DeepEP dispatch/combine under vLLM (held out: half the model shapes) "
        "and NCCL all-gather/reduce-scatter (held out: every other size)"
    )
    for col in ("GPU", "exchange", "phase", "rows held out", "fitted mean / p90 / max", "bias",
                "monotone floor mean / max", "fit: latency, link eff (DeepEP: per token, floor)"):  # fmt: skip
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS or not entry.get("a2a"):
            continue
        hw = get_hardware(GPUS[gpu])
        link = hw.interconnect_bandwidth
        res: dict = {"version": entry.get("a2a_version"), "nccl_version": entry.get("nccl_version")}
        for backend in ("deepep_ht", "deepep_ll"):
            for phase in ("dispatch", "combine"):
                sel = [r for r in entry["a2a"] if r[0] == backend and r[1] == phase and r[7] > 0]
                if not sel:
                    continue
                x, y, shape, toks = [], [], [], []
                for _, _, ep, hidden, k, experts, tokens, us in sel:
                    if backend == "deepep_ht":
                        moved = tokens * remote_ranks(int(k), int(experts), int(ep)) * hidden * ACT_BYTES
                    else:
                        per_value = FP8_WITH_SCALES if phase == "dispatch" else ACT_BYTES
                        moved = tokens * k * (ep - 1) / ep * hidden * per_value
                    x.append(moved / link)
                    y.append(us * 1e-6)
                    shape.append((hidden, k, experts))
                    toks.append(tokens)
                x_a, y_a, t_a = np.array(x), np.array(y), np.array(toks, dtype=float)
                shapes = sorted(set(shape))
                test = np.array([s_ in set(shapes[1::2]) for s_ in shape])
                fit_ = _fit_phase(t_a[~test], x_a[~test], y_a[~test])
                pred = np.maximum(fit_.floor, fit_.latency + t_a * fit_.per_token + x_a / fit_.efficiency)
                noise = _monotone_floor(t_a, y_a, shape)[test]
                r = {"monotone_floor": {"mean": float(noise.mean()), "max": float(noise.max())},
                     "fit": {"latency_s": fit_.latency, "efficiency": fit_.efficiency,
                             "per_token_s": fit_.per_token, "floor_s": fit_.floor},
                     "held_out": stats(pred[test], y_a[test]), "train": stats(pred[~test], y_a[~test])}  # fmt: skip
                res[f"{backend}/{phase}"] = r
                h = r["held_out"]
                table.add_row(GPUS[gpu], backend, phase, str(h["n"]),
                              f"{h['mean']:.1%} / {h['p90']:.1%} / {h['max']:.0%}", f"{h['bias']:+.1%}",
                              f"{noise.mean():.1%} / {noise.max():.0%}",
                              f"{fit_.latency * 1e6:.1f} us, {fit_.efficiency:.3f}, "
                              f"{fit_.per_token * 1e9:.1f} ns/token, floor {fit_.floor * 1e6:.1f} us")  # fmt: skip
        for op in ("all_gather", "reduce_scatter"):
            for n in sorted({int(r[1]) for r in entry.get("nccl", []) if r[0] == op}):
                sel = sorted(
                    (int(r[2]), float(r[3]) * 1e-3)
                    for r in entry["nccl"]
                    if r[0] == op and int(r[1]) == n and r[2] >= MIN_GATHER_ELEMENTS
                )
                size = np.array([e for e, _ in sel], dtype=float)
                y_a = np.array([v for _, v in sel])
                x_a = (n - 1) / n * size * ACT_BYTES / link
                test = np.arange(len(size)) % 2 == 1
                one = _fit_link(x_a[~test], y_a[~test])
                fits = _fit_protocols(x_a[~test], y_a[~test])
                pred = np.min([f.latency + x_a / f.efficiency for f in fits], axis=0)
                r = {"fit": [{"latency_s": f.latency, "efficiency": f.efficiency} for f in fits],
                     "held_out": stats(pred[test], y_a[test]), "train": stats(pred[~test], y_a[~test]),
                     "one_line_held_out": stats((one.latency + x_a / one.efficiency)[test], y_a[test])}  # fmt: skip
                res[f"{op}/{n}"] = r
                h = r["held_out"]
                table.add_row(GPUS[gpu], f"nccl {op}", f"{n} GPUs", str(h["n"]),
                              f"{h['mean']:.1%} / {h['p90']:.1%} / {h['max']:.0%}", f"{h['bias']:+.1%}", "-",
                              "; ".join(f"{f.latency * 1e6:.1f} us, {f.efficiency:.3f}" for f in fits)
                              + f" (one line: {r['one_line_held_out']['mean']:.1%} / "
                              f"{r['one_line_held_out']['max']:.0%})")  # fmt: skip
        out[gpu] = res
    console.print(table)
    return out


PARTS = ("gemm", "moe", "allreduce", "mla", "a2a")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gpus", default=",".join(GPUS), help="AISimulate system names (default: %(default)s)"
    )
    parser.add_argument("--aisimulate-venv", default=None, help="default: <peers>/aisimulate")
    parser.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/out/fidelity_aisim.json)"
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="the parts to run, their results alone in the JSON (moe runs gemm first; mla alone: ~1 min)",
    )
    parser.add_argument(
        "--framework",
        default="vllm",
        help="the engines whose tables to fit, comma-separated: vllm, trtllm, sglang (default: %(default)s). "
        "The others' GEMM (one-join form, no wave fit) and fused-MoE rows only, each also priced with "
        "vLLM's curves when vllm is in the list; their results under 'frameworks' in the JSON. With more "
        "than vllm, vLLM's GEMMs are fitted in the one-join form only too (the catalog's form; the wave fit "
        "takes minutes)",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(
            f"--parts: unknown {', '.join(sorted(parts - set(PARTS)))}; choose from {', '.join(PARTS)}"
        )
    frameworks = [f for f in args.framework.split(",") if f]
    unknown = [f for f in frameworks if f not in FRAMEWORK_NAMES]
    if unknown or not frameworks:
        parser.error(
            f"--framework: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(FRAMEWORK_NAMES)}"
        )
    console = Console()
    venv = Path(args.aisimulate_venv) if args.aisimulate_venv else peer_venv("aisimulate")
    python = venv / "bin" / "python"
    if not python.exists():
        print(missing_peer("aisimulate", venv), file=sys.stderr)
        return 2
    console.print(cpu_line())
    start = time.time()
    results: dict = {
        "benchmark": "fidelity_aisim",
        "date": time.strftime("%Y-%m-%d"),
        "source": "AISimulate aisimulate==0.13.0.dev202610270000000085 bundled silicon tables",
    }
    # vLLM first: the others' rows are also priced with its curves
    for framework in sorted(frameworks, key=lambda f: f != "vllm"):
        tables = _export(python, args.gpus, framework)
        versions = {
            g: {"gemm": e.get("gemm_version"), "moe": e.get("moe_versions")} for g, e in tables.items()
        }
        console.print(f"AISimulate tables ({FRAMEWORK_NAMES[framework]} versions): {versions}")
        if framework == "vllm":
            results["table_versions"] = versions
            if parts & {"gemm", "moe"}:
                results["gemm"] = gemm_part(tables, console, waves=frameworks == ["vllm"])
            if "moe" in parts:
                results["moe"] = moe_part(tables, results["gemm"], console)
            if "allreduce" in parts:
                results["allreduce"] = allreduce_part(tables, console)
            if "mla" in parts:
                results["mla"] = mla_part(tables, console)
            if "a2a" in parts:
                results["a2a"] = a2a_part(tables, console)
            continue
        res: dict = {"table_versions": versions}
        if parts & {"gemm", "moe"}:
            res["gemm"] = gemm_part(tables, console, framework, results.get("gemm"), waves=False)
            console.print(catalog_lines(res["gemm"], framework))
        if "moe" in parts:
            ref = (results["gemm"], results["moe"]) if "moe" in results else None
            res["moe"] = moe_part(tables, res["gemm"], console, framework, ref)
        results.setdefault("frameworks", {})[framework] = res
    results["wall_s"] = round(time.time() - start, 1)
    save_results(results, args.out, "fidelity_aisim.json")
    return 0


def _export(python: Path, gpus: str, framework: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.json"
        cmd = module_cmd(
            python, "_aisim_tables", "--gpus", gpus, "--framework", framework, "--out", str(rows)
        )
        subprocess.run(cmd, check=True, env=module_env())
        return json.loads(rows.read_text())["gpus"]


def catalog_lines(gemm: dict, framework: str) -> str:
    """The fitted curves in the catalog's form (``hardware.GemmCurve``): the bf16 curve and each
    format's compute and memory efficiency against it, capped at 1 as the catalog's are."""
    lines = [f"{FRAMEWORK_NAMES[framework]} curves in the catalog's form (bf16 curve; format factors):"]
    for gpu, by_fmt in gemm.items():
        base = by_fmt.get("bfloat16", {}).get("fit")
        if base is None:
            continue
        factors = ", ".join(
            f"({FORMATS[fmt]!r}, {min(1.0, r['fit']['compute'] / base['compute']):.2f}, "
            f"{min(1.0, r['fit']['memory'] / base['memory']):.2f})"
            for fmt, r in by_fmt.items()
            if fmt != "bfloat16"
        )
        lines.append(
            f"  {GPUS[gpu]}: GemmCurve({base['compute']:.2f}, {base['memory']:.2f}, {base['sharpness']}, "
            f"{base['tile_m']}, {base['gemm_latency']:.2e}, format_factors=({factors},))"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
