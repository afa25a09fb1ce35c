"""``tailserve tune``: each policy's capacity under an SLO, its best token budget / chunk size, the
flat region around it and the engine flags to paste (docs/tune.md). With ``--engine-cmd``, one
engine as its launch line sets it up: that line's capacity, then its budget flag swept from the
line's own value, every other flag as the line has it."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from tailserve.cli.base import CliError, default_of, write_json
from tailserve.cli.engine_cmd import add_engine_cmd_args, read_engine_cmds
from tailserve.cli.options import (
    add_deployment_args,
    add_workload_args,
    deployment_from,
    print_notes,
    workload_from,
)
from tailserve.cli.sweep_options import add_sweep_args, check_sweep_args, make_sweep
from tailserve.cli.tune_plan import add_plan_args, check_plan_args, run_plan
from tailserve.cli.tune_tables import (
    CAPACITY_HEADER,
    capacity_rows,
    ceiling_lines,
    print_tune,
    transient_warnings,
)
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import build_cost_model
from tailserve.policies.registry import under_stages
from tailserve.report.tables import deployment_line
from tailserve.tune.capacity import DEFAULT_SLO, RateScaler, parse_capacity_slo
from tailserve.tune.recommend import (
    DEFAULT_CHUNK_SIZES,
    DEFAULT_TUNE_POLICIES,
    SizePoint,
    TuneConfig,
    TuneResult,
    best_run_specs,
    tune,
    tune_json,
)
from tailserve.tune.sweep import ResultsFile, RunSpec, Sweep
from tailserve.tune.valve import ttft_terms

DEFAULT_RESULTS = (
    "$TAILSERVE_CACHE/tune/ (default ~/.cache/tailserve/tune/), one file per deployment and workload"
)


# ---- tune ---------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="capacity of each policy under an SLO, its best budget / chunk size, and the flags to use",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma list, each NAME[:flag=value...] (default: {DEFAULT_TUNE_POLICIES}; with --engine-cmd, "
        "that engine's)",
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
        "--rel-tol",
        type=float,
        default=default_of(TuneConfig, "rel_tol"),
        help="capacity to within this fraction (default: %(default)s)",
    )
    p.add_argument(
        "--flat-tol",
        type=float,
        default=default_of(TuneConfig, "flat_tol"),
        help="flat region: sizes whose SLO ratio is within this fraction of the best (default: %(default)s)",
    )
    p.add_argument(
        "--max-rate",
        type=float,
        default=default_of(TuneConfig, "max_rate"),
        help="stop doubling the rate here, requests/s (default: %(default)s)",
    )
    p.add_argument(
        "--valve",
        action="store_true",
        help="also find, at --rate, the engine's admission valve that holds the SLO's TTFT bound for the "
        "requests it serves: vllm's --max-num-queued-tokens, sglang's --max-queued-requests (the fewest "
        "refused with 503; tune/valve.py)",
    )
    p.add_argument(
        "--model-id",
        default=None,
        help="model name or path in the printed commands (default: the catalog model's Hugging Face repo)",
    )
    add_deployment_args(p)
    add_workload_args(
        p, rate_help="arrival rate the capacity search starts from, requests/s (sessions/s for multi-turn)"
    )
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
    add_plan_args(p)
    add_engine_cmd_args(p)
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

    check_sweep_args(args)  # before the notes and the results line
    if args.engine_cmd and (args.policies is not None or args.gpus is not None):
        given = "--policies" if args.policies is not None else "--gpus (it plans replicas of --plan-policy)"
        raise CliError(f"--engine-cmd sets the one engine tune sweeps: drop {given}")
    commands = read_engine_cmds(args)  # --engine-cmd: its policy and deployment
    deployment = deployment_from(args)
    if args.gpus is None and deployment.dp == 1:
        check_plan_args(args)
    built = build_cost_model(deployment)
    print_notes(built)
    if commands and args.model_id is None:
        args.model_id = commands[0].deployment["model"]  # the printed commands name the model as the line did
    # An explicit "" is refused by the parser, not replaced by the default list.
    listed = DEFAULT_TUNE_POLICIES if args.policies is None else args.policies
    if args.policies is None and not commands and deployment.pp > 1 and not args.gpus:
        # The default policies simulated under these stages (policies/registry.py); a plan's
        # own (--gpus) is --plan-policy.
        layers = built.cost_model.model.num_layers
        names = under_stages(listed, layers, deployment.pp)
        listed = ",".join(names)
        print(
            f"note: --pipeline-parallel-size {deployment.pp}: tuning {', '.join(names)} only (pipeline "
            "parallelism is simulated for vLLM's engine core, TensorRT-LLM's PP loop and Sarathi-Serve's "
            f"pipelined engine, which needs the layers ({layers}) divisible by the stages)",
            file=sys.stderr,
        )
    policies = [c.spec for c in commands] or parse_policy_list(listed)
    config = TuneConfig(
        deployment,
        workload_from(args),
        parse_capacity_slo(args.slo),
        tuple(policies),
        _parse_sizes(args.chunk_sizes),
        args.request_rate,
        args.rel_tol,
        args.flat_tol,
        max_rate=args.max_rate,
        options=EngineOptions(fast_forward=not args.no_fast_forward, check_integrity=args.check_integrity),
        sweep_given=bool(commands),
    )
    if args.valve and (deployment.dp > 1 or args.gpus is not None):
        raise CliError(
            "--valve searches one engine's admission valve: not with --gpus or --data-parallel-size"
        )
    if deployment.dp > 1:
        # One engine of DP ranks: its capacity, as a plan of that one layout (tune/cluster_plan.py)
        if args.gpus is not None and args.gpus != deployment.gpus:
            raise CliError(
                f"--gpus {args.gpus} with --data-parallel-size {deployment.dp} x --tp {deployment.tp}"
                + (f" x --pipeline-parallel-size {deployment.pp}" if deployment.pp > 1 else "")
                + ": "
                f"the engine takes {deployment.gpus} GPUs (or plan DP sizes with --gpus N --plan-dp)"
            )
        args.gpus = deployment.gpus
        # The engine's policy: the --engine-cmd line's or the one --policies names (it was
        # --plan-policy's, vllm by default, whatever the line said)
        engine = None
        if commands or args.policies is not None:
            if len(policies) != 1:
                raise CliError(
                    f"--data-parallel-size {deployment.dp}: tune finds one DP engine's capacity; give one "
                    f"policy, not {len(policies)}"
                )
            engine = policies[0]
        return run_plan(args, deployment, config.workload, config.slo, deployment_line(built), engine)
    if args.gpus is not None:
        return run_plan(args, deployment, config.workload, config.slo, deployment_line(built))
    # A workload without a rate to search is refused before a results file is made or named.
    RateScaler.of(RunSpec(config.deployment, config.workload, config.policies[0]))
    if args.valve and not ttft_terms(config.slo):
        raise CliError("--valve needs a TTFT tail bound in --slo (e.g. ttft_p99=2s)")
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
            valves = _valves(config, sweep) if args.valve else []
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
        write_json(args.json, {**tune_json(result), **({"valves": valves} if args.valve else {})})
    return 0


def _valves(config: TuneConfig, sweep: Any) -> list[dict[str, Any]]:
    """``--valve``: each vllm / sglang policy's admission valve at the workload's rate, printed."""
    from tailserve.tune.valve import VALVES, valve_json, valve_steps

    specs = [s for s in config.policies if s.name in VALVES]
    skipped = [s.label for s in config.policies if s.name not in VALVES]
    if skipped:
        print(f"valve: none simulated for {', '.join(skipped)} (vllm and sglang have one)")
    scalers = [
        RateScaler.of(RunSpec(config.deployment, config.workload, s, options=config.options)) for s in specs
    ]
    found = sweep.drive(
        [valve_steps(sc, s, config.slo, config.rel_tol) for sc, s in zip(scalers, specs)], "valve"
    )
    out = []
    for scaler, valve in zip(scalers, found):
        print(valve.line(scaler.rate))
        out.append(valve_json(valve, scaler.rate))
    return out


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
    header = [name.replace("\n", " ") for name in CAPACITY_HEADER]
    capacity = (
        header,
        capacity_rows(result, wrap=False),
        [*ceiling_lines(result), *transient_warnings(result)],
    )
    path = write_report(
        out_dir, runs, title=title, sweep_curves=curves, explanation=explanations, capacity=capacity
    )
    print(f"report: {path}", file=sys.stderr)
