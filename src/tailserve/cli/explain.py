"""``tailserve explain RUN.json``: a run saved with ``simulate --save-run`` (requests with their
timestamps and the batch record), every request's TTFT and every long inter-token gap split into
causes, the slowest requests, the worst stalls and what to set (rules in docs/explain.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tailserve.cli.base import write_json
from tailserve.cli.run_outputs import add_explain_options, print_explanation, tbt_threshold
from tailserve.metrics.attribution import explain_run
from tailserve.sim.run_file import load_run


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="why requests were slow: TTFT and inter-token stalls of a saved run split into causes",
    )
    p.add_argument("run_json", metavar="RUN.json", help="a run written by tailserve simulate --save-run")
    add_explain_options(p)
    p.add_argument("--json", metavar="OUT", help="write the attribution of every request as JSON")
    p.add_argument("--report", metavar="DIR", help="also write PNG plots and index.html into DIR")
    p.set_defaults(run=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    threshold = tbt_threshold(args)
    run = load_run(args.run_json)
    if run.batches is None:
        raise ValueError(
            f"{args.run_json} has no batch record; save the run with tailserve simulate --save-run"
        )
    x = explain_run(run, threshold)
    print_explanation(x, args.top)
    if args.json:
        write_json(args.json, x.to_json(), indent=1)
    if args.report:
        from tailserve.report.html import write_report

        path = write_report(args.report, [run], title=f"tailserve explain: {run.label}", explanation=x)
        print(f"report: {path}", file=sys.stderr)
    return 0
