"""``tailserve simulate``: one policy, its flags by the engine's own names, on a simulated
deployment; the table, and optionally JSON, the iteration log, the explanation, the saved run."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from tailserve.cli.base import CliError, write_json
from tailserve.cli.cluster import add_cluster_arguments, cluster_requested, run_cluster, run_data_parallel
from tailserve.cli.engine_cmd import (
    add_engine_cmd_args,
    add_pd_engine_cmd_args,
    apply_engine_cmd,
    read_pd_engine_cmds,
)
from tailserve.cli.options import (
    add_deployment_args,
    add_output_args,
    add_workload_args,
    deployment_from,
    engine_options,
    parse_slo,
    print_notes,
    workload_from,
)
from tailserve.cli.policy_flags import add_policy_flags
from tailserve.cli.run_outputs import add_run_outputs, run_outputs, say_rejections
from tailserve.executors.simulated.deployment import build_cost_model
from tailserve.report.tables import print_runs
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder

# A built-in workload larger than this streams its metrics unless an output needs the requests
# (~10 KB a kept request: 200,000 of them are ~2 GB).
STREAM_ABOVE = 200_000


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="one policy; its flags follow with the engine's own names, e.g. --max-num-batched-tokens 512",
    )
    p.set_defaults(run=cmd_simulate)
    add_deployment_args(p)
    add_workload_args(p)
    add_output_args(p)
    p.add_argument("--iterations", metavar="OUT.jsonl", help="write the per-iteration log as JSON lines")
    p.add_argument(
        "--stream-metrics",
        action="store_true",
        help="bounded memory for very long runs: finished requests' metrics go into arrays and the "
        f"requests are dropped (no --explain/--save-run/--report); on by itself above "
        f"{STREAM_ABOVE:,} requests of a built-in workload",
    )
    p.add_argument(
        "--held-out",
        type=float,
        default=0.5,
        metavar="FRACTION",
        help="with a recorded --trace (bench or router --record-trace): the later part of the requests "
        "the replayed-vs-recorded table shows apart (default: %(default)s)",
    )
    add_run_outputs(p, simulate=True)
    add_cluster_arguments(p)
    add_engine_cmd_args(p)
    add_pd_engine_cmd_args(p)
    add_policy_flags(p, default_policy="vllm")  # last: its groups follow the command's own


def cmd_simulate(args: argparse.Namespace) -> int:
    # --prefill-/--decode-engine-cmd: each P/D side's policy and deployment from its launch line
    args.pd_lines = read_pd_engine_cmds(args)
    apply_engine_cmd(args)  # --engine-cmd: the policy, its flags and the deployment from a launch line
    if args.dp > 1:  # the engine's DP ranks: docs/cost_model.md, cluster/dp_group.py
        return run_data_parallel(args)
    if cluster_requested(args):  # --replicas, --cluster or a P/D split: docs/cluster.md
        return run_cluster(args)
    from tailserve.policies.registry import PolicySpec

    spec = PolicySpec.make(args.policy, args.policy_flags)
    built = build_cost_model(deployment_from(args), spec.name)
    print_notes(built)
    workload = WorkloadBuilder(workload_from(args))
    slo = parse_slo(args.slo)
    options = engine_options(args)
    needs_requests = options.record_batches
    if args.stream_metrics and needs_requests:
        raise CliError(
            "--stream-metrics keeps no requests: it cannot be combined with --explain, --save-run or --report"
        )
    big = workload.spec.name != "trace" and workload.spec.num_requests > STREAM_ABOVE
    if args.stream_metrics or (big and not needs_requests):
        options = replace(options, stream_finished=True)
    run = run_policy(built, spec, workload, options=options)
    summary = run.summary(slo)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    print_runs([run], [summary], built, workload.spec)
    say_rejections([run], [summary])
    if args.trace and not args.stream_metrics:
        from tailserve.workloads.recorded import has_measured

        if has_measured(args.trace):
            summary["twin"] = _compare_recording(args, run, built.calibration)
    summary.update(run_outputs(args, [run], f"tailserve simulate: {run.label}, {workload.spec.label}"))
    if args.json:
        write_json(args.json, {"label": run.label, **summary})
    if args.iterations:
        run.log.write_jsonl(args.iterations)
    return 0


def _compare_recording(args: argparse.Namespace, run: Any, calibration: str) -> dict[str, Any]:
    """The replay against what the recording measured (``sim/twin.py``), printed and returned;
    with ``--explain``, the recorded stalls with the twin's cause for each."""
    from rich.console import Console
    from rich.table import Table

    from tailserve.executors.simulated.calibration_files import request_overhead
    from tailserve.sim.twin import METRICS, compare_replay, relative_error
    from tailserve.workloads.recorded import load_measured

    recorded = load_measured(args.trace)
    if args.rate_scale != 1.0 or args.max_requests is not None:
        print(
            "note: --rate-scale / --max-requests change the replay: not compared with the recording",
            file=sys.stderr,
        )
        return {}
    overhead = request_overhead(calibration)
    twin = compare_replay(recorded, run.requests, overhead, args.held_out)
    title = (
        f"replayed vs recorded ({twin.num_compared} requests"
        + (f", {twin.num_failed} failed ones left out" if twin.num_failed else "")
        + (
            f"; +{overhead * 1e3:.1f} ms per request outside the engine, from the calibration"
            if overhead
            else ""
        )
        + ")"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    held = f"held out (arrivals >= {twin.split_arrival_s:.2f} s)"
    for part in ("all", held):
        for col in ("recorded", "replayed", "error"):
            table.add_column(f"{part}: {col}" if col == "recorded" else col, justify="right")
    for metric in METRICS:
        row = [metric]
        for part in (twin.all, twin.held_out):
            rec, rep = part["recorded"][metric], part["replayed"][metric]
            scale = 1.0 if metric == "output_tok_s" else 1e3  # seconds shown as ms
            row += [f"{rec * scale:.1f}", f"{rep * scale:.1f}", f"{relative_error(rep, rec):+.1%}"]
        table.add_row(*row)
    Console().print(table)
    body = twin.to_json()
    if run.batches is not None:
        body["stalls"] = _check_stalls(args, run, recorded)
    return body


def _check_stalls(args: argparse.Namespace, run: Any, recorded: list) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from tailserve.cli.run_outputs import tbt_threshold
    from tailserve.metrics.attribution import CAUSE_SHORT, Attributor
    from tailserve.sim.twin import check_stalls, measured_stall_threshold

    threshold = tbt_threshold(args)
    threshold = measured_stall_threshold(recorded) if threshold is None else threshold
    flags = run.config.get("policy_flags", {})
    checks = check_stalls(
        recorded, Attributor(run.requests, run.batches, run.config.get("policy", ""), flags), threshold
    )
    blamed = [c for c in checks if c.blockers]
    confirmed = sum(c.confirmed for c in blamed)
    table = Table(
        title=f"the recording's stalls (gaps > {threshold * 1e3:.0f} ms) and the twin's cause for each: "
        f"{len(checks)} stalls, {len(blamed)} put on other requests' prefill, {confirmed} of them confirmed "
        "(the blamed prompt was being computed while the gap was open in the recording)",
        title_justify="left",
    )
    for col in (
        "request",
        "token",
        "measured ms",
        "replayed ms",
        "twin's cause",
        "blamed prefill",
        "confirmed",
    ):
        table.add_column(col, justify="right" if "ms" in col or col == "token" else "left")
    for c in checks[: args.top]:
        table.add_row(
            c.request_id,
            str(c.token_index),
            f"{c.measured_s * 1e3:.0f}",
            f"{c.replayed_s * 1e3:.0f}",
            CAUSE_SHORT.get(c.cause, c.cause),
            ", ".join(c.blockers[:3]) or "-",
            "yes" if c.confirmed else ("no" if c.blockers else "-"),
        )
    Console().print(table)
    return {
        "threshold_s": threshold,
        "num_stalls": len(checks),
        "num_blamed_on_prefill": len(blamed),
        "num_confirmed": confirmed,
        "stalls": [c.to_json() for c in checks],
    }
