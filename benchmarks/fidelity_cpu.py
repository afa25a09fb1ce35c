"""The simulator against the real executor on this CPU: same requests, same arrival times.

For every policy and four workloads (Poisson mixed lengths at a low and a high load, a
head-of-line burst, shared system prompts), run the requests on the real executor (the ``tiny``
model from ``tailserve model init``, bf16, greedy, ``ignore_eos``), then replay the same requests
— token ids, lengths and the arrival times the real engine stamped — in the simulator with the
host's fitted calibration (``tailserve calibrate --executor torch``; made here if not given).
Reports the per-iteration duration error (median and p90 of |predicted / measured - 1| over
back-to-back iterations), the run's own scatter (``replay.period_scatter``: how far one decode
step's period lies from its neighbours' of the same batch size — the floor no cost model can go
below) and the request-metric errors (TTFT p50/p99, TPOT p50/p99, E2E p50, output throughput),
with ``uptime`` before and after: this machine is shared. A fixed probe (``torch_calibrate.probe``,
a 4-request decode) runs before and after every real run, beside the one taken at calibration:
how far the machine's own speed moved (other processes move it by tens of percent even on the
CPU clock). It is recorded, not used to correct anything: the probe's own noise is as large.

    python -m benchmarks.fidelity_cpu [--calibration FILE | --repeats N] [--policies static,vllm,...]
        [--workloads poisson-low,poisson-high,hol,shared-prefix] [--threads 1] [--out DIR]

Each real run is saved to OUT/runs/WORKLOAD__POLICY.json (requests, token times, every
iteration's batch shape and period, the probes); `--from-runs DIR --calibration FILE` replays the
simulator side against saved runs without running the real executor (to try a cost model).

``--residuals`` then splits each run's per-iteration error into a **level** (the run's median
measured / predicted ratio of its decode iterations: how fast the machine, or this engine
instance, ran during the run) and the **shape** error left after dividing the run's periods by
that one number (what a cost model of the right level would still miss), and pools the decode
residuals after the level by batch size and by context per request over every run: a term the
model lacks shows as a trend there, noise as a flat scatter (``residuals`` in the JSON).

OUT/fidelity_cpu.json holds the figures, the calibration file used (``calibration_file``: the
fitted constants and every profiled point) and the CPU's SIMD flags.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import cpu_line, simd_flags
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.executors.simulated.calibration_files import read_calibration_file, write_calibration_file
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.models import load_hf_config
from tailserve.fidelity.replay import (
    PlannedRequest,
    compare,
    from_json,
    iteration_kind,
    period_scatter,
    run_real,
    run_sim,
    to_json,
)
from tailserve.fidelity.torch_calibrate import probe
from tailserve.policies.registry import POLICIES

HERE = Path(__file__).resolve().parent
WORKLOADS = ("poisson-low", "poisson-high", "hol", "shared-prefix")


def workload(name: str, vocab: int, seed: int = 0) -> list[PlannedRequest]:
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab) for _ in range(n))

    if name.startswith("poisson"):
        # Mixed lengths; the rates are ~30% and ~70% of what the tiny model sustains on one
        # thread for these lengths (measured: ~5.5 requests/s back to back).
        rate = 1.6 if name == "poisson-low" else 4.0
        t, out = 0.0, []
        for _ in range(24):
            t += rng.expovariate(rate)
            out.append(PlannedRequest(ids(rng.randint(32, 384)), rng.randint(8, 48), t))
        return out
    if name == "hol":
        # One 1,536-token prompt, then a burst of short chats right behind it.
        out = [PlannedRequest(ids(1536), 16, 0.0)]
        out += [PlannedRequest(ids(64), 24, 0.02 + 0.01 * i) for i in range(12)]
        return out
    if name == "shared-prefix":
        # Four 256-token system prompts, 24 requests each adding 32-96 tokens of its own.
        prefixes = [ids(256) for _ in range(4)]
        t, out = 0.0, []
        for _ in range(24):
            t += rng.expovariate(3.0)
            out.append(
                PlannedRequest(prefixes[rng.randrange(4)] + ids(rng.randint(32, 96)), rng.randint(8, 32), t)
            )
        return out
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    cols = ("policy", "workload", "iters", "iter med", "iter p90", "scatter", "probe ms")
    for col in (*cols, "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "throughput"):
        table.add_column(col, justify="left" if col in ("policy", "workload") else "right")
    return table


def _add_row(table: Table, policy: str, wl: str, cmp: dict, labels: tuple[str, ...]) -> None:
    it = cmp["iterations"]
    cells = [policy, wl, str(it["n"]), f"{it['median_abs']:.1%}", f"{it['p90_abs']:.1%}"]
    cells.append("-" if it.get("scatter") is None else f"{it['scatter']:.1%}")
    cells.append("/".join(f"{x * 1e3:.1f}" for x in cmp["probe_s"]))
    cells += [f"{cmp['error'][k]:+.1%}" if cmp["error"][k] is not None else "-" for k in labels]
    table.add_row(*cells)


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


def print_residuals(console: Console, out: dict) -> None:
    """The residual analysis as two tables: per run, and the decode steps pooled by group."""
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
        "decode lag-1",
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


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _run_path(runs_dir: Path, policy: str, wl: str) -> Path:
    return runs_dir / f"{wl}__{policy}.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", help="a calibration file (default: calibrate now)")
    ap.add_argument(
        "--repeats", type=int, default=2, help="runs of the calibration grid, median per shape (default: 2)"
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads for calibration and runs (default: 1)"
    )
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the engine thread's CPU time, idle waits skipped (a shared machine); wall: real time",
    )
    ap.add_argument(
        "--out", default=str(HERE / "out"), help="folder for fidelity_cpu.json (default: benchmarks/out)"
    )
    ap.add_argument(
        "--from-runs",
        metavar="DIR",
        help="replay the real runs a previous run saved in DIR (its runs/ folder) instead of running "
        "the real executor: only the simulator side runs (needs --calibration)",
    )
    ap.add_argument(
        "--residuals",
        action="store_true",
        help="also split each run's per-iteration error into its decode level and the rest (the runs "
        "replayed: --from-runs DIR, else this run's OUT/runs)",
    )
    args = ap.parse_args()
    if args.from_runs and not args.calibration:
        ap.error("--from-runs needs --calibration FILE (the calibration the simulator side uses)")
    console = Console(width=170)
    model_dir = default_model_dir("tiny")
    spec = load_hf_config(model_dir)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_in = Path(args.from_runs) if args.from_runs else None
    if runs_in is not None and not runs_in.is_dir():
        ap.error(f"--from-runs {runs_in}: no such folder")
    runs_out = out_dir / "runs"
    if runs_in is None:
        import torch

        torch.set_num_threads(args.threads)
        runs_out.mkdir(exist_ok=True)
    before = uptime()
    console.print(f"uptime before: {before}")
    console.print(cpu_line())
    if args.calibration:
        try:
            cal = read_calibration_file(args.calibration)
        except ValueError as e:
            ap.error(str(e))
        cal_path = Path(args.calibration)
    else:
        from tailserve.fidelity.torch_calibrate import calibrate_torch

        t = time.perf_counter()
        cal, fit = calibrate_torch(model_dir, repeats=args.repeats, cpu_clock=args.clock == "cpu")
        cal_path = out_dir / "calibration_cpu.json"
        write_calibration_file(cal_path, cal, fit)
        console.print(f"calibrated in {time.perf_counter() - t:.0f} s -> {cal_path}")
    console.print(cal.source)
    cost_model = CostModel(spec, cal.hardware, 1, cal.efficiency)
    cpu = args.clock == "cpu"
    results = []
    labels = ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "throughput")
    table = _table("simulator vs real executor (error = sim / real - 1)")
    for wl in args.workloads.split(","):
        planned = workload(wl, spec.vocab_size)
        for policy in args.policies.split(","):
            t = time.perf_counter()
            if runs_in is not None:
                path = _run_path(runs_in, policy, wl)
                if not path.is_file():
                    print(f"  {policy} / {wl}: no saved run {path}; skipped", file=sys.stderr)
                    continue
                try:
                    saved = json.loads(path.read_text())
                    real = from_json(saved)
                except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
                    print(f"  {policy} / {wl}: {path} is not a saved run ({e!r}); skipped", file=sys.stderr)
                    continue
                probes, wall = saved.get("probe_s", []), saved.get("real_wall_s")
            else:
                # The machine's speed just before and after the run: the same fixed decode each time.
                before_probe = probe(model_dir, cpu_clock=cpu)
                real = run_real(model_dir, policy, planned, cpu_clock=cpu)
                after_probe = probe(model_dir, cpu_clock=cpu, seed=1)
                probes, wall = [before_probe, after_probe], time.perf_counter() - t
                # Saved so the simulator side can be replayed against it later (--from-runs).
                try:
                    body = {**to_json(real), "probe_s": probes, "real_wall_s": wall, "uptime": uptime()}
                    _run_path(runs_out, policy, wl).write_text(json.dumps(body, default=str) + "\n")
                except (TypeError, ValueError, OSError) as e:  # a record is a by-product: never stop the run
                    print(f"  {policy} / {wl}: run not saved ({e})", file=sys.stderr)
            sim = run_sim(cost_model, real.setup, real.requests)
            cmp = compare(cost_model, real, sim)
            cmp.update(policy=policy, workload=wl, real_wall_s=wall)
            cmp["probe_s"] = probes
            _add_row(table, policy, wl, cmp, labels)
            results.append(cmp)
            print(f"  {policy} / {wl}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    console.print(table)
    after = uptime()
    console.print(f"uptime after: {after}")
    body = {
        "calibration": cal.source,
        "calibration_probe_s": cal.probe_s,
        "efficiency": {k: getattr(cal.efficiency, k) for k in cal.efficiency.__slots__},
        "threads": args.threads,
        "clock": args.clock,
        "cpu_count": os.cpu_count(),
        "cpu_flags": simd_flags(),
        "uptime_before": before,
        "uptime_after": after,
        "from_runs": str(runs_in) if runs_in is not None else None,
        "runs": results,
    }
    if args.residuals:
        body["residuals"] = analyse(runs_in if runs_in is not None else runs_out, cost_model)
        print_residuals(console, body["residuals"])
    body["calibration_file"] = json.loads(cal_path.read_text())
    (out_dir / "fidelity_cpu.json").write_text(json.dumps(body, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
