"""GEMMs priced from AISimulate's measured tables (``--calibration aisim:FILE``), held out.

For each GPU and format, the (N, K) weight shapes are split in half as ``fidelity_aisim.py``'s
curve fits split them (sorted, every other one held out); each held-out shape is interpolated
from the training half's rows alone (``aisim_table.py``: the roofline fraction in log M within a
shape, log K within an N, then log N) and compared with its measured times at every M. Reported
on model-sized weights (N x K >= 2^24) beside, on the same split, the waves + quantization curve
fitted to the training half (``fidelity_aisim.fit_waves``) and the catalog's curve as it is (fitted
to all shapes, so not held out). Held-out shapes that no training shapes surround are counted,
and priced on the catalog's curve in the "with fallback" figure, as the cost model prices them.
The interpolation's choices (the roofline fraction or log time; K within a measured N, then N, or
the other way round) are scored on the same rows, the evidence for the one ``aisim_table.py`` takes.

    python -m benchmarks.fidelity_aisim_table [--rows rows.json] [--gpus ...] [--no-waves] [--out FILE]

``--rows``: an export of ``benchmarks/_aisim_tables.py`` (else it is exported with AISimulate's
venv, ``scripts/setup-peers.sh aisimulate``).
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

from benchmarks._common import missing_peer, peer_venv, run_stamp, save_results
from benchmarks.fidelity_aisim import (
    FORMATS,
    GPUS,
    QUANT_BYTES,
    _export,
    catalog_time,
    fit_waves,
    stats,
    wave_parts,
    wave_time,
)
from tailserve.executors.simulated.aisim_table import (
    ACT_BYTES,
    FormatRows,
    Profile,
    catalog_curve,
    format_rows,
)
from tailserve.executors.simulated.gemm import curve_gemm_time
from tailserve.executors.simulated.gemm_table import MODEL_SIZED
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.precision import get_precision


def log_time_rows(table: FormatRows) -> FormatRows:
    """``table`` with each profile holding log seconds instead of the roofline fraction: the same
    neighbours blended the same way, in log time (the alternative the quantity was chosen over)."""
    shapes = {}
    for (n, k), p in table.shapes.items():
        shapes[(n, k)] = Profile(p.log_m, np.log(table.roofline(np.exp(p.log_m), n, k) / p.fraction))
    return replace(table, shapes=shapes)


def variants(name: str, train: np.ndarray, hw, m, n, k, y, inside: np.ndarray) -> dict:
    """Held-out mean |error| on the rows ``inside`` of each interpolation choice: the roofline
    fraction or log time, K within a measured N then N (as ``aisim_table.py``) or N within a
    measured K then K (the rows transposed: the roofline is symmetric in N and K)."""
    out = {}
    for order, rows in (("k_within_n", train), ("n_within_k", train[:, [0, 2, 1, 3]])):
        table = format_rows(name, rows, hw)
        for quantity, t in (("fraction", table), ("log_time", log_time_rows(table))):
            pred = np.full(len(y), np.nan)
            for shape in sorted({(x, z) for x, z in zip(n[inside], k[inside])}):
                sel = inside & (n == shape[0]) & (k == shape[1])
                a, b = shape if order == "k_within_n" else shape[::-1]
                profile = t.profile(a, b)
                if profile is None:
                    continue
                q = np.interp(np.log(m[sel]), profile.log_m, profile.fraction)
                pred[sel] = t.roofline(m[sel], a, b) / q if quantity == "fraction" else np.exp(q)
            ok = inside & ~np.isnan(pred)
            out[f"{quantity}, {order}"] = {
                "mean": float(np.mean(np.abs(pred[ok] / y[ok] - 1))),
                "n": int(ok.sum()),
            }
    return out


def held_out(gpu: str, fmt: str, rows: list, waves: bool) -> dict | None:
    """One GPU and format: the table's held-out error, and the curves' on the same split."""
    sel = [r for r in rows if r[0] == fmt and r[4] > 0]
    if not sel:
        return None
    hw = get_hardware(GPUS[gpu])
    name = FORMATS[fmt]
    prec = get_precision(name)
    peak = hw.peak_for(prec.compute)
    a = np.array([r[1:] for r in sel], dtype=float)
    a[:, 3] *= 1e-3  # milliseconds
    m, n, k, y = a.T
    shapes = sorted({(x, z) for x, z in zip(n, k)})
    test_shapes = set(shapes[1::2])
    test = np.array([(x, z) in test_shapes for x, z in zip(n, k)])
    sized = n * k >= MODEL_SIZED
    held = test & sized
    table = format_rows(name, a[~test], hw)  # the training half, every size
    pred = np.full(len(y), np.nan)
    outside = set()
    for shape in sorted({(x, z) for x, z in zip(n[held], k[held])}):
        rows_of = held & (n == shape[0]) & (k == shape[1])
        profile = table.profile(*shape)
        if profile is None:
            outside.add(shape)
            pred[rows_of] = curve_gemm_time(
                m[rows_of], shape[0], shape[1], catalog_curve(hw, name), peak, hw.memory_bandwidth, hw.sms,
                prec.bytes, ACT_BYTES,
            )  # fmt: skip
        else:
            pred[rows_of] = table.seconds(m[rows_of], shape[0], shape[1], profile)
    inside = held & ~np.array([(x, z) in outside for x, z in zip(n, k)])
    res: dict = {
        "held_out_shapes": len({s for s in test_shapes if s[0] * s[1] >= MODEL_SIZED}),
        "outside_shapes": len(outside),
        "table_held_out": stats(pred[inside], y[inside]),
        "table_with_fallback": stats(pred[held], y[held]),
    }
    res["variants"] = variants(name, a[~test], hw, m, n, k, y, inside)
    catalog = catalog_time(m, n, k, hw, name, prec.bytes, peak, own=True)
    res["catalog"] = stats(catalog[held], y[held])
    res["catalog_inside"] = stats(catalog[inside], y[inside])
    if waves:
        train = ~test & sized
        q = QUANT_BYTES[fmt]
        wfit = fit_waves(
            m[train], n[train], k[train], y[train], prec.bytes, peak, hw, (0.0, q) if q else (0.0,)
        )
        parts = wave_parts(m, n, k, prec.bytes, peak, hw, wfit["tile_m"], wfit["tile_n"], wfit["wave_alpha"],
                           wfit["quant_bytes"])  # fmt: skip
        wpred = wave_time(parts, wfit["compute"], wfit["memory"], wfit["sharpness"], wfit["gemm_latency"])
        res["waves_fit"] = wfit
        res["waves_held_out"] = stats(wpred[held], y[held])
        res["waves_inside"] = stats(wpred[inside], y[inside])
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=None, help="an export of benchmarks/_aisim_tables.py")
    parser.add_argument(
        "--gpus", default=",".join(GPUS), help="AISimulate system names (default: %(default)s)"
    )
    parser.add_argument("--no-waves", action="store_true", help="skip the waves + quant fit (minutes)")
    parser.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/out/fidelity_aisim_table.json)"
    )
    args = parser.parse_args()
    console = Console(width=180)  # the table's nine columns
    gpus = [g for g in args.gpus.split(",") if g]
    if args.rows:
        tables = json.loads(Path(args.rows).read_text())["gpus"]
    else:
        python = peer_venv("aisimulate") / "bin" / "python"
        if not python.exists():
            print(missing_peer("aisimulate", peer_venv("aisimulate")), file=sys.stderr)
            return 2
        tables = _export(python, ",".join(gpus), "vllm")
    start = time.time()
    results: dict = {
        **run_stamp("fidelity_aisim_table", console.print),
        "table_versions": {g: tables[g].get("gemm_version") for g in gpus if g in tables},
        "gemm": {},
    }
    table = Table(
        title="GEMM held out, model-sized weights (N x K >= 2^24; half the (N, K) shapes held out): "
        "AISimulate's table interpolated vs the waves + quant curve fitted on the same half"
    )
    for col in ("GPU", "format", "shapes in / held out", "table: mean / p90 / max", "time-weighted",
                "with fallback: mean / tw", "waves + quant: mean / p90 / max", "time-weighted ",
                "catalog: mean / tw"):  # fmt: skip
        table.add_column(col)
    for gpu in gpus:
        entry = tables.get(gpu) or {}
        if gpu not in GPUS or not entry.get("gemm"):
            continue
        for fmt in FORMATS:
            res = held_out(gpu, fmt, entry["gemm"], not args.no_waves)
            if res is None:
                continue
            results["gemm"].setdefault(gpu, {})[fmt] = res
            t, f, c = res["table_held_out"], res["table_with_fallback"], res["catalog"]
            w = res.get("waves_held_out")
            table.add_row(
                GPUS[gpu], fmt,
                f"{res['held_out_shapes'] - res['outside_shapes']} / {res['held_out_shapes']}",
                f"{t['mean']:.1%} / {t['p90']:.1%} / {t['max']:.0%}", f"{t['time_weighted']:.1%}",
                f"{f['mean']:.1%} / {f['time_weighted']:.1%}",
                f"{w['mean']:.1%} / {w['p90']:.1%} / {w['max']:.0%}" if w else "-",
                f"{w['time_weighted']:.1%}" if w else "-",
                f"{c['mean']:.1%} / {c['time_weighted']:.1%}",
            )  # fmt: skip
            console.print(
                f"{GPUS[gpu]} {fmt}: table {t['mean']:.1%}" + (f", waves {w['mean']:.1%}" if w else "")
            )
    console.print(table)
    chosen = "fraction, k_within_n"
    beaten = [
        f"{GPUS[g]} {f}: {min(r['variants'], key=lambda v: r['variants'][v]['mean'])}"
        for g, by in results["gemm"].items()
        for f, r in by.items()
        if min(v["mean"] for v in r["variants"].values()) < r["variants"][chosen]["mean"]
    ]
    results["variants_better_than_chosen"] = beaten
    console.print(
        f"interpolation choices (held-out mean on the rows inside): {chosen} beaten on {len(beaten)} of "
        f"{sum(len(by) for by in results['gemm'].values())} pairs: {'; '.join(beaten) or 'none'}"
    )
    results["wall_s"] = round(time.time() - start, 1)
    save_results(results, args.out, "fidelity_aisim_table.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
