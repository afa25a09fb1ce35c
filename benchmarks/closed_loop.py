"""The advice checked on a real engine: predict each flag setting's tail, run the engine with
it, compare (issue 33).

For each engine — vLLM's CPU build (``vllm serve`` from its peer venv) and tailserve's own
(``tailserve serve --executor torch --policy vllm``), same model directory (the ``tiny`` model),
each in its faster dtype on this CPU (``--dtype`` / ``--vllm-dtype``), 2 GiB of KV cache each:

1. **Calibrate once**, from outside: ``tailserve calibrate --from-server URL --hardware cpu`` on
   the engine at its default budget (timed prefill and decode probes, the server's own
   Prometheus histograms where one request runs alone); the file is the engine's twin.
2. **Run** every workload (``_closed_loop_workloads.py``: hol, an Azure conversation slice,
   shared prefixes) under every flag setting (``_closed_loop_engines.py``: budget 256-8192,
   ``max_num_seqs`` 4, prefix caching off, chunked prefill off), sent by ``tailserve bench``'s
   client at fixed times (token-id prompts, ``ignore_eos``, greedy). Settings are interleaved
   between the engines (setting 1 on vLLM, then on tailserve, then setting 2 ...), each engine
   restarted per setting and warmed up; every cell waits for a quiet machine and records the
   machine's other CPU use.
3. **Predict** every cell with the simulator: the same requests and send times through the
   ``vllm`` policy with the same flags, on the engine's calibration (``bench --predict``'s
   ``simulate``), plus the per-request time outside the engine the calibration measured. The
   machine's speed drifts within a run; with ``--gauge`` a few seconds of fixed work
   (``_closed_loop_gauge.py``) are timed after the calibration and on every server start, and each
   cell is also predicted on the calibration rescaled by them (off by default: measured, it did
   more harm than good on a quiet machine).
4. **Compare**: TTFT, ITL and TPOT p50/p99 and output tokens/s, predicted / measured and the
   error, per cell; the share of cells within the targets (p50 10%, p99 20%); whether the
   settings rank the same per engine and workload (Spearman's rho and pairwise order).
5. **tune's advice** (``_closed_loop_tune.py``): for an SLO at each workload's knee, ``tailserve
   tune`` on the twin recommends a budget; the measured cell at that budget says whether it
   meets the SLO for real.

    python -m benchmarks.closed_loop [--engines vllm,tailserve] [--workloads hol,conversation,shared-prefix]
    python -m benchmarks.closed_loop --quick     # smoke: 2 settings, shorter workloads, 1 calibration repeat

Prints the tables and writes ``benchmarks/out/closed_loop.json`` (``closed_loop_quick.json``
with ``--quick``; the committed figures are ``--out benchmarks/results/closed_loop.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _closed_loop_gauge as gauge
from benchmarks import _closed_loop_report as report
from benchmarks import _closed_loop_repredict as repro
from benchmarks._closed_loop_engines import QUICK_SETTINGS, SETTINGS, Engine, Setting
from benchmarks._closed_loop_tune import check_advice, print_advice
from benchmarks._closed_loop_workloads import Workload, build
from benchmarks._common import CpuMeter, cpu_line, gated, missing_peer, peer_venv, save_results, simd_flags
from benchmarks.serve_vs_vllm import start_server, stop_server
from tailserve.bench.client import BenchConfig, run_benchmark
from tailserve.bench.datasets import BenchRequest
from tailserve.bench.predict import PredictSpec, simulate
from tailserve.bench.result import compute_result
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.calibration_files import request_overhead
from tailserve.fidelity.server_calibrate import threads_note
from tailserve.fidelity.server_probe import ServerProbe
from tailserve.fidelity.stall_check import check_stalls, seen_requests
from tailserve.metrics.attribution import run_attributor

PERCENTILES = [50.0, 99.0]
NAME = "tiny"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 settings, shorter workloads")
    p.add_argument("--engines", default="vllm,tailserve", help="comma list of vllm, tailserve")
    p.add_argument("--workloads", default="hol,conversation,shared-prefix")
    p.add_argument("--settings", default=None, help="comma list of setting names (default: all; --quick: 2)")
    p.add_argument("--model", default=None, help="model directory (default: tailserve's tiny model)")
    p.add_argument("--dtype", default="auto", help="tailserve's dtype (auto: its own rule on this CPU)")
    p.add_argument(
        "--vllm-dtype",
        default="auto",
        help="vLLM's dtype (auto: bfloat16 where the CPU has avx512_bf16, else float32: vLLM's CPU build "
        "has no fast bf16 GEMM there, 104 vs 582 tok/s on an AVX2 EPYC, docs/benchmarks.md)",
    )
    p.add_argument("--vllm-venv", default=str(peer_venv("vllm")))
    p.add_argument("--vllm-kvcache-gib", default="2")
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace", type=Path, default=None, help="the conversation trace (default: ../shared/traces)"
    )
    p.add_argument("--calibration-repeats", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument(
        "--gauge",
        action="store_true",
        help="also time a few seconds of fixed work on every server start and predict each cell on the "
        "calibration rescaled by it (_closed_loop_gauge.py; off by default: on a quiet machine its noise "
        "cost more than the drift it corrects, docs/fidelity.md)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every setting this many times (passes, in the same interleaved order) and report how "
        "well one pass's measurement predicts the next: the engine as its own twin, the floor the "
        "targets are judged against (docs/fidelity.md)",
    )
    p.add_argument("--quiet-threshold", type=float, default=0.3, help="busy cores that count as quiet")
    p.add_argument("--quiet-timeout", type=float, default=None, help="seconds (default 300; --quick: 5)")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--no-tune", action="store_true", help="skip checking tune's advice against the cells")
    p.add_argument(
        "--tailserve-threads",
        type=int,
        default=None,
        help="tailserve serve --threads N: a fixed count, as vLLM's CPU build runs (default: its own "
        "default, the cores other processes leave free, revisited every 0.5 s)",
    )
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="run no engine: predict every cell of a saved run again with this code, on the run's "
        "calibration (_closed_loop_repredict.py)",
    )
    p.add_argument(
        "--refit", action="store_true", help="with --from-json: fit the calibration's probes again"
    )
    p.add_argument(
        "--calibration",
        action="append",
        default=[],
        metavar="ENGINE=FILE",
        help="with --from-json: predict ENGINE's cells on this calibration file instead of the run's "
        "(e.g. one `calibrate --from-trace` fitted to a recorded bench run; repeatable)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.refit and not args.from_json:
        p.error("--refit needs --from-json FILE")
    if args.calibration and not args.from_json:
        p.error("--calibration ENGINE=FILE needs --from-json FILE")
    overrides = {}
    for item in args.calibration:
        engine, eq, path = item.partition("=")
        if not eq or engine not in ("vllm", "tailserve") or not path:
            p.error(f"--calibration {item!r}: expected vllm=FILE or tailserve=FILE")
        if not Path(path).is_file():
            p.error(f"--calibration {item!r}: no such file")
        overrides[engine] = path
    args.calibration = overrides
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be >= 1")
    args.quiet_timeout = (
        args.quiet_timeout if args.quiet_timeout is not None else (5.0 if args.quick else 300.0)
    )
    args.calibration_repeats = args.calibration_repeats or (1 if args.quick else 3)
    return args


def resolve_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    import torch

    from tailserve.assemble.pytorch import auto_dtype

    return auto_dtype(torch.device("cpu"))[0]


def resolve_vllm_dtype(dtype: str) -> str:
    """vLLM's CPU build runs bf16 through oneDNN, fast only with AVX-512 bf16 (or AMX); below
    that float32 is its faster dtype. Each engine is checked at the dtype a user would run."""
    if dtype != "auto":
        return dtype
    from tailserve.executors.pytorch import cpu_isa

    # The CPU's own level: TAILSERVE_CPU_ISA forces tailserve's kernels down, not vLLM's.
    native = cpu_isa.native_level()
    return "bfloat16" if cpu_isa.LEVELS.index(native) >= cpu_isa.LEVELS.index("avx512_bf16") else "float32"


def warm_up(url: str, vocab: int, seed: int) -> None:
    """A few requests no cell sees: first-request costs, and shapes up to the long prompt's."""
    import numpy as np

    rng = np.random.default_rng([seed, 99])
    reqs = [BenchRequest(rng.integers(10, vocab, n).tolist(), int(n), 8) for n in (64, 256, 1024, 1800)]
    config = BenchConfig(f"{url}/v1/completions", NAME, extra_body={"temperature": 0.0})
    asyncio.run(run_benchmark(reqs, np.zeros(len(reqs)), config))


