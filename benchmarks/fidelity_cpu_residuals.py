"""Where the CPU simulator's per-iteration error comes from, on saved real runs.

Reads the real runs ``fidelity_cpu.py`` saved (``OUT/runs/*.json``) and a calibration file, and
splits each run's per-iteration error into a **level** (the run's median measured / predicted
ratio of its decode iterations: how fast the machine, or this engine instance, ran during the
run) and the **shape** error left after dividing the run's periods by that one number (what a
cost model of the right level would still miss). Then the decode residuals after the level,
by batch size and by context per request, pooled over every run: a term the model lacks shows
as a trend there, noise as a flat scatter.

    python benchmarks/fidelity_cpu_residuals.py --runs DIR/runs --calibration DIR/calibration_cpu.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.executors.simulated.calibration_files import read_calibration_file
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.models import load_hf_config
from tailserve.fidelity.replay import from_json, iteration_kind, period_scatter

BATCH_BANDS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 256))
CONTEXT_BANDS = ((0, 128), (129, 256), (257, 512), (513, 1024), (1025, 4096))


def _band(x: float, bands: tuple[tuple[int, int], ...]) -> str:
    for lo, hi in bands:
        if lo <= x <= hi:
            return f"{lo}-{hi}"
    return "other"


def analyse(runs_dir: Path, cost_model: CostModel) -> dict:
    rows, pooled = [], defaultdict(list)
    for path in sorted(runs_dir.glob("*__*.json")):
        body = json.loads(path.read_text())
        run = from_json(body)
        timed = [r for r in run.iterations if r.period_s]
        pred = np.array([cost_model.iteration_time(r.shape) for r in timed])
        meas = np.array([r.period_s for r in timed])
        kinds = np.array([iteration_kind(r.shape) for r in timed])
        ratio = meas / pred
        decode = kinds == "decode"
        level = float(np.median(ratio[decode])) if decode.any() else 1.0
        raw = np.abs(pred / meas - 1.0)
        shaped = np.abs(pred * level / meas - 1.0)
        wl, policy = path.stem.split("__")
        # Lag-1 autocorrelation of the decode steps' log ratio, in run order: near 0 if the steps
        # scatter independently, near 1 if the machine's speed drifts over many steps.
        d = np.log(ratio[decode]) - np.log(ratio[decode]).mean() if decode.sum() > 2 else None
        lag1 = float(np.sum(d[:-1] * d[1:]) / np.sum(d * d)) if d is not None and np.any(d) else None
        rows.append(
            {
                "workload": wl,
                "policy": policy,
                "iterations": len(timed),
                "decode_level": level,
                "iter_median_raw": float(np.median(raw)),
                "iter_median_after_level": float(np.median(shaped)),
                "decode_median_after_level": float(np.median(shaped[decode])) if decode.any() else None,
                "scatter": period_scatter(run.iterations),
                "decode_lag1": lag1,
                "probe_s": body.get("probe_s"),
            }
        )
        # Whether each timed step directly follows a prefill or an idle wait (cold caches).
        after_cold, cold = {}, True
        for r in run.iterations:
            after_cold[id(r)] = cold
            cold = bool(r.shape.prefill_pairs) or r.period_s is None
        for r, x, kind in zip(timed, ratio / level, kinds):
            if kind != "decode":
                continue
            first = "first after a prefill or an idle wait" if after_cold[id(r)] else "later"
            pooled[("decode step", first)].append(x)
            b = r.shape.num_tokens
            ctx = r.shape.decode_kv_tokens / b
            pooled[("batch", _band(b, BATCH_BANDS))].append(x)
            pooled[("context", _band(ctx, CONTEXT_BANDS))].append(x)
            pooled[("workload", wl)].append(x)
    trends = {
        f"{k[0]} {k[1]}": {
            "n": len(v),
            "median": float(np.median(v)),
            "iqr": float(np.subtract(*np.percentile(v, [75, 25]))),
        }
        for k, v in sorted(pooled.items())
    }
    return {"runs": rows, "decode_trends": trends}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="the runs/ folder fidelity_cpu.py wrote")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    runs_dir = Path(args.runs)
    if not runs_dir.is_dir() or not any(runs_dir.glob("*__*.json")):
        ap.error(f"--runs {runs_dir}: no saved runs (WORKLOAD__POLICY.json) there")
    try:
        cal = read_calibration_file(args.calibration)
    except ValueError as e:
        ap.error(str(e))
    spec = load_hf_config(default_model_dir("tiny"))
    out = analyse(runs_dir, CostModel(spec, cal.hardware, 1, cal.efficiency))
    console = Console(width=160)
    table = Table(
        title="per run: decode level (measured / predicted) and the error left after it", title_justify="left"
    )
    for col in (
        "workload",
        "policy",
        "iters",
        "decode level",
        "iter med",
        "after level",
        "decode after",
        "scatter",
        "probe ms",
    ):
        table.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for r in out["runs"]:
        table.add_row(
            r["workload"], r["policy"], str(r["iterations"]), f"{r['decode_level']:.3f}",
            f"{r['iter_median_raw']:.1%}", f"{r['iter_median_after_level']:.1%}",
            "-" if r["decode_median_after_level"] is None else f"{r['decode_median_after_level']:.1%}",
            "-" if r["scatter"] is None else f"{r['scatter']:.1%}",
            "-" if r["decode_lag1"] is None else f"{r['decode_lag1']:.2f}",
            "/".join(f"{x * 1e3:.1f}" for x in (r["probe_s"] or [])),
        )  # fmt: skip
    console.print(table)
    levels = np.array([r["decode_level"] for r in out["runs"]])
    raw = np.array([r["iter_median_raw"] for r in out["runs"]])
    after = np.array([r["iter_median_after_level"] for r in out["runs"]])
    console.print(
        f"runs {len(levels)}: decode level {levels.min():.3f}-{levels.max():.3f} (median {np.median(levels):.3f}); "
        f"per-iteration median {np.median(raw):.1%} raw, {np.median(after):.1%} after each run's level "
        f"({int((raw <= 0.05).sum())} / {int((after <= 0.05).sum())} runs <= 5%); decode lag-1 autocorrelation median "
        f"{np.median([r['decode_lag1'] for r in out['runs'] if r['decode_lag1'] is not None]):.2f}"
    )
    trend = Table(
        title="decode iterations after each run's level, pooled: measured / predicted", title_justify="left"
    )
    for col in ("group", "n", "median", "IQR"):
        trend.add_column(col, justify="left" if col == "group" else "right")
    for k, v in out["decode_trends"].items():
        trend.add_row(k, str(v["n"]), f"{v['median']:.3f}", f"{v['iqr']:.3f}")
    console.print(trend)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
