"""Fused MoE priced from AISimulate's measured tables (``--calibration aisim:FILE``), held out.

For each GPU and experts' format, on the rows ``fidelity_aisim.py``'s MoE part prices (EP 1, the
kernel vLLM runs for the format, ``engine_kernel``; static-scale FP8's kernel; and Hopper block
FP8's expert-parallel kernel at EP 2-64, "@ep"), two splits:

- **tokens**: within each series (model shape, expert TP, EP) the token counts sorted and every
  other one held out (1 and 16,384 stay in training); each held-out row is interpolated from its
  series' training rows (``aisim_moe_table.py``: the roofline fraction in log tokens), beside the
  same in log time (the alternative) and the catalog's fused-MoE curve on the same rows (fitted
  on half the model shapes at every token count, so not held out in tokens);
- **shapes**: the model shapes (hidden, intermediate, top-k, experts) split as the MoE part's
  curve fit splits them (sorted, every other one held out): the table has no series of a held-out
  shape, so every row falls back to the catalog's curve, as the cost model prices it; reported
  with the count the table priced (none) and beside the catalog's curve (the same figure).

    python -m benchmarks.fidelity_aisim_moe_table --rows /tmp/aisim_rows.json [--gpus ...] [--out FILE]

``--rows``: an export of ``benchmarks/_aisim_tables.py`` (else it is exported with AISimulate's
venv, ``scripts/setup-peers.sh aisimulate``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import cpu_line, missing_peer, peer_venv, save_results
from benchmarks.fidelity_aisim import (
    FP8_STATIC_KERNELS,
    GPUS,
    MOE_FORMATS,
    VLLM_MOE_EP_KERNELS,
    _export,
    catalog_moe_time,
    engine_kernel,
    stats,
)
from tailserve.executors.simulated.aisim_moe_table import MoeRows, roofline, series_profile
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.precision import get_precision


def jobs(entry: dict, gpu: str) -> list[tuple[str, str, list]]:
    """(label, format, rows) as ``fidelity_aisim.moe_part`` builds them (vLLM's tables)."""
    by_fmt: dict = {}
    for r in entry.get("moe", []):
        if r[7] == 1 and r[9] > 0:
            by_fmt.setdefault(r[0], []).append(r)
    out = [(fmt, fmt, rows) for fmt, rows in sorted(by_fmt.items())]
    if (gpu, "fp8_static") in FP8_STATIC_KERNELS and "fp8" in by_fmt:
        out.append(("fp8_static", "fp8_static", by_fmt["fp8"]))
    for (g, fmt), kn in VLLM_MOE_EP_KERNELS.items():
        table_fmt = "fp8" if fmt == "fp8_static" else fmt
        ep_rows = [r for r in entry.get("moe", []) if g == gpu and r[0] == table_fmt and r[8] == kn
                   and 1 < r[7] <= 64 and r[6] == 1 and r[5] % r[7] == 0 and r[9] > 0]  # fmt: skip
        if ep_rows:
            out.append((f"{fmt}@ep", fmt, ep_rows))
    return out


def token_split(rows: list, weights: str, hw) -> dict:
    """Every other token count of each series held out: the table's prediction (fraction and
    log time) of each held-out row from its series' training rows."""
    prec = get_precision(weights)
    peak, bw = hw.peak_for(prec.compute), hw.memory_bandwidth
    series = MoeRows.of(rows).series
    (only,) = series.values()  # one format and kernel
    test_rows, fraction, log_time, y = [], [], [], []
    for key, (t, s) in sorted(only.items()):
        if len(t) < 3:
            continue
        train = np.arange(len(t)) % 2 == 0
        profile = series_profile(t[train], s[train], key, peak, bw, prec.bytes)
        held_t = t[~train]
        q = np.interp(np.log(held_t), profile.log_m, profile.fraction)
        fraction.extend(roofline(held_t, key, peak, bw, prec.bytes) / q)
        log_time.extend(np.exp(np.interp(np.log(held_t), np.log(t[train]), np.log(s[train]))))
        y.extend(s[~train])
        test_rows.extend((held_t, key) for held_t in held_t)
    return {
        "fraction": np.array(fraction),
        "log_time": np.array(log_time),
        "y": np.array(y),
        "rows": test_rows,
    }


def held_out(gpu: str, label: str, weights: str, rows: list) -> dict:
    """One GPU and format: both splits."""
    hw = get_hardware(GPUS[gpu])
    expert_parallel = label.endswith("@ep")
    split = token_split(rows, weights, hw)
    y = split["y"]
    # the held-out rows in the export's form, for the catalog (its _experts on a one-layer model)
    as_rows = [[None, t, *key[:4], key[4], key[5], None, 0.0] for t, key in split["rows"]]
    catalog = catalog_moe_time(hw, weights, as_rows, expert_parallel)
    res: dict = {
        "rows": len(rows),
        "series": len({tuple(r[2:8]) for r in rows}),
        "tokens": {
            "held_out_rows": len(y),
            "table": stats(split["fraction"], y),
            "table_log_time": stats(split["log_time"], y),
            "catalog": stats(catalog, y),
        },
    }
    shapes = sorted({tuple(r[2:6]) for r in rows})
    test_shapes = set(shapes[1::2])
    test = [r for r in rows if tuple(r[2:6]) in test_shapes]
    if test:
        train_series = {tuple(r[2:8]) for r in rows if tuple(r[2:6]) not in test_shapes}
        priced = sum(tuple(r[2:8]) in train_series for r in test)  # a held-out shape's own series
        ty = np.array([r[9] * 1e-3 for r in test])
        cat = catalog_moe_time(hw, weights, test, expert_parallel)
        res["shapes"] = {
            "held_out_shapes": len(test_shapes),
            "held_out_rows": len(test),
            "priced_by_table": priced,
            "fell_back": len(test) - priced,
            "table_with_fallback": stats(cat, ty),
            "catalog": stats(cat, ty),
        }
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=None, help="an export of benchmarks/_aisim_tables.py")
    parser.add_argument(
        "--gpus", default=",".join(GPUS), help="AISimulate system names (default: %(default)s)"
    )
    parser.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/out/fidelity_aisim_moe_table.json)"
    )
    args = parser.parse_args()
    console = Console(width=200)
    gpus = [g for g in args.gpus.split(",") if g]
    if args.rows:
        body = json.loads(Path(args.rows).read_text())
    else:
        python = peer_venv("aisimulate") / "bin" / "python"
        if not python.exists():
            print(missing_peer("aisimulate", peer_venv("aisimulate")), file=sys.stderr)
            return 2
        body = {"framework": "vllm", "gpus": _export(python, ",".join(gpus), "vllm")}
    if body.get("framework", "vllm") != "vllm":
        print("fidelity_aisim_moe_table: vLLM's tables only (the catalog's MoE curves were fitted on them)",
              file=sys.stderr)  # fmt: skip
        return 2
    tables = body["gpus"]
    console.print(cpu_line())
    console.print(
        f"load average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    start = time.time()
    results: dict = {
        "benchmark": "fidelity_aisim_moe_table",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.fidelity_aisim_moe_table " + " ".join(sys.argv[1:]),
        "load_average": os.getloadavg()[0],
        "table_versions": {g: tables[g].get("moe_versions") for g in gpus if g in tables},
        "moe": {},
    }
    table = Table(
        title="Fused MoE held out (vLLM's kernels): (a) every other token count of each series, "
        "(b) half the model shapes; AISimulate's table interpolated vs the catalog's curve on the same rows"
    )
    for col in ("GPU", "format", "kernel", "series", "(a) rows", "table: mean / p90 / max", "time-weighted",
                "log time: mean / max", "catalog: mean / p90 / max / tw", "(b) rows priced / held out",
                "with fallback = catalog: mean / max"):  # fmt: skip
        table.add_column(col)
    for gpu in gpus:
        entry = tables.get(gpu) or {}
        if gpu not in GPUS or not entry.get("moe"):
            continue
        for label, fmt, all_rows in jobs(entry, gpu):
            if fmt not in MOE_FORMATS:
                continue
            weights = MOE_FORMATS[fmt][1]
            kernel, rows = engine_kernel("vllm", gpu, fmt, all_rows, label.endswith("@ep"))
            if fmt == "fp8_static" and not kernel.startswith("vllm_modelopt"):
                continue
            res = held_out(gpu, label, weights, rows)
            res["kernel"] = kernel
            results["moe"].setdefault(gpu, {})[label] = res
            a, lt, c = res["tokens"]["table"], res["tokens"]["table_log_time"], res["tokens"]["catalog"]
            b = res.get("shapes")
            table.add_row(
                GPUS[gpu], label, kernel.removeprefix("vllm_"), str(res["series"]), str(a["n"]),
                f"{a['mean']:.1%} / {a['p90']:.1%} / {a['max']:.0%}", f"{a['time_weighted']:.1%}",
                f"{lt['mean']:.1%} / {lt['max']:.0%}",
                f"{c['mean']:.1%} / {c['p90']:.1%} / {c['max']:.0%} / {c['time_weighted']:.1%}",
                f"{b['priced_by_table']} / {b['held_out_rows']}" if b else "-",
                f"{b['table_with_fallback']['mean']:.1%} / {b['table_with_fallback']['max']:.0%}" if b else "-",
            )  # fmt: skip
    console.print(table)
    results["wall_s"] = round(time.time() - start, 1)
    save_results(results, args.out, "fidelity_aisim_moe_table.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
