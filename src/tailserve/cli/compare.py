"""``tailserve compare``: several policies on the same deployment and workload, a table and a
paragraph saying what the numbers mean (with no arguments: the seed essay's scenario). Engine
launch lines (``--engine-cmd``, once per line) are compared as they are, each run labelled by
its engine and version, before any ``--policies``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tailserve.cli.base import CliError, write_json
from tailserve.cli.engine_cmd import add_engine_cmd_args, read_engine_cmds
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
from tailserve.cli.run_outputs import add_run_outputs, run_outputs, say_rejections
from tailserve.cli.sweep_options import add_sweep_args, check_sweep_args, make_sweep
from tailserve.executors.simulated.deployment import build_cost_model
from tailserve.metrics.summary import Slo
from tailserve.policies.registry import PolicySpec
from tailserve.report.compare_text import compare_paragraph
from tailserve.report.tables import print_runs
from tailserve.sim.run_file import RunResult
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

# The essay's engines side by side: Orca, vLLM V0, vLLM V1 at two budgets, Sarathi, SGLang, TGI.
DEFAULT_COMPARE_POLICIES = "orca,vllm-v0,vllm,vllm:max_num_batched_tokens=8192,sarathi,sglang,tgi,trtllm"
# Under pipeline stages: those simulated there, vLLM at a second budget in place of its H100 default
DEFAULT_COMPARE_POLICIES_PP = "orca,vllm-v0,vllm,vllm:max_num_batched_tokens=2048,sarathi,trtllm"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="several policies on the same deployment and workload (default: the seed essay's scenario)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma list, each NAME[:flag=value...] (default: {DEFAULT_COMPARE_POLICIES}; with --engine-cmd, "
        "none: the engine lines only)",
    )
    add_deployment_args(p)
    add_workload_args(p)
    add_output_args(p)
    add_sweep_args(p)
    add_run_outputs(p, simulate=False)
    add_engine_cmd_args(p, several=True)
    p.set_defaults(run=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    dp_refused = (
        "runs in `tailserve simulate`, `cost` and `tune` (one DP engine, or --gpus N --plan-dp); "
        "`compare` prices one engine"
    )
    if getattr(args, "dp", 1) > 1:
        raise CliError(f"--data-parallel-size {dp_refused}")
    from tailserve.policies.registry import parse_policy_list, under_stages

    check_sweep_args(args)  # before the notes and the workload
    commands = read_engine_cmds(args)  # --engine-cmd: their policies, and the deployment they share
    if getattr(args, "dp", 1) > 1:
        # A line's DP set args.dp only now: its ranks would run here as one engine with all the
        # traffic (compare's runs are single engines), not as the DP group they are.
        raise CliError(f"the engine commands' data parallelism (DP {args.dp}) {dp_refused}")
    built = build_cost_model(deployment_from(args))
    print_notes(built)
    listed = args.policies if args.policies is not None else "" if commands else DEFAULT_COMPARE_POLICIES
    if args.policies is None and not commands and built.cost_model.pipeline is not None:
        # The defaults simulated under stages (policies/registry.py), those of Sarathi-Serve's
        # engine only where the stages divide the layers (as Sarathi-Serve requires).
        pp, layers = built.cost_model.pipeline.pp, built.cost_model.model.num_layers
        listed = ",".join(under_stages(DEFAULT_COMPARE_POLICIES_PP, layers, pp))
        print(
            f"note: --pipeline-parallel-size {pp}: comparing {listed.replace(',', ', ')} (the policies simulated "
            "under pipeline stages"
            + (
                f"; Sarathi-Serve's engine needs the layers ({layers}) divisible by the stages"
                if layers % pp
                else ""
            )
            + ")",
            file=sys.stderr,
        )
    # An explicit empty --policies is parsed (and refused) unless --engine-cmd lines fill the table.
    specs = [command.spec for command in commands] + (
        parse_policy_list(listed) if listed or not commands else []
    )
    workload = WorkloadBuilder(workload_from(args))
    slo = parse_slo(args.slo)
    runs = compare_runs(args, specs, workload.spec, slo)
    for run, command in zip(runs, commands):
        run.label = f"{command.label}: {run.label}"
    summaries = [r.summary(slo) for r in runs]
    for note in dict.fromkeys(n for r in runs for n in r.notes):
        print(f"note: {note}", file=sys.stderr)
    own = kernels_note(runs)
    if own:
        print(f"note: {own}", file=sys.stderr)
    print_runs(runs, summaries, built, workload.spec)
    say_rejections(runs, summaries)
    print()
    print(compare_paragraph(runs, summaries, built, workload.spec))
    run_outputs(args, runs, f"tailserve compare: {workload.spec.label}")
    if args.json:
        write_json(args.json, {"runs": [{"label": r.label, **s} for r, s in zip(runs, summaries)]})
    return 0


def compare_runs(
    args: argparse.Namespace, specs: list[PolicySpec], workload: WorkloadSpec, slo: Slo | None
) -> list[RunResult]:
    """``compare``'s runs through the sweep backend. They come back whole (``keep_run``): the
    paragraph and reports read per-request timestamps, not only the summaries."""
    from tailserve.tune.sweep import RunSpec

    run_specs = [
        RunSpec(deployment_from(args), workload, spec, slo, engine_options(args), keep_run=True)
        for spec in specs
    ]
    with make_sweep(args) as sweep:
        outcomes = sweep.run(run_specs, "compare")
    for outcome in outcomes:
        if outcome.error is not None:
            raise ValueError(outcome.error)
    return [outcome.run for outcome in outcomes if outcome.run is not None]


def kernels_note(runs: list[RunResult]) -> str:
    """The rows another engine's kernel set priced (``--kernels auto``: the policy's engine), so a
    row that differs by its GEMMs rather than its scheduling says so; "" when every row is vLLM's."""
    from tailserve.executors.simulated.hardware import ENGINE_NAMES

    own = [f"{r.label} ({ENGINE_NAMES[r.config['kernels']]}'s)" for r in runs if r.config.get("kernels")]
    if not own:
        return ""
    return (
        f"rows priced with their own engine's GEMM and fused-MoE kernels: {', '.join(own)}; the others "
        "with vLLM's (--kernels vllm prices every row with vLLM's)"
    )
