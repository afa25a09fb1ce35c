"""Fused MoE priced from AISimulate's measured tables (``--calibration aisim:FILE``), held out.

For each GPU and experts' format, on the rows ``fidelity_aisim.py``'s MoE part prices (EP 1, the
kernel vLLM runs for the format, ``engine_kernel``; static-scale FP8's kernel; and Hopper block
FP8's expert-parallel kernel at EP 2-64, "@ep"), two splits:

- **tokens**: within each series (model shape, expert TP, EP) the token counts sorted and every
  other one held out (1 and 16,384 stay in training); each held-out row is interpolated from its
  series' training rows (``aisim_moe_table.py``: log time in log tokens), beside the roofline
  fraction in log tokens (the GEMM tables' quantity, the alternative), the tables' own scatter
  (the best time non-decreasing in tokens, ``fidelity_aisim._monotone_floor``) and the catalog's
  fused-MoE curve on the same rows (fitted on half the model shapes at every token count, so not
  held out in tokens);
- **shapes**: the model shapes (hidden, intermediate, top-k, experts) split as the MoE part's
  curve fit splits them (sorted, every other one held out): the table has no series of a held-out
  shape, so every row falls back to the catalog's curve, as the cost model prices it; reported
  with the count the table priced (none), and beside a way across shapes tried and not taken
  (the nearest training shape's measured / catalog ratio, ``nearest_shape_ratio``).

Pairs whose vLLM kernel the tables lack (the cost model keeps the catalog's curve there) are left
out and listed under ``left_out``.

    python -m benchmarks.fidelity_aisim_moe_table --rows /tmp/aisim_rows.json [--gpus ...] [--out FILE]

``--rows``: an export of ``benchmarks/_aisim_tables.py`` (else it is exported with AISimulate's
venv, ``scripts/setup-peers.sh aisimulate``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import missing_peer, peer_venv, run_stamp, save_results
from benchmarks.fidelity_aisim import (
    FP8_STATIC_KERNELS,
    GPUS,
    MOE_FORMATS,
    VLLM_MOE_EP_KERNELS,
    _export,
    _monotone_floor,
    catalog_moe_time,
    engine_kernel,
    stats,
)
from tailserve.executors.simulated.aisim_moe_table import MoeRows, MoeTable, roofline
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
    """Every other token count of each series held out: each held-out row priced by
    ``MoeTable`` on its series' training rows (log time), and by the roofline fraction
    interpolated in log tokens (the GEMM tables' quantity, the alternative not taken)."""
    prec = get_precision(weights)
    peak, bw = hw.peak_for(prec.compute), hw.memory_bandwidth
    (only,) = MoeRows.of(rows).series.values()  # one format and kernel
    test_rows, table, fraction, y = [], [], [], []
    for key, (t, s) in sorted(only.items()):
        if len(t) < 3:
            continue
        train = np.arange(len(t)) % 2 == 0
        priced = MoeTable(key, weights, "", np.log(t[train]), np.log(s[train]), peak, bw, prec.bytes)
        held_t = t[~train]
        table.extend(priced.seconds(int(x)) for x in held_t)
        q = np.interp(
            np.log(held_t), np.log(t[train]), roofline(t[train], key, peak, bw, prec.bytes) / s[train]
        )
        fraction.extend(roofline(held_t, key, peak, bw, prec.bytes) / q)
        y.extend(s[~train])
        test_rows.extend((x, key) for x in held_t)
    return {"table": np.array(table), "fraction": np.array(fraction), "y": np.array(y), "rows": test_rows}


def monotone_floor(rows: list, held: list, y: np.ndarray) -> dict:
    """``fidelity_aisim._monotone_floor`` on the held-out rows: the error of the best time
    non-decreasing in tokens fitted to each whole series, the tables' own scatter that no
    interpolation in tokens can beat."""
    (series,) = MoeRows.of(rows).series.values()
    floor = {}
    for key, (t, s) in series.items():
        err = _monotone_floor(t, s, [key] * len(t))
        floor.update({(float(x), key): e for x, e in zip(t, err)})
    e = np.array([floor[(float(t), key)] for t, key in held])
    return {"mean": float(e.mean()), "max": float(e.max())}


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
            "table": stats(split["table"], y),
            "table_roofline_fraction": stats(split["fraction"], y),
            "catalog": stats(catalog, y),
            "monotone_floor": monotone_floor(rows, split["rows"], y),
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
            "nearest_shape_ratio": stats(
                nearest_shape_ratio(rows, test_shapes, hw, weights, expert_parallel), ty
            ),
        }
    return res


