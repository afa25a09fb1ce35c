"""Where the held-out maxima of the catalog's GEMM and fused-MoE prices come from: the error of
the cost model as users get it (``fidelity_aisim.catalog_time``, ``catalog_moe_time``) on the
held-out half of AISimulate's vLLM tables, by row band (GEMM: M and N; MoE: tokens per routed
expert and expert TP), and the worst rows. Same tables and split as ``fidelity_aisim``.

    python -m benchmarks.fidelity_aisim_tails [--gpus h200_sxm,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import cpu_line, missing_peer, peer_venv, save_results
from benchmarks.fidelity_aisim import (
    FORMATS,
    GPUS,
    MODEL_SIZED,
    MOE_FORMATS,
    _export,
    catalog_moe_time,
    catalog_time,
    engine_kernel,
)
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.precision import get_precision

M_BANDS = ((1, 16), (17, 128), (129, 1024), (1025, 8192), (8193, 1 << 30))
N_BANDS = ((1, 512), (513, 2048), (2049, 1 << 30))
# The narrowest model-sized GEMM a catalog model runs at TP 1-8 (Falcon-180B's QKV at TP 8: N
# 1,984); the tables' N <= 512 rows have K = 32,768-65,536, which no layer has.
LAYER_N = 1024
# tokens per touched expert (uniform routing): decode-sized, one tile, many tiles
ROW_BANDS = ((0, 1.5), (1.5, 16), (16, 128), (128, 1e9))


def _bands(err: np.ndarray, x: np.ndarray, bands: tuple) -> list[str]:
    out = []
    for lo, hi in bands:
        sel = (x >= lo) & (x <= hi)
        out.append(f"{np.abs(err[sel]).mean():.1%} / {np.abs(err[sel]).max():.0%}" if sel.any() else "-")
    return out


def gemm_tails(tables: dict, console: Console) -> dict:
    out: dict = {}
    table = Table(title="Catalog GEMM held out (model-sized): mean / max |error| by M and by N, worst rows")
    for col in ("GPU", "format", *(f"M {lo}-{hi if hi < 1 << 29 else ''}" for lo, hi in M_BANDS),
                *(f"N {lo}-{hi if hi < 1 << 29 else ''}" for lo, hi in N_BANDS), f"N >= {LAYER_N}: mean / p90 / max",
                f"worst rows at N >= {LAYER_N}: M x N x K, measured -> priced us"):  # fmt: skip
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS or not entry.get("gemm"):
            continue
        hw = get_hardware(GPUS[gpu])
        for fmt, name in FORMATS.items():
            sel = [r for r in entry["gemm"] if r[0] == fmt and r[4] > 0]
            if not sel or name == "bf16":
                continue
            prec = get_precision(name)
            m, n, k, y = (np.array([r[i] for r in sel], dtype=float) for i in (1, 2, 3, 4))
            y = y * 1e-3
            shapes = sorted({(a, b) for a, b in zip(n, k)})
            test_shapes = set(shapes[1::2])
            held = np.array([(a, b) in test_shapes for a, b in zip(n, k)]) & (n * k >= MODEL_SIZED)
            m, n, k, y = m[held], n[held], k[held], y[held]
            pred = catalog_time(m, n, k, hw, name, prec.bytes, hw.peak_for(prec.compute), True)
            err = pred / y - 1
            layer = n >= LAYER_N
            worst = np.argsort(-np.abs(err) * layer)[:3]
            rows = [(int(m[i]), int(n[i]), int(k[i]), float(y[i] * 1e6), float(pred[i] * 1e6)) for i in worst]
            le = np.abs(err[layer])
            layer_stats = {"mean": float(le.mean()), "p90": float(np.quantile(le, 0.9)), "max": float(le.max()),
                           "n": int(layer.sum())}  # fmt: skip
            out.setdefault(gpu, {})[fmt] = {
                "by_m": _bands(err, m, M_BANDS), "by_n": _bands(err, n, N_BANDS), "worst_layer_like": rows,
                "layer_like": layer_stats, "own_curve": hw.gemm.curve_for(name) is not None,
            }  # fmt: skip
            table.add_row(
                GPUS[gpu], fmt, *_bands(err, m, M_BANDS), *_bands(err, n, N_BANDS),
                f"{layer_stats['mean']:.1%} / {layer_stats['p90']:.1%} / {layer_stats['max']:.0%}",
                "; ".join(f"{a} x {b} x {c}: {t:.0f} -> {p:.0f}" for a, b, c, t, p in rows),
            )  # fmt: skip
    console.print(table)
    return out


def moe_tails(tables: dict, console: Console) -> dict:
    out: dict = {}
    table = Table(
        title="Catalog fused MoE held out: mean / max |error| by routed rows per touched expert and expert TP"
    )
    for col in ("GPU", "format", *(f"rows/expert {lo}-{hi if hi < 1e8 else ''}" for lo, hi in ROW_BANDS),
                "TP 1-4", "TP 8-32", "slice < 128 / >= 128 columns", "worst rows: tokens, hidden x inter, top-k/experts, TP: measured -> priced us"):  # fmt: skip
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS:
            continue
        hw = get_hardware(GPUS[gpu])
        by_fmt: dict = {}
        for r in entry.get("moe", []):
            if r[7] == 1 and r[9] > 0:
                by_fmt.setdefault(r[0], []).append(r)
        for fmt, all_rows in sorted(by_fmt.items()):
            if fmt not in MOE_FORMATS:
                continue
            _, rows = engine_kernel("vllm", gpu, fmt, all_rows)  # the kernel vLLM 0.32 runs
            shape = [(r[2], r[3], r[4], r[5]) for r in rows]
            test_shapes = set(sorted(set(shape))[1::2])
            rows = [r for r, s in zip(rows, shape) if s in test_shapes]
            if not rows:
                continue
            y = np.array([r[9] for r in rows]) * 1e-3
            pred = catalog_moe_time(hw, MOE_FORMATS[fmt][1], rows)
            err = pred / y - 1
            tokens, inter, topk, experts, tp = (
                np.array([r[i] for r in rows], dtype=float) for i in (1, 3, 4, 5, 6)
            )
            width = inter / tp  # each expert's intermediate slice on one GPU
            touched = experts * (1 - (1 - topk / experts) ** tokens)
            per_expert = tokens * topk / touched
            worst = np.argsort(-np.abs(err))[:3]
            wrows = [(int(rows[i][1]), int(rows[i][2]), int(rows[i][3]), int(rows[i][4]), int(rows[i][5]),
                      int(rows[i][6]), float(y[i] * 1e6), float(pred[i] * 1e6)) for i in worst]  # fmt: skip
            out.setdefault(gpu, {})[fmt] = {
                "by_rows_per_expert": _bands(err, per_expert, ROW_BANDS),
                "by_tp": _bands(err, tp, ((1, 4), (8, 32))), "by_slice": _bands(err, width, ((0, 127.9), (128, 1e9))),
                "worst": wrows,
            }  # fmt: skip
            table.add_row(
                GPUS[gpu], fmt, *_bands(err, per_expert, ROW_BANDS), *_bands(err, tp, ((1, 4), (8, 32))),
                " ; ".join(_bands(err, width, ((0, 127.9), (128, 1e9)))),
                "; ".join(f"{a}, {b} x {c}, {d}/{e}, TP {f}: {t:.0f} -> {p:.0f}" for a, b, c, d, e, f, t, p in wrows),
            )  # fmt: skip
    console.print(table)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default=",".join(GPUS))
    parser.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/out/fidelity_aisim_tails.json)"
    )
    args = parser.parse_args()
    python = peer_venv("aisimulate") / "bin" / "python"
    if not python.exists():
        print(missing_peer("aisimulate", python.parent.parent), file=sys.stderr)
        return 2
    console = Console(width=260)
    console.print(cpu_line())
    start = time.time()
    tables = _export(python, args.gpus, "vllm")
    results = {"benchmark": "fidelity_aisim_tails", "date": time.strftime("%Y-%m-%d"),
               "gemm": gemm_tails(tables, console), "moe": moe_tails(tables, console)}  # fmt: skip
    results["wall_s"] = round(time.time() - start, 1)
    save_results(results, args.out, "fidelity_aisim_tails.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
