"""``tailserve simulate``: one policy, its flags by the engine's own names, on a simulated
deployment; the table, and optionally JSON, the iteration log, the explanation, the saved run."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from tailserve.cli.base import CliError, write_json
from tailserve.cli.cluster import add_cluster_arguments, cluster_requested, run_cluster, run_data_parallel
from tailserve.cli.engine_cmd import add_engine_cmd_args, apply_engine_cmd
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
from tailserve.cli.run_outputs import add_run_outputs, run_outputs
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
    add_run_outputs(p, simulate=True)
    add_cluster_arguments(p)
    add_engine_cmd_args(p)
    add_policy_flags(p, default_policy="vllm")  # last: its groups follow the command's own


def cmd_simulate(args: argparse.Namespace) -> int:
    apply_engine_cmd(args)  # --engine-cmd: the policy, its flags and the deployment from a launch line
    if args.dp > 1:  # the engine's DP ranks: docs/cost_model.md, cluster/dp_group.py
        return run_data_parallel(args)
    if cluster_requested(args):  # --replicas, --cluster or a P/D split: docs/cluster.md
        return run_cluster(args)
    from tailserve.policies.registry import PolicySpec

    spec = PolicySpec.make(args.policy, args.policy_flags)
    built = build_cost_model(deployment_from(args))
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
    summary.update(run_outputs(args, [run], f"tailserve simulate: {run.label}, {workload.spec.label}"))
    if args.json:
        write_json(args.json, {"label": run.label, **summary})
    if args.iterations:
        run.log.write_jsonl(args.iterations)
    return 0
