"""TP all-reduce interpolated in AISimulate's measured tables, held out: tried for
``--calibration aisim:FILE`` and not taken.

For each GPU and TP degree the tables time (vLLM's all-reduce under CUDA graphs, bf16), the
message sizes up to 2^26 elements (as ``fidelity_aisim.py``'s all-reduce part) with every other
one held out: each held-out size is interpolated from the others (log time in log elements, as
the fused-MoE rows are in ``aisim_moe_table.py``; beyond the last, the time grown with the
message) and compared with its measured time, beside the
catalog's all-reduce as the cost model prices it on the same sizes (``CostModel._comm`` of a
one-layer model): the per-regime lines on Blackwell, fitted on these sizes' even half and placed
by vLLM's own kernel choice, so held out on the same split; Vidur's NCCL fits on H100 and H200,
which the catalog keeps on purpose (docs/fidelity.md, "TP all-reduce per kernel regime").

    python -m benchmarks.fidelity_aisim_allreduce_table --rows /tmp/aisim_rows.json [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import run_stamp, save_results
from benchmarks.fidelity_aisim import GPUS, MAX_ALLREDUCE_ELEMENTS, stats
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import ModelSpec

HIDDEN = 128  # the one-layer model's hidden size: every message size is a multiple of it


def by_tp(rows: list) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per TP degree, the sizes (elements, ascending, up to 2^26) and seconds of rows [TP,
    elements, ms]; a repeated size: its first row."""
    pts: dict[int, dict[float, float]] = {}
    for tp, n, ms in rows:
        if 0 < n <= MAX_ALLREDUCE_ELEMENTS and ms > 0:
            pts.setdefault(int(tp), {}).setdefault(float(n), float(ms) * 1e-3)
    return {tp: (np.array(sorted(p)), np.array([p[n] for n in sorted(p)])) for tp, p in pts.items()}


def held_out(gpu: str, rows: list) -> dict:
    hw = get_hardware(GPUS[gpu])
    out = {}
    for tp, (n, y_all) in sorted(by_tp(rows).items()):
        test = np.arange(len(n)) % 2 == 1
        # log time in log elements; beyond the last training size (2^26 is held out) the last
        # time grown with the message, as a bandwidth-bound transfer
        last = n[~test][-1], y_all[~test][-1]
        pred = np.exp(np.interp(np.log(n[test]), np.log(n[~test]), np.log(y_all[~test])))
        pred = np.where(n[test] > last[0], last[1] * n[test] / last[0], pred)
        y = y_all[test]
        spec = ModelSpec("allreduce-probe", HIDDEN, 1, 8, 8, 4 * HIDDEN, 1024, 4096)
        cm = CostModel(spec, hw, tp)
        catalog = np.array([cm._comm(float(x) / HIDDEN) / 2.0 for x in n[test]])  # two per layer
        out[tp] = {
            "sizes_held_out": int(test.sum()),
            "catalog_lines": "per-regime" if hw.allreduce_bands_at(tp) else "NCCL fit",
            "table": stats(pred, y),
            "catalog": stats(catalog, y),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", required=True, help="an export of benchmarks/_aisim_tables.py")
    parser.add_argument(
        "--out",
        default=None,
        help="results JSON (default benchmarks/out/fidelity_aisim_allreduce_table.json)",
    )
    args = parser.parse_args()
    console = Console(width=160)
    tables = json.loads(Path(args.rows).read_text())["gpus"]
    start = time.time()
    results: dict = {
        **run_stamp("fidelity_aisim_allreduce_table", console.print),
        "versions": {g: e.get("allreduce_version") for g, e in tables.items() if g in GPUS},
        "allreduce": {},
    }
    table = Table(
        title="TP all-reduce held out (vLLM, CUDA graphs, bf16, <= 2^26 elements, every other size): "
        "AISimulate's rows interpolated (not taken) vs the catalog"
    )
    for col in ("GPU", "TP", "sizes held out", "table: mean / p90 / max", "time-weighted",
                "catalog: mean / p90 / max", "time-weighted ", "catalog's lines"):  # fmt: skip
        table.add_column(col)
    for gpu, entry in tables.items():
        if gpu not in GPUS or not entry.get("allreduce"):
            continue
        res = held_out(gpu, entry["allreduce"])
        results["allreduce"][gpu] = res
        for tp, r in res.items():
            t, c = r["table"], r["catalog"]
            table.add_row(
                GPUS[gpu], str(tp), str(r["sizes_held_out"]),
                f"{t['mean']:.1%} / {t['p90']:.1%} / {t['max']:.0%}", f"{t['time_weighted']:.1%}",
                f"{c['mean']:.1%} / {c['p90']:.1%} / {c['max']:.0%}", f"{c['time_weighted']:.1%}",
                r["catalog_lines"],
            )  # fmt: skip
    console.print(table)
    results["wall_s"] = round(time.time() - start, 1)
    save_results(results, args.out, "fidelity_aisim_allreduce_table.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
