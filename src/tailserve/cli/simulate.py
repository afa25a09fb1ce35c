"""``tailserve simulate``: one policy, its flags by the engine's own names, on a simulated
deployment; the table, and optionally JSON, the iteration log, the explanation, the saved run."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tailserve.cli.base import POLICY_FLAGS_EPILOG, write_json
from tailserve.cli.cluster import add_cluster_arguments, cluster_requested, run_cluster
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
from tailserve.cli.policy_flags import parse_policy_flags
from tailserve.cli.run_outputs import add_run_outputs, run_outputs
from tailserve.report.tables import print_runs
from tailserve.sim.deployment import build_cost_model
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="one policy; its flags follow with the engine's own names, e.g. --max-num-batched-tokens 512",
        epilog=POLICY_FLAGS_EPILOG,
    )
    p.add_argument(
        "--policy",
        default="vllm",
        help="static | orca | vllm-v0 | vllm | sarathi | sglang | tgi (default: %(default)s)",
    )
    p.set_defaults(run=cmd_simulate, takes_policy_flags=True)
    add_deployment_args(p)
    add_workload_args(p)
    add_output_args(p)
    p.add_argument("--iterations", metavar="OUT.jsonl", help="write the per-iteration log as JSON lines")
    add_run_outputs(p, simulate=True)
    add_cluster_arguments(p)


def cmd_simulate(args: argparse.Namespace) -> int:
    if cluster_requested(args):  # --replicas, --cluster or a P/D split: docs/cluster.md
        return run_cluster(args)
    from tailserve.policies.registry import PolicySpec

    spec = PolicySpec.make(args.policy, parse_policy_flags(args.extra))
    built = build_cost_model(deployment_from(args))
    print_notes(built)
    workload = WorkloadBuilder(workload_from(args))
    slo = parse_slo(args.slo)
    run = run_policy(built, spec, workload, options=engine_options(args))
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