def run_cell(url: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    gate = gated(args.quiet_threshold, args.quiet_timeout)
    config = BenchConfig(f"{url}/v1/completions", NAME, extra_body={"temperature": 0.0})
    load0 = os.getloadavg()[0]
    probe = ServerProbe(url, NAME, {})
    first = probe.histograms()
    with CpuMeter() as meter:
        results, duration = asyncio.run(run_benchmark(workload.requests, workload.times, config))
    last = probe.histograms()
    # tailserve's CPU executor runs on the cores other processes (the client here) leave free
    threads = last.threads_since(first) if first is not None and last is not None else {}
    failed = [r.error for r in results if not r.success]
    out = compute_result(results, duration, percentiles=PERCENTILES, metrics=["ttft", "tpot", "itl", "e2el"])
    t0 = min(r.start_time for r in results)
    seen = seen_requests(  # every request as the client saw it, for the stall check (not saved)
        [f"bench-{i}" for i in range(len(results))],
        [r.start_time - t0 for r in results],
        [q.prompt_len for q in workload.requests],
        [r.ttft if r.success else None for r in results],
        [r.itl for r in results],
    )
    return {
        "seen": seen,
        "result": out,
        "failed": failed[:5],
        "quiet": gate,
        "cpu": meter.result(),
        "load_average": [load0, os.getloadavg()[0]],
        "engine_thread_seconds": {str(n): round(v, 3) for n, v in sorted(threads.items())},
    }


def calibrate(engine: Engine, url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "calibrate",
        "--from-server",
        url,
        "--model",
        str(engine.model),
    ]
    cmd += ["--hardware", "cpu", "--dtype", engine.dtype, "--repeats", str(args.calibration_repeats)]
    cmd += ["--out", str(out)]
    if args.quick:
        cmd += ["--prefill", "32,256,1024,1800", "--decode", "1x128,1x1024,4x256,16x256"]
    env = {**os.environ, "COLUMNS": "140", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"calibrate --from-server failed on {engine.name}:\n{done.stderr[-2000:]}")
    print(done.stdout, flush=True)
    return {"command": " ".join(cmd), "file": str(out), "seconds": time.perf_counter() - t0}


def predict(
    workload: Workload, setting: Setting, calibration: str, model: Path
) -> tuple[dict[str, Any], Any]:
    """The twin's figures for a cell, and its run (with the batch record ``explain`` reads)."""
    spec = PredictSpec(str(model), "H100", 1, calibration, setting.policy())
    results, duration, run = simulate(
        workload.requests, workload.times, spec, None, EngineOptions(record_batches=True)
    )
    overhead = request_overhead(calibration)
    for r in results:  # the engine model has no API server: the calibration's measured time for it
        if r.success:
            r.ttft += overhead
            r.latency += overhead
    figures = compute_result(
        results, duration, percentiles=PERCENTILES, metrics=["ttft", "tpot", "itl", "e2el"]
    )
    return figures, run


def stall_check(seen: list, run: Any) -> dict[str, Any]:
    """The real cell's stalls against the twin's explanation of the same gaps (explain --measured)."""
    return check_stalls(seen, run.requests, run_attributor(run)).to_json(top=5)


def measure(
    args: argparse.Namespace,
    engines: list[Engine],
    settings: list[Setting],
    workloads: list[Workload],
    model: Path,
    vocab: int,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], list[dict[str, Any]], Path]:
    """Every cell run on its real engine (settings interleaved across the engines), each
    engine calibrated once on its first server, then every cell predicted: the cells, the
    calibrations, the server starts and the work folder."""
    work = Path(tempfile.mkdtemp(prefix="closed_loop-"))
    calibrations: dict[str, dict[str, Any]] = {}
    cells: list[dict[str, Any]] = []
    starts: list[dict[str, Any]] = []
    # Interleaved: each setting on every engine before the next, the engines' order alternating;
    # with --repeat, the whole sequence again (a pass), the calibration kept from the first.
    passes = [(n, setting) for n in range(args.repeat) for setting in settings]
    for k, (pass_no, setting) in enumerate(passes):
        for engine in engines if k % 2 == 0 else engines[::-1]:
            port = args.port + (0 if engine.name == "vllm" else 1)
            url = f"http://127.0.0.1:{port}"
            log = work / f"{engine.name}-{k}.log"
            t0 = time.perf_counter()
            try:
                proc = start_server(
                    engine.command(setting, port),
                    engine.env(args.vllm_kvcache_gib),
                    url,
                    engine.startup_timeout_s,
                    log,
                )
            except RuntimeError as error:
                tail = log.read_text()[-600:] if log.exists() else ""
                reason = f"{error}; {tail.strip().splitlines()[-1] if tail.strip() else ''}"
                print(f"{engine.name} / {setting.name}: did not start: {reason}", flush=True)
                for w in workloads:
                    cells.append(
                        {
                            "engine": engine.name,
                            "setting": setting.name,
                            "workload": w.name,
                            "pass": pass_no,
                            "skipped": reason,
                        }
                    )
                continue
            starts.append(
                {"engine": engine.name, "setting": setting.name, "seconds": time.perf_counter() - t0}
            )
            try:
                warm_up(url, vocab, args.seed)
                if engine.name not in calibrations:
                    # The calibration's timings are the twin's whole basis: they wait for a quiet
                    # machine as every cell does (until r39 only the cells did).
                    quiet = gated(args.quiet_threshold, args.quiet_timeout)
                    calibrations[engine.name] = calibrate(
                        engine, url, args, work / f"calibration-{engine.name}.json"
                    )
                    calibrations[engine.name]["quiet"] = quiet
                    if args.gauge:  # the machine's speed as the calibration saw it
                        base = gauge.measure(url, NAME, vocab, args.seed + 1000 * k)
                        calibrations[engine.name]["gauge"] = base.to_json()
                        now = base
                elif args.gauge:
                    now = gauge.measure(url, NAME, vocab, args.seed + 1000 * k + 1)
                timed = None
                if args.gauge:
                    f = gauge.factors(now, gauge.Gauge(**calibrations[engine.name]["gauge"]))
                    timed = {"gauge": now.to_json(), "factors": [round(f[0], 4), round(f[1], 4)]}
                    timed["calibration"] = gauge.scaled_calibration(
                        calibrations[engine.name]["file"], *f, work / f"calibration-{engine.name}-{k}.json"
                    )
                    print(
                        f"{engine.name} / {setting.name}: gauge prefill {now.prefill_s * 1e3:.1f} ms, "
                        f"ITL {now.itl_s * 1e3:.1f} ms: x{f[0]:.2f} / x{f[1]:.2f} the calibration's",
                        flush=True,
                    )
                for w in workloads:
                    t1 = time.perf_counter()
                    measured = run_cell(url, w, args)
                    r = measured["result"]
                    shares = threads_note({int(n): v for n, v in measured["engine_thread_seconds"].items()})
                    print(
                        f"{engine.name} / {setting.name} / {w.name}"
                        + (f" (pass {pass_no + 1})" if args.repeat > 1 else "")
                        + f": TTFT p50 {r['p50_ttft_ms']:.0f} p99 "
                        f"{r['p99_ttft_ms']:.0f} ms, ITL p50 {r['p50_itl_ms']:.1f} p99 {r['p99_itl_ms']:.0f} ms, "
                        f"{r['output_throughput']:.0f} tok/s, {r['failed']} failed "
                        f"({time.perf_counter() - t1:.0f} s, load {measured['load_average'][1]:.1f}{shares})",
                        flush=True,
                    )
                    cells.append(
                        {
                            "engine": engine.name,
                            "setting": setting.name,
                            "workload": w.name,
                            "pass": pass_no,
                            "run": measured,
                        }
                    )
                    if timed is not None:
                        cells[-1]["gauge"] = timed
            finally:
                stop_server(proc)

    for c in cells:
        if "run" not in c:
            continue
        setting = next(s for s in settings if s.name == c["setting"])
        w = next(w for w in workloads if w.name == c["workload"])
        cal = calibrations[c["engine"]]["file"]
        c["measured"] = report.figures(c["run"]["result"])
        figures, run = predict(w, setting, cal, model)
        if "gauge" in c:  # the headline is the twin at the cell's minute; the calibration as taken beside it
            c["predicted_uncorrected"] = report.figures(figures)
            c["error_uncorrected"] = report.errors(c["predicted_uncorrected"], c["measured"])
            figures, run = predict(w, setting, c["gauge"]["calibration"], model)
        c["predicted"] = report.figures(figures)
        c["error"] = report.errors(c["predicted"], c["measured"])
        seen = c["run"].pop("seen")
        c["stalls"] = stall_check(seen, run)
        # What the client saw, compact: the stall check can be redone from the file.
        c["run"]["seen"] = [
            [round(r.arrival, 5), r.prompt_len, [round(t, 5) for t in r.token_times]] for r in seen
        ]

    return cells, calibrations, starts, work