def nearest_shape_ratio(rows: list, test_shapes: set, hw, weights: str, expert_parallel: bool) -> np.ndarray:
    """A way across shapes tried and not taken: each held-out row priced by the catalog's curve
    times the measured / catalog ratio of the nearest training series at the same expert TP and
    EP (nearest in log hidden, log intermediate per rank, log top-k, log experts per rank), in log
    tokens; in ``test``'s row order."""
    (series,) = MoeRows.of([r for r in rows if tuple(r[2:6]) not in test_shapes]).series.values()

    def place(k: tuple) -> np.ndarray:
        return np.log([k[0], k[1] / k[4], k[2], k[3] / k[5]])

    ratio: dict = {}
    out = []
    for r in rows:
        key = tuple(int(x) for x in r[2:8])
        if key[:4] not in test_shapes:
            continue
        if key not in ratio:
            same = [c for c in series if c[4:] == key[4:]] or list(series)
            near = min(same, key=lambda c: (float(np.abs(place(c) - place(key)).sum()), c))
            t, s = series[near]
            cat = catalog_moe_time(hw, weights, [[None, x, *near, None, 0.0] for x in t], expert_parallel)
            ratio[key] = (np.log(t), s / cat)
        lt, q = ratio[key]
        own = catalog_moe_time(hw, weights, [r], expert_parallel)[0]
        out.append(own * np.interp(np.log(r[1]), lt, q))
    return np.array(out)


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
    start = time.time()
    results: dict = {
        **run_stamp("fidelity_aisim_moe_table", console.print),
        "table_versions": {g: tables[g].get("moe_versions") for g in gpus if g in tables},
        "moe": {},
        "left_out": {},
    }
    table = Table(
        title="Fused MoE held out (vLLM's kernels): (a) every other token count of each series, "
        "(b) half the model shapes; AISimulate's table interpolated vs the catalog's curve on the same rows"
    )
    for col in ("GPU", "format", "kernel", "series", "(a) rows", "table: mean / p90 / max", "time-weighted",
                "roofline fraction: mean / max", "floor: mean", "catalog: mean / p90 / max / tw", "(b) rows priced / held out",
                "with fallback = catalog: mean / max", "nearest shape's ratio: mean / max"):  # fmt: skip
        table.add_column(col)
    for gpu in gpus:
        entry = tables.get(gpu) or {}
        if gpu not in GPUS or not entry.get("moe"):
            continue
        every = MoeRows.of(entry["moe"])
        for label, fmt, all_rows in jobs(entry, gpu):
            if fmt not in MOE_FORMATS:
                continue
            weights = MOE_FORMATS[fmt][1]
            kernel, rows = engine_kernel("vllm", gpu, fmt, all_rows, label.endswith("@ep"))
            # the cost model's choice (aisim_moe_table.py): where vLLM's own kernel is not in the
            # tables it keeps the catalog's curve, so those rows (another kernel's) are left out
            own, why = every.kernel(gpu, weights, "vllm", label.endswith("@ep"))
            if own != kernel:
                results["left_out"].setdefault(gpu, {})[label] = why or f"{own} priced, not {kernel}"
                console.print(f"{GPUS[gpu]} {label}: left out ({why or own})")
                continue
            res = held_out(gpu, label, weights, rows)
            res["kernel"] = kernel
            results["moe"].setdefault(gpu, {})[label] = res
            a, lt, c = (
                res["tokens"]["table"],
                res["tokens"]["table_roofline_fraction"],
                res["tokens"]["catalog"],
            )
            b = res.get("shapes")
            table.add_row(
                GPUS[gpu], label, kernel.removeprefix("vllm_"), str(res["series"]), str(a["n"]),
                f"{a['mean']:.1%} / {a['p90']:.1%} / {a['max']:.0%}", f"{a['time_weighted']:.1%}",
                f"{lt['mean']:.1%} / {lt['max']:.0%}", f"{res['tokens']['monotone_floor']['mean']:.1%}",
                f"{c['mean']:.1%} / {c['p90']:.1%} / {c['max']:.0%} / {c['time_weighted']:.1%}",
                f"{b['priced_by_table']} / {b['held_out_rows']}" if b else "-",
                f"{b['table_with_fallback']['mean']:.1%} / {b['table_with_fallback']['max']:.0%}" if b else "-",
                f"{b['nearest_shape_ratio']['mean']:.1%} / {b['nearest_shape_ratio']['max']:.0%}" if b else "-",
            )  # fmt: skip
    console.print(table)
    results["wall_s"] = round(time.time() - start, 1)
    save_results(results, args.out, "fidelity_aisim_moe_table.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
