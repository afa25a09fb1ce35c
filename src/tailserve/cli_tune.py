"""``tailserve tune`` and the sweep options (``--workers``, ``--ray``, ``--quiet``) it shares with
``compare``."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from tailserve.cli import (
    CliError,
    _add_deployment_args,
    _add_workload_args,
    _deployment,
    _engine_options,
    _print_notes,
    _workload,
    _write_json,
)
from tailserve.core.engine import EngineOptions
from tailserve.metrics.summary import Slo
from tailserve.policies.registry import PolicySpec
from tailserve.report.tables import console, deployment_line, wrap_label
from tailserve.sim.deployment import build_cost_model
from tailserve.sim.run_file import RunResult
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import DEFAULT_SLO, RateScaler, parse_capacity_slo
from tailserve.tune.recommend import (
    DEFAULT_CHUNK_SIZES,
    DEFAULT_TUNE_POLICIES,
    PolicyTune,
    SizePoint,
    TuneConfig,
    TuneResult,
    best_run_specs,
    tune,
    tune_json,
)
from tailserve.tune.sweep import ResultsFile, RunSpec, Sweep, make_backend

DEFAULT_RESULTS = (
    "$TAILSERVE_CACHE/tune/ (default ~/.cache/tailserve/tune/), one file per deployment and workload"
)


# ---- sweep options ------------------------------------------------------------------------
def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="local worker processes (default: the CPU count; 1 runs in this process)",
    )
    g.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run on Ray: 'auto' attaches to this machine's Ray or starts one, else a cluster address",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def make_sweep(args: argparse.Namespace, results: ResultsFile | None = None) -> Sweep:
    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    return Sweep(make_backend(args.workers, args.ray), results, quiet=args.quiet)


# ---- tune ---------------------------------------------------------------------------------
def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="capacity of each policy under an SLO, its best budget / chunk size, and the flags to use",
    )
    p.add_argument(
        "--policies",
        default=DEFAULT_TUNE_POLICIES,
        help="comma list, each NAME[:flag=value...] (default: %(default)s)",
    )
    p.add_argument(
        "--slo",
        default=DEFAULT_SLO,
        help="tail bounds METRIC_STAT=TIME (ttft, tbt, tpot, e2e, queue; p50, p90, p99, mean, max) "
        "and/or per-request bounds with a goodput target, e.g. ttft=2s,tpot=100ms,goodput=90%% "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--chunk-sizes",
        default=",".join(map(str, DEFAULT_CHUNK_SIZES)),
        help="budgets / chunk sizes to sweep, tokens (default: %(default)s)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests/s for the budget sweep (default: the best policy's capacity)",
    )
    p.add_argument(
        "--rel-tol", type=float, default=0.05, help="capacity to within this fraction (default: %(default)s)"
    )
    p.add_argument(
        "--flat-tol",
        type=float,
        default=0.10,
        help="flat region: sizes whose SLO ratio is within this fraction of the best (default: %(default)s)",
    )
    p.add_argument("--max-rate", type=float, default=1e4, help="stop doubling the rate here, requests/s")
    p.add_argument(
        "--model-id",
        default=None,
        help="model name or path in the printed commands (default: the catalog model's Hugging Face repo)",
    )
    _add_deployment_args(p)
    _add_workload_args(p)
    p.set_defaults(workload="chat", num_requests=1000)  # long enough for a queue to build past capacity
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="OUT", help="write the capacities, sweeps and commands as JSON")
    g.add_argument(
        "--out",
        metavar="FILE.jsonl",
        default=None,
        help="results file, one line per finished run; reused to resume "
        f"(default: DIR/runs.jsonl with --report DIR, else under {DEFAULT_RESULTS})",
    )
    g.add_argument(
        "--report",
        metavar="DIR",
        help="write PNG plots (sweep curves; CDFs, timelines and slowest requests at each policy's "
        "best size) and a self-contained index.html into DIR",
    )
    g.add_argument("--no-resume", action="store_true", help="start the results file afresh")
    g.add_argument("--check-integrity", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--no-fast-forward", action="store_true", help=argparse.SUPPRESS)
    add_sweep_args(p)
    p.set_defaults(run=cmd_tune)


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise CliError(
            f"--chunk-sizes {text!r}: expected a comma list of token counts, e.g. 256,512,1024"
        ) from None
    if not sizes or any(s < 1 for s in sizes):
        raise CliError(f"--chunk-sizes {text!r}: expected token counts >= 1")
    return sizes


def cmd_tune(args: argparse.Namespace) -> int:
    from tailserve.policies.registry import parse_policy_list

    deployment = _deployment(args)
    built = build_cost_model(deployment)
    _print_notes(built)
    config = TuneConfig(
        deployment,
        _workload(args),
        parse_capacity_slo(args.slo),
        tuple(parse_policy_list(args.policies)),
        _parse_sizes(args.chunk_sizes),
        args.request_rate,
        args.rel_tol,
        args.flat_tol,
        max_rate=args.max_rate,
        options=EngineOptions(fast_forward=not args.no_fast_forward, check_integrity=args.check_integrity),
    )
    # A workload without a rate to search is refused before a results file is made or named.
    RateScaler.of(RunSpec(config.deployment, config.workload, config.policies[0]))
    results = ResultsFile(args.out or default_results_path(config, args.report), resume=not args.no_resume)
    print(
        f"results: {results.path} ({len(results)} runs to reuse; --out FILE to choose, --no-resume to start afresh)",
        file=sys.stderr,
    )
    sweep = make_sweep(args, results)
    try:
        with sweep:
            result = tune(config, sweep, args.model_id)
            print_tune(result, deployment_line(built))
            if args.report:
                _write_report(args.report, result, sweep, deployment_line(built))
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: {len(results)} finished runs are in {results.path}; "
            "the same command resumes from them",
            file=sys.stderr,
        )
        return 130
    print(
        f"runs: {sweep.num_executed} simulated, {sweep.num_reused} reused from {results.path}",
        file=sys.stderr,
    )
    if args.json:
        _write_json(args.json, tune_json(result))
    return 0


def default_results_path(config: TuneConfig, report: str | None) -> Path:
    """Where a tune keeps its resumable runs when ``--out`` is not given: the report folder, or
    tailserve's cache under a name of the deployment and workload (never the current directory).
    The same command finds the same file again, so it resumes."""
    if report:
        return Path(report) / "runs.jsonl"
    from tailserve.cache import cache_root

    describe = RunSpec(config.deployment, config.workload, config.policies[0]).describe()
    text = json.dumps({k: describe[k] for k in ("deployment", "workload")}, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    d = config.deployment
    slug = f"{Path(d.model).name}-{d.hardware}-tp{d.tp}-{config.workload.name}"
    return cache_root() / "tune" / f"{slug}-{digest}.jsonl"


def _write_report(out_dir: str, result: TuneResult, sweep: Sweep, deployment: str) -> None:
    """Each policy at its best size at the sweep rate, run again whole (with the batch record
    the attribution reads), and the sweep curves."""
    from tailserve.metrics.attribution import explain_run
    from tailserve.report.html import write_report
    from tailserve.report.plots import SweepCurve

    outcomes = sweep.run(best_run_specs(result), "report runs")
    runs = [o.run for o in outcomes if o.run is not None]
    curves = []
    for t in result.policies:
        if not t.points:
            continue

        def column(get: Any, points: list[SizePoint] = t.points) -> list[float | None]:
            return [get(p) if p.summary and math.isfinite(p.ratio) else None for p in points]

        curves.append(
            SweepCurve(
                f"{t.spec.label} ({t.knob})",
                "token budget / chunk size (tokens)",  # one set of panels for every policy
                [p.size for p in t.points],
                {
                    "SLO ratio (measured / bound)": column(lambda p: p.ratio),
                    "p99 TTFT (ms)": column(lambda p: p.summary["metrics"]["ttft_s"]["p99"] * 1e3),
                    "p99 TBT (ms)": column(lambda p: p.summary["metrics"]["itl_s"]["p99"] * 1e3),
                    "output tokens/s": column(lambda p: p.summary["throughput"]["output_tokens_per_s"]),
                },
                best_x=t.best.size if t.best else None,
            )
        )
    title = f"tailserve tune: {deployment}, {result.config.workload.label} at {result.sweep_rate:.3g} req/s"
    explanations = [explain_run(run) for run in runs if run.batches is not None]
    path = write_report(out_dir, runs, title=title, sweep_curves=curves, explanation=explanations)
    print(f"report: {path}", file=sys.stderr)


# ---- output -------------------------------------------------------------------------------
def _ratio(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2f}"


def _flat(t: PolicyTune) -> str:
    if t.flat is None:
        return "-"
    lo, hi = t.flat
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,} ({hi / lo:g}x)"


def _capacity(t: PolicyTune, max_rate: float) -> str:
    c = t.capacity
    if c.rate <= 0:
        return f"< {c.upper:.3g}" if c.upper else "0"
    if c.upper is None:
        return f">= {max_rate:g}"
    return f"{c.rate:.3g}"


def print_tune(result: TuneResult, deployment: str) -> None:
    c = result.config
    console.print(f"{deployment} — {c.workload.label}")
    console.print(f"SLO: {c.slo}; budget sweep at {result.sweep_rate:.3g} requests/s")
    table = Table(title="capacity (highest rate meeting the SLO) and best budget", title_justify="left")
    for name in (
        "rank",
        "policy",
        "capacity\nreq/s",
        "budget flag",
        "capacity\nat size",
        "best",
        "flat region",
        "SLO ratio\nat best",
    ):
        table.add_column(name, justify="right" if name not in ("policy", "budget flag") else "left")
    for rank, t in enumerate(result.policies, start=1):
        table.add_row(
            str(rank),
            wrap_label(t.spec.label),
            _capacity(t, c.max_rate),
            t.knob or "(none)",
            f"{t.capacity_size:,}" if t.capacity_size is not None else "-",
            f"{t.best.size:,}" if t.best else "-",
            _flat(t),
            _ratio(t.best.ratio) if t.best else "-",
        )
    console.print(table)
    swept = [t for t in result.policies if t.points]
    if swept:
        sizes = sorted({p.size for t in swept for p in t.points})
        grid = Table(
            title=f"SLO ratio (worst measured / bound; <= 1 meets) by budget at {result.sweep_rate:.3g} req/s; "
            "* = flat region, ! = requests turned away",
            title_justify="left",
        )
        grid.add_column("policy")
        for size in sizes:
            grid.add_column(f"{size:,}", justify="right")
        for t in swept:
            cells = {p.size: _cell(t, p) for p in t.points}
            grid.add_row(t.spec.label, *(cells.get(s, "") for s in sizes))
        console.print(grid)
        for t in swept:
            away = [f"{p.size:,}: {p.num_turned_away}" for p in t.points if p.num_turned_away]
            if away:
                console.print(f"! {t.spec.label} turned requests away (at size: requests): {', '.join(away)}")
    console.print("flags to paste:")
    for t in result.policies:
        if t.command:
            console.print(f"  {t.command}", soft_wrap=True)
            if t.best is not None and not t.best.meets:
                console.print(
                    f"    (misses the SLO at {result.sweep_rate:.3g} req/s even at its best size: "
                    f"ratio {_ratio(t.best.ratio)}, {t.best.num_turned_away} turned away)"
                )
    for t in result.policies:
        errors = {p.error for p in t.points if p.error}
        for error in errors:
            console.print(f"note: {t.spec.name}: some sizes are invalid: {error}")


def _cell(t: PolicyTune, p: SizePoint) -> str:
    if p.error:
        return "invalid"
    text = "inf" if not math.isfinite(p.ratio) else f"{p.ratio:.2f}"
    return text + ("!" if p.num_turned_away else "") + ("*" if p.size in t.flat_sizes else "")


# ---- compare ------------------------------------------------------------------------------
def compare_runs(
    args: argparse.Namespace, specs: list[PolicySpec], workload: WorkloadSpec, slo: Slo | None
) -> list[RunResult]:
    """``compare``'s runs through the sweep backend. They come back whole (``keep_run``): the
    paragraph and reports read per-request timestamps, not only the summaries."""
    run_specs = [
        RunSpec(_deployment(args), workload, spec, slo, _engine_options(args), keep_run=True)
        for spec in specs
    ]
    with make_sweep(args) as sweep:
        outcomes = sweep.run(run_specs, "compare")
    for outcome in outcomes:
        if outcome.error is not None:
            raise ValueError(outcome.error)
    return [outcome.run for outcome in outcomes if outcome.run is not None]
