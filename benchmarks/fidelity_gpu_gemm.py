"""The catalog's GEMM prices against GEMMs measured on a real GPU by ``scripts/gpu_gemm.py``.

The catalog's H200 curves (``hardware.H200``: bf16 and its FP8 format curve) were fitted to
AISimulate's tables of vLLM's kernels (``benchmarks/fidelity_aisim.py``); the GEMMs here were
measured on a lent H200 with PyTorch's kernels and never fitted to: every row is held out. Per
format, the catalog's |error| (mean / p90 / max, time-weighted, signed bias) on model-sized
weights (N x K >= 2^24, as ``fidelity_aisim``) and on every measured shape; AISimulate's own
table against the same measurement where it has the row (the tables' machine and library
against this one); the catalog's one-join GEMM form refitted two ways, as a bound on what a
curve of that form can do here: to AISimulate's rows of the format (then tested on the
measurement) and to half the measured (N, K) shapes (tested on the other half); and the
measurement's own repeatability (two runs on two machine starts, the rows both timed).

``--layers``: the catalog models' own layers (``gpu_gemm.py --models``: each model's QKV, output,
gate+up and down GEMMs on a TP 1/2/4/8 shard), measured as the sum of the four, against what the
cost model prices a layer's GEMMs at (``CostModel.linear_time`` / layers, no LM head) with the
catalog's curve and with ``--calibration gemm:`` fitted to the first file (the grid's shapes:
mostly other shapes, another machine start). bf16, and FP8 (``--quantization fp8``) against the
rowwise kernel's rows.

Formats: ``bf16`` is ``F.linear`` (cuBLAS), vLLM's kernel for unquantized weights, so the three
meet on the same kernel family; ``fp8`` is cuBLASLt's per-tensor FP8 GEMM and ``fp8_row``
PyTorch's CUTLASS rowwise kernel, both beside vLLM's CUTLASS ``scaled_mm`` that the catalog's FP8
curve and AISimulate's ``fp8`` rows price (same arithmetic, another library's kernels).

    python -m benchmarks.fidelity_gpu_gemm [--measured FILE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import peer_venv, save_results
from benchmarks.fidelity_aisim import MODEL_SIZED, _curve, _export, catalog_time, fit, gemm_time, stats
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.gemm import gemm_shapes
from tailserve.executors.simulated.gemm_table import calibrated_hardware, load_gemm_table
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.precision import get_precision

RESULTS = Path(__file__).parent / "results"
MEASURED = (RESULTS / "gpu_gemm_h200_dense_r42.json", RESULTS / "gpu_gemm_h200_r42.json")
LAYERS = RESULTS / "gpu_gemm_h200_models_r42.json"
SAME_START = (RESULTS / "gpu_gemm_h200_grid_1_r42.json", RESULTS / "gpu_gemm_h200_grid_2_r42.json")
# measured format -> (the catalog's format, AISimulate's format)
FORMATS = {"bf16": ("bf16", "bfloat16"), "fp8": ("fp8", "fp8"), "fp8_row": ("fp8", "fp8")}
GPU_NAMES = {"NVIDIA H200": ("H200", "h200_sxm"), "NVIDIA H100 80GB HBM3": ("H100-SXM", "h100_sxm")}


def load(path: Path) -> tuple[dict, dict]:
    """A gpu_gemm run: its header and {(format, m, n, k): seconds}."""
    d = json.loads(path.read_text())
    return d, {(r[0], r[1], r[2], r[3]): r[4] for r in d["rows"] if r[0] != "quant"}


def _fmt(s: dict) -> str:
    return f"{s['mean']:.1%} / {s['p90']:.1%} / {s['max']:.0%}"


def compare(measured: dict, hw_name: str, aisim: dict | None) -> dict:
    hw = get_hardware(hw_name)
    out: dict = {}
    for fmt, (ours, theirs) in FORMATS.items():
        keys = sorted(k for k in measured if k[0] == fmt)
        if not keys:
            continue
        m, n, k = (np.array([key[i] for key in keys], dtype=float) for i in (1, 2, 3))
        y = np.array([measured[key] for key in keys])
        prec = get_precision(ours)
        pred = catalog_time(m, n, k, hw, prec.name, prec.bytes, hw.peak_for(prec.compute), own=True)
        sized = n * k >= MODEL_SIZED
        res = {
            "rows": len(keys),
            "catalog_model_sized": stats(pred[sized], y[sized]),
            "catalog_all": stats(pred, y),
        }
        by_m = {}
        for lo, hi, label in (
            (1, 16, "1-16"),
            (17, 256, "17-256"),
            (257, 2048, "257-2048"),
            (2049, 1e9, ">2048"),
        ):
            sel = sized & (m >= lo) & (m <= hi)
            if sel.any():
                by_m[label] = stats(pred[sel], y[sel])
        res["catalog_by_tokens"] = by_m
        peak = hw.peak_for(prec.compute)
        shapes = sorted({(a, b) for a, b in zip(n[sized], k[sized])})
        test = sized & np.array([(a, b) in set(shapes[1::2]) for a, b in zip(n, k)])
        train = sized & ~test
        own = fit(m[train], n[train], k[train], y[train], prec.bytes, peak, hw)
        pred_own = gemm_time(m[test], n[test], k[test], prec.bytes, peak, hw, **_curve(own))
        res["own_half_fit"] = {**stats(pred_own, y[test]), "curve": _jsonable(_curve(own))}
        if aisim is not None:
            rows = {(r[1], r[2], r[3]): r[4] * 1e-3 for r in aisim["gemm"] if r[0] == theirs}
            have = np.array([(key[1], key[2], key[3]) in rows for key in keys])
            if have.any():
                a = np.array([rows[(key[1], key[2], key[3])] for key, h in zip(keys, have) if h])
                res["aisim_rows"] = int(have.sum())
                res["aisim_vs_measured"] = stats(a[sized[have]], y[have][sized[have]])
                res["catalog_vs_aisim"] = stats(pred[have][sized[have]], a[sized[have]])
            t = np.array([r[1:5] for r in aisim["gemm"] if r[0] == theirs and r[4] > 0], dtype=float)
            t = t[t[:, 1] * t[:, 2] >= MODEL_SIZED]
            curve = fit(t[:, 0], t[:, 1], t[:, 2], t[:, 3] * 1e-3, prec.bytes, peak, hw)
            pred_a = gemm_time(m[sized], n[sized], k[sized], prec.bytes, peak, hw, **_curve(curve))
            res["aisim_fit"] = {**stats(pred_a, y[sized]), "curve": _jsonable(_curve(curve))}
        out[fmt] = res
    return out


def _jsonable(curve: dict) -> dict:
    return {k: (float(v) if v != float("inf") else "inf") for k, v in curve.items()}


def repeatability(a: dict, b: dict) -> dict:
    both = sorted(set(a) & set(b))
    out = {}
    for fmt in FORMATS:
        keys = [k for k in both if k[0] == fmt]
        if keys:
            r = np.array([a[k] / b[k] - 1 for k in keys])
            out[fmt] = {"rows": len(keys), "median": float(np.median(np.abs(r))),
                        "p90": float(np.quantile(np.abs(r), 0.9)), "max": float(np.max(np.abs(r)))}  # fmt: skip
    return out


def layers(path: Path, fitted_on: Path, hw_name: str) -> dict:
    """Each model / TP / format whose four layer GEMMs were all measured: measured layer time
    (their sum) per token count against the cost model's, catalog and gemm-calibrated."""
    head, measured = load(path)
    hw = get_hardware(hw_name)
    calibrated, _ = calibrated_hardware(load_gemm_table(fitted_on), hw)
    out: dict = {}
    for fmt, kernel in (("bf16", "bf16"), ("fp8", "fp8_row")):
        rows: dict[str, list] = {"catalog": [], "gemm": [], "measured": []}
        per_model = {}
        for name in head["models"].split(","):
            spec = get_model(name)
            if fmt != "bf16":
                spec = replace(spec, weight_dtype=fmt)
            for tp in (int(t) for t in head["tps"].split(",")):
                q, kv = (
                    spec.num_heads * spec.dim_per_head / tp,
                    spec.kv_heads_per_shard(tp) * spec.dim_per_head,
                )
                shapes = [
                    (int(n), int(k))
                    for n, k in gemm_shapes(
                        spec.hidden_size, q, kv, spec.intermediate_size / tp, spec.gated_mlp
                    )
                ]
                ms = sorted(
                    {key[1] for key in measured if key[0] == kernel and (key[2], key[3]) == shapes[0]}
                )
                ms = [m for m in ms if all((kernel, m, n, k) in measured for n, k in shapes)]
                if not ms:
                    continue
                models = {"catalog": CostModel(spec, hw, tp), "gemm": CostModel(spec, calibrated, tp)}
                y = np.array([sum(measured[(kernel, m, n, k)] for n, k in shapes) for m in ms])
                preds = {
                    key: np.array([cm.linear_time(m) / spec.num_layers for m in ms])
                    for key, cm in models.items()
                }
                per_model[f"{name} TP {tp}"] = {key: stats(p, y) for key, p in preds.items()}
                for key, p in preds.items():
                    rows[key].append(p)
                rows["measured"].append(y)
        if not per_model:
            continue
        y = np.concatenate(rows["measured"])
        out[fmt] = {"layers": len(per_model), "rows": len(y),
                    **{key: stats(np.concatenate(rows[key]), y) for key in ("catalog", "gemm")},
                    "per_layer": per_model}  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measured", nargs="+", type=Path, default=list(MEASURED),
                   help="gpu_gemm.py results; the first is compared, the second (if any) checks repeatability")  # fmt: skip
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/out/fidelity_gpu_gemm.json)")
    p.add_argument("--same-start", nargs=2, type=Path, default=list(SAME_START),
                   help="two runs on one machine start: their repeatability (default: the r42 pair)")  # fmt: skip
    p.add_argument(
        "--layers", type=Path, default=LAYERS, help="gpu_gemm.py --models results (default: %(default)s)"
    )
    args = p.parse_args()
    missing = [str(f) for f in args.measured if not f.exists()]
    if missing:
        print(
            f"fidelity_gpu_gemm: error: no such file: {missing[0]} (scripts/gpu_gemm.py writes one)",
            file=sys.stderr,
        )
        return 2
    console = Console()
    head, measured = load(args.measured[0])
    if head["gpu"] not in GPU_NAMES:
        print(f"fidelity_gpu_gemm: error: no catalog entry for {head['gpu']!r}", file=sys.stderr)
        return 2
    hw_name, aisim_name = GPU_NAMES[head["gpu"]]
    python = peer_venv("aisimulate") / "bin" / "python"
    aisim = _export(python, aisim_name, "vllm").get(aisim_name) if python.exists() else None
    if aisim is None:
        console.print(
            "AISimulate's venv is absent (scripts/setup-peers.sh aisimulate): its column is left out"
        )
    console.print(f"{head['gpu']}: {head['sms']} SMs, torch {head['torch']}, CUDA {head['cuda']}; "
                  f"measured ceilings: bf16 {head['bf16_8192_tflops']} TFLOP/s, copy {head['copy_tb_s']} TB/s; "
                  f"{len(measured):,} GEMMs ({head['method']})")  # fmt: skip
    res = compare(measured, hw_name, aisim)
    table = Table(title=f"The catalog's {hw_name} GEMM prices vs GEMMs measured on an {hw_name} (all held out): "
                  "|error| mean / p90 / max")  # fmt: skip
    for col in ("format", "rows", "catalog, N x K >= 2^24", "time-weighted", "bias", "catalog, every shape",
                "AISimulate's table vs measured", "catalog vs AISimulate"):  # fmt: skip
        table.add_column(col)
    for fmt, r in res.items():
        c = r["catalog_model_sized"]
        table.add_row(
            fmt, f"{r['rows']:,}", _fmt(c), f"{c['time_weighted']:.1%}", f"{c['bias']:+.1%}", _fmt(r["catalog_all"]),
            _fmt(r["aisim_vs_measured"]) + f" ({r['aisim_rows']:,} rows; bias {r['aisim_vs_measured']['bias']:+.1%})"
            if "aisim_vs_measured" in r else "-",
            _fmt(r["catalog_vs_aisim"]) if "catalog_vs_aisim" in r else "-",
        )  # fmt: skip
    console.print(table)
    by = Table(title="The catalog's |error| by token count (N x K >= 2^24): mean / p90 / max, bias")
    by.add_column("format")
    labels = ("1-16", "17-256", "257-2048", ">2048")
    for label in labels:
        by.add_column(f"M {label}")
    for fmt, r in res.items():
        by.add_row(fmt, *(f"{_fmt(r['catalog_by_tokens'][x])}, {r['catalog_by_tokens'][x]['bias']:+.0%}"
                          if x in r["catalog_by_tokens"] else "-" for x in labels))  # fmt: skip
    console.print(by)
    fits = Table(title="A one-join curve refitted (N x K >= 2^24): |error| mean / p90 / max, time-weighted")
    for col in (
        "format",
        "catalog (as above)",
        "fitted to AISimulate's table",
        "fitted to half the measured shapes, held out",
    ):
        fits.add_column(col)
    for fmt, r in res.items():
        cells = [f"{_fmt(r['catalog_model_sized'])}, {r['catalog_model_sized']['time_weighted']:.1%}"]
        for key in ("aisim_fit", "own_half_fit"):
            cells.append(f"{_fmt(r[key])}, {r[key]['time_weighted']:.1%}" if key in r else "-")
        fits.add_row(fmt, *cells)
    console.print(fits)
    results = {"benchmark": "fidelity_gpu_gemm", "date": time.strftime("%Y-%m-%d"),
               "measured": [str(f) for f in args.measured], "gpu": head["gpu"], "hardware": hw_name,
               "header": {k: v for k, v in head.items() if k != "rows"}, "formats": res}  # fmt: skip
    if len(args.measured) > 1:
        rep = repeatability(measured, load(args.measured[1])[1])
        results["repeatability"] = rep
        console.print("Repeatability (the same GEMMs in two runs on two machine starts), |ratio - 1| median / p90 / max: "
                      + "; ".join(f"{f} {v['median']:.1%} / {v['p90']:.1%} / {v['max']:.0%} ({v['rows']} rows)"
                                  for f, v in rep.items()))  # fmt: skip
    if all(f.exists() for f in args.same_start):
        same = repeatability(load(args.same_start[0])[1], load(args.same_start[1])[1])
        results["repeatability_same_start"] = same
        console.print("Repeatability on one machine start (two runs back to back): "
                      + "; ".join(f"{f} {v['median']:.1%} / {v['p90']:.1%} / {v['max']:.0%} ({v['rows']} rows)"
                                  for f, v in same.items()))  # fmt: skip
    if args.layers.exists():
        lay = layers(args.layers, args.measured[0], hw_name)
        results["layers"] = {"file": str(args.layers), **lay}
        t = Table(title=f"The catalog models' layers (sum of the four GEMMs on a TP shard) measured on the {hw_name}: "
                  "|error| mean / p90 / max, time-weighted, bias")  # fmt: skip
        for col in (
            "format",
            "layers x token counts",
            "catalog",
            f"--calibration gemm:{args.measured[0].name}",
        ):
            t.add_column(col)
        for fmt, r in lay.items():
            t.add_row(fmt, f"{r['layers']} x {r['rows'] // r['layers']}",
                      *(f"{_fmt(r[key])}, {r[key]['time_weighted']:.1%}, {r[key]['bias']:+.1%}" for key in ("catalog", "gemm")))  # fmt: skip
        console.print(t)
    save_results(results, args.out, "fidelity_gpu_gemm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
