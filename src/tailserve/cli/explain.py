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


def check_recording(path: str, run: Any, top: int) -> Any:
    """The recording's stalls against the replay's explanation of the same gaps, printed."""
    from rich.console import Console
    from rich.table import Table

    from tailserve.fidelity.stall_check import check_stalls, seen_requests
    from tailserve.metrics.attribution import run_attributor
    from tailserve.workloads.recorded import load_measured

    pairs = load_measured(path)
    replayed = {r.request_id for r in run.requests}
    missing = [r.request_id for r, _ in pairs if r.request_id not in replayed]
    if missing:
        raise ValueError(
            f"{path} has {len(missing)} requests the run does not ({missing[0]}, ...): explain --measured "
            f"takes the recording the run replays (tailserve simulate --trace {path} --save-run RUN.json)"
        )
    seen = seen_requests(
        [r.request_id for r, _ in pairs],
        [r.arrival_time for r, _ in pairs],
        [r.prompt_len for r, _ in pairs],
        [m.ttft_s if m.success else None for _, m in pairs],
        [m.itl_s for _, m in pairs],
    )
    check = check_stalls(seen, run.requests, run_attributor(run))
    console = Console()
    console.print(f"against {path}: {check.summary()}")
    if check.matches:
        table = Table(title="the real run's longest stalls and the twin's explanation", title_justify="left")
        for col in (
            "request",
            "token",
            "real ms",
            "twin ms",
            "prefill in flight (real)",
            "twin's top blocker",
        ):
            table.add_column(col, justify="right" if "ms" in col or col == "token" else "left")
        for m in check.matches[:top]:
            table.add_row(
                m.request_id,
                str(m.token_index),
                f"{m.measured_s * 1e3:.1f}",
                "-" if m.twin_s is None else f"{m.twin_s * 1e3:.1f}",
                f"{m.measured_blocker[0]} ({m.measured_blocker[1]:,} tok)" if m.measured_blocker else "none",
                f"{m.twin_blocker[0]} ({m.twin_blocker[1]:,} tok)" if m.twin_blocker else "none",
            )
        console.print(table)
    return check


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="why requests were slow: TTFT and inter-token stalls of a saved run split into causes",
    )
    p.add_argument("run_json", metavar="RUN.json", help="a run written by tailserve simulate --save-run")
    add_explain_options(p)
    p.add_argument(
        "--measured",
        metavar="REC.jsonl",
        default=None,
        help="the recording RUN.json replays (simulate --trace REC.jsonl --save-run): check each "
        "stall the real engine showed against the twin's explanation of the same gap",
    )
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
    payload = x.to_json()
    if args.measured:
        check = check_recording(args.measured, run, args.top)
        payload["measured_stalls"] = check.to_json()
    if args.json:
        write_json(args.json, payload, indent=1)
    if args.report:
        from tailserve.report.html import write_report

        path = write_report(args.report, [run], title=f"tailserve explain: {run.label}", explanation=x)
        print(f"report: {path}", file=sys.stderr)
    return 0
