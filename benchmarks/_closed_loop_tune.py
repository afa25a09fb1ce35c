"""``tune``'s advice checked on the real engine (issue 33, item 3), from the closed loop's cells.

Per engine and workload, over the settings that change only the budget (``budget N``):

1. **An SLO at the knee**, from the twin's own predictions for those budgets: ITL p99 at most the
   geometric mean of the smallest and the largest predicted (so some budgets meet it and some do
   not, when the budget matters), TTFT p99 at most 1.2x the smallest predicted (a small budget
   that delays first tokens fails it).
2. **The advice**: ``tailserve tune --policies vllm --trace WORKLOAD --calibration TWIN`` with
   those budgets as ``--chunk-sizes`` at the workload's own rate, the SLO's TTFT bound less the
   calibration's per-request time outside the engine (tune's simulator has no API server). Its
   recommended size, its predicted capacity (requests/s meeting the SLO).
3. **The check**: the engine's measured cell at the recommended budget — does it meet the SLO for
   real — and the budget the measurements themselves rank best (lowest worst-term ratio).

The capacity is the twin's only: measuring it would take a rate search on the real engine per
workload (tens of runs), beyond this benchmark's budget of time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._closed_loop_workloads import Workload
from tailserve.executors.simulated.calibration_files import request_overhead
from tailserve.workloads.recorded import write_trace

SRC = str(Path(__file__).resolve().parents[1] / "src")


def workload_trace(workload: Workload, path: Path) -> Path:
    """The workload as a tailserve trace (token ids kept, so the twin sees its prefix sharing)."""
    lines = [
        {
            "arrival_time": float(t),
            "prompt_len": r.prompt_len,
            "max_tokens": r.output_len,
            "prompt_token_ids": r.prompt,
        }
        for r, t in zip(workload.requests, workload.times)
    ]
    write_trace(path, lines)
    return path


def knee_slo(cells: list[dict[str, Any]]) -> tuple[float, float]:
    """(TTFT p99 bound, ITL p99 bound), seconds, from the predicted figures of ``cells``."""
    itl = [c["predicted"]["itl_p99"] for c in cells]
    ttft = [c["predicted"]["ttft_p99"] for c in cells]
    return 1.2 * min(ttft) / 1e3, math.sqrt(min(itl) * max(itl)) / 1e3


def slo_ratio(figures: dict[str, float], ttft_s: float, itl_s: float) -> float:
    return max(figures["ttft_p99"] / 1e3 / ttft_s, figures["itl_p99"] / 1e3 / itl_s)


def run_tune(
    model: Path,
    calibration: str,
    trace: Path,
    ttft_s: float,
    itl_s: float,
    sizes: list[int],
    rate: float,
    out: Path,
) -> dict[str, Any]:
    overhead = request_overhead(calibration)
    slo = f"ttft_p99={max(ttft_s - overhead, 1e-3) * 1e3:.1f}ms,tbt_p99={itl_s * 1e3:.1f}ms"
    cmd = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "tune",
        "--policies",
        "vllm:max_num_seqs=128",
        "--trace",
        str(trace),
    ]
    cmd += ["--model", str(model), "--calibration", calibration, "--slo", slo, "--quiet"]
    cmd += ["--chunk-sizes", ",".join(map(str, sorted(sizes))), "--request-rate", f"{rate:.6g}"]
    cmd += ["--json", str(out), "--out", str(out.with_suffix(".runs.jsonl")), "--no-resume"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC})
    if done.returncode != 0:
        raise RuntimeError(f"tune failed:\n{done.stderr[-1500:]}")
    policy = json.loads(out.read_text())["policies"][0]
    return {
        "command": " ".join(cmd),
        "slo": slo,
        **{k: policy[k] for k in ("best_size", "capacity_req_s", "flat_region")},
    }


def check_advice(
    cells: list[dict[str, Any]],
    workloads: list[Workload],
    calibrations: dict[str, dict[str, Any]],
    model: Path,
    work: Path,
) -> list[dict[str, Any]]:
    rows = []
    for engine, cal in calibrations.items():
        for w in workloads:
            budget_cells = [
                c
                for c in cells
                if c["engine"] == engine
                and c["workload"] == w.name
                and c.get("measured")
                and c["setting"].startswith("budget ")
            ]
            if len(budget_cells) < 2:
                continue
            by_size = {int(c["setting"].split()[1]): c for c in budget_cells}
            ttft_s, itl_s = knee_slo(budget_cells)
            trace = workload_trace(w, work / f"{w.name}.jsonl")
            rate = len(w.requests) / float(w.times[-1] - w.times[0])
            advice = run_tune(
                model,
                cal["file"],
                trace,
                ttft_s,
                itl_s,
                list(by_size),
                rate,
                work / f"tune-{engine}-{w.name}.json",
            )
            measured = {size: slo_ratio(c["measured"], ttft_s, itl_s) for size, c in by_size.items()}
            best = advice["best_size"]
            rows.append(
                {
                    "engine": engine,
                    "workload": w.name,
                    "slo": {"ttft_p99_s": ttft_s, "itl_p99_s": itl_s},
                    "advice": advice,
                    "measured_ratio": measured,
                    "meets_for_real": best is not None and measured.get(best, math.inf) <= 1.0,
                    "measured_best_size": min(measured, key=measured.get),
                }
            )
    return rows


def print_advice(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'engine':<10} {'workload':<14} {'SLO TTFT p99 / ITL p99':>24} {'tune says':>10} {'capacity':>10} {'meets for real':>15} {'measured best':>14}"
    )
    for r in rows:
        slo = f"{r['slo']['ttft_p99_s'] * 1e3:.0f} / {r['slo']['itl_p99_s'] * 1e3:.0f} ms"
        best = r["advice"]["best_size"]
        ratio = r["measured_ratio"].get(best)
        meets = f"{'yes' if r['meets_for_real'] else 'no'} ({ratio:.2f})" if ratio is not None else "-"
        cap = r["advice"]["capacity_req_s"]
        print(
            f"{r['engine']:<10} {r['workload']:<14} {slo:>24} {best!s:>10} "
            f"{(f'{cap:.2f}/s' if cap else '-'):>10} {meets:>15} {r['measured_best_size']:>14}"
        )
    if rows:
        ok = sum(r["meets_for_real"] for r in rows)
        print(f"tune's recommendation met the SLO on the real engine in {ok} of {len(rows)} cases")