def main() -> int:
    args = parse_args()
    t_start = time.perf_counter()
    saved = json.loads(Path(args.from_json).read_text()) if args.from_json else None
    if saved is not None and args.model is None:
        args.model = saved["model"]
    if args.model is None:
        from tailserve.executors.pytorch.init_model import default_model_dir

        args.model = default_model_dir()
    model = Path(args.model).resolve()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    max_len = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    dtype = resolve_dtype(args.dtype)
    dtypes = {"tailserve": dtype, "vllm": resolve_vllm_dtype(args.vllm_dtype)}
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    if saved is not None:  # the engines, dtypes, settings and workloads the run had
        dtypes.update(saved["dtype"])
        names = list(saved["dtype"])
    vllm_python = str(Path(args.vllm_venv) / "bin" / "python")
    if "vllm" in names and not Path(vllm_python).exists() and saved is None:
        print(
            f"closed_loop: error: {missing_peer('vllm', args.vllm_venv)} Or run with --engines tailserve.",
            file=sys.stderr,
        )
        return 2
    engines = [
        Engine(
            n,
            vllm_python if n == "vllm" else sys.executable,
            model,
            NAME,
            dtypes[n],
            max_len,
            args.server_timeout,
            args.tailserve_threads if n == "tailserve" else None,
        )
        for n in names
    ]
    if saved is not None:  # the settings and workloads the run had, built once
        settings = repro.run_settings(saved)
        workloads = repro.run_workloads(saved, vocab, args.seed, args.trace)
    else:
        settings = list(QUICK_SETTINGS if args.quick else SETTINGS)
        if args.settings:
            wanted = [s.strip() for s in args.settings.split(",")]
            settings = [s for s in SETTINGS if s.name in wanted]
        workloads = build(
            [w.strip() for w in args.workloads.split(",")], vocab, args.seed, args.quick, args.trace
        )
    print(cpu_line())
    print(
        f"model {model}; engines {', '.join(f'{n} ({dtypes[n]})' for n in names)}; {len(settings)} settings x {len(workloads)} workloads"
    )
    for w in workloads:
        print(f"  {w.name}: {w.note} ({len(w.requests)} requests)")

    if saved is not None:  # the twin's side again, on the cells a run measured
        work = Path(tempfile.mkdtemp(prefix="closed_loop-"))
        calibrations = repro.saved_calibrations(saved, model, work, args.refit)
        for engine, path in args.calibration.items():
            if engine not in calibrations:
                print(f"closed_loop: error: the run has no {engine} cells", file=sys.stderr)
                return 2
            calibrations[engine] = {"file": str(Path(path).resolve()), "replaced": True}
        starts = saved.get("server_starts", [])
        cells = repro.repredict_cells(saved["cells"], settings, workloads, calibrations, model, predict)
    else:
        cells, calibrations, starts, work = measure(args, engines, settings, workloads, model, vocab)
    print()
    report.print_cells(cells)
    report.print_stalls(cells)
    ranks = report.rankings(cells)
    if ranks:
        print(
            "\nranking of the settings, predicted vs measured: Spearman's rho, then pairs ordered the same / pairs"
        )
        report.print_rankings(ranks)
    repeat = report.repeatability(cells)
    if repeat:
        print("\nthe engine as its own twin: each cell's first pass measured against its later passes")
        report.print_repeatability(repeat)
    advice = []
    if not args.no_tune:  # on the first pass: the SLOs come from one measurement per setting
        first = [c for c in cells if c.get("pass", 0) == 0]
        advice = check_advice(first, workloads, calibrations, model, work)
        if advice:
            print(
                "\ntune's advice from the twin, checked on the real engine (the SLO at each workload's knee)"
            )
            print_advice(advice)
    shares = report.target_shares(cells)
    raw_shares = report.target_shares(cells, "error_uncorrected")
    for engine, s in shares.items():
        raw = raw_shares.get(engine)
        print(
            f"{engine}: {s['cells_all_within']}/{s['cells']} cells with every p50 within 10% and every p99 within 20%; "
            f"{s['figures_within']}/{s['figures']} single figures within their target"
            + (
                f" (without the gauge: {raw['cells_all_within']} cells, {raw['figures_within']} figures)"
                if raw
                else ""
            )
        )
    total = time.perf_counter() - t_start
    print(cpu_line())
    print(f"took {total:.0f} s")
    for c in cells:  # the per-request lists stay in the run's own files
        if "run" in c:
            c["run"]["result"] = {k: v for k, v in c["run"]["result"].items() if not isinstance(v, list)}
    payload = {
        "command": " ".join(["python -m benchmarks.closed_loop", *sys.argv[1:]]),
        "model": str(model),
        "dtype": {n: dtypes[n] for n in names},
        "workloads": [w.summary for w in workloads],
        "settings": [{"name": s.name, "flags": s.flags(), "policy": s.policy()} for s in settings],
        "calibrations": {
            k: {**v, "body": json.loads(Path(v["file"]).read_text())} for k, v in calibrations.items()
        },
        "server_starts": starts,
        "cells": cells,
        "rankings": ranks,
        "stall_totals": report.stall_totals(cells),
        "tune_advice": advice,
        "target_shares": shares,
        "target_shares_uncorrected": raw_shares,
        "repeatability": repeat,
        "seconds": total,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "cpu": cpu_line()},
        "cpu_flags": simd_flags(),
    }
    save_results(payload, args.out, "closed_loop_quick.json" if args.quick else "closed_loop.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
