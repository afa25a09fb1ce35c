"""The ``--explain`` / ``--save-run`` / ``--report`` outputs of ``simulate`` and ``compare`` (and
the explanation tables ``tailserve explain`` prints): each request's TTFT and long inter-token
gaps split into causes (``metrics.attribution``), the slowest requests, the worst stalls and a
paragraph saying what dominates the tail and which flag addresses it.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from typing import Any

from rich.table import Table

from tailserve.cli.base import CliError, write_json
from tailserve.metrics.attribution import (
    CAUSE_SHORT,
    TBT_CAUSES,
    TTFT_CAUSES,
    Breakdown,
    RunExplanation,
    explain_run,
)
from tailserve.sim.run_file import RunResult


# ---- options ----------------------------------------------------------------------------------
def add_explain_options(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--top", type=int, default=10, help="slowest requests and stalls to show (default: %(default)s)"
    )
    p.add_argument(
        "--tbt-threshold",
        type=float,
        default=None,
        metavar="MS",
        help="inter-token gaps above this many ms count as stalls "
        "(default: the run's p99 gap or 3x its median, whichever is larger)",
    )


def add_run_outputs(p: argparse.ArgumentParser, *, simulate: bool) -> None:
    """``--report`` (simulate, compare); ``--explain`` and ``--save-run`` (simulate)."""
    g = p.add_argument_group("explain and report")
    if simulate:
        g.add_argument(
            "--explain",
            action="store_true",
            help="split each request's TTFT and long inter-token gaps into causes and say what to set",
        )
        add_explain_options(g)
        g.add_argument(
            "--save-run",
            metavar="OUT.json",
            help="write the whole run (requests, batch record) for tailserve explain",
        )
    g.add_argument("--report", metavar="DIR", help="write PNG plots and a self-contained index.html into DIR")


def wants_batches(args: argparse.Namespace) -> bool:
    """Record who ran in each iteration: only when an output here needs it (it costs memory)."""
    if getattr(args, "command", None) not in ("simulate", "compare"):
        return False
    return bool(
        getattr(args, "explain", False) or getattr(args, "save_run", None) or getattr(args, "report", None)
    )


def tbt_threshold(args: argparse.Namespace) -> float | None:
    if getattr(args, "top", 10) < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    ms = getattr(args, "tbt_threshold", None)
    if ms is None:
        return None
    if not 0 <= ms < math.inf:  # NaN fails every comparison: it flagged no gap, said "nan ms"
        raise ValueError(f"--tbt-threshold must be >= 0 ms and finite, got {ms}")
    return ms / 1e3


# ---- printing ---------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.1 else f"{seconds * 1e3:,.1f}"


def _blockers(b: Breakdown, n: int = 1) -> str:
    shown = [f"{bl.request_id} ({bl.prompt_len:,} tok, {_ms(bl.seconds)} ms)" for bl in b.blockers[:n]]
    return ", ".join(shown) + (f" +{len(b.blockers) - n}" if len(b.blockers) > n else "") or "-"


def _table(title: str, rows: list[Breakdown], causes: tuple[str, ...], stalls: bool) -> Table:
    shown = [c for c in causes if any(b.components[c] > 0 for b in rows)]
    table = Table(title=title, title_justify="left")
    table.add_column("request", overflow="fold")
    table.add_column("prompt\ntokens", justify="right")
    if stalls:
        table.add_column("token\n#", justify="right")
    table.add_column("gap ms" if stalls else "TTFT ms", justify="right")
    for c in shown:
        table.add_column(CAUSE_SHORT[c] + "\nms", justify="right", max_width=16)
    if not stalls:
        table.add_column("prefill\niters", justify="right")
    table.add_column("top blocker (prompt, time charged)", overflow="fold", max_width=40)
    for b in rows:
        row = [b.request_id, f"{b.prompt_len:,}"]
        if stalls:
            row.append(str(b.token_index))
        row.append(_ms(b.seconds))
        row += [_ms(b.components[c]) if b.components[c] > 0 else "" for c in shown]
        if not stalls:
            row.append(str(b.num_prefill_chunks))
        row.append(_blockers(b))
        table.add_row(*row)
    return table


def print_explanation(x: RunExplanation, top: int) -> None:
    from tailserve.report.tables import console

    if x.ttft:
        console.print(
            _table(
                f"{x.label}: the {min(top, len(x.ttft))} slowest requests by TTFT",
                x.ttft[:top],
                TTFT_CAUSES,
                False,
            )
        )
    if x.stalls:
        title = (
            f"{x.label}: the {min(top, len(x.stalls))} longest of {len(x.stalls)} inter-token gaps above "
            f"{_ms(x.tbt_threshold)} ms"
        )
        console.print(_table(title, x.stalls[:top], TBT_CAUSES, True))
    print()
    print(textwrap.fill(x.summary, width=100))


def say_rejections(runs: list[RunResult], summaries: list[dict[str, Any]]) -> None:
    """Why requests were turned away, in a note (the table only counts them in done/rej): vLLM
    answers such a request 400 and never schedules it. When every run served nothing because
    every request was rejected, the numbers are dashes: that is an error, as in ``bench``."""
    reasons = []
    for run, s in zip(runs, summaries):
        rejected = s["num_rejected"]
        if not rejected:
            continue
        # One example per kind of reason, each counted when there are several kinds. Streamed
        # metrics keep no requests, so no reason; the count still shows.
        kinds = run.rejected_by_kind()
        examples = [f"(e.g. {rs[0].request_id}: {rs[0].status_reason})" for rs in kinds.values()]
        if len(kinds) > 1:
            why = ": " + "; ".join(f"{len(rs)} {k} {e}" for (k, rs), e in zip(kinds.items(), examples))
        else:
            why = "".join(f" {e}" for e in examples)
        reasons.append((run.label, rejected, s["num_requests"], s["num_finished"], why))
    if reasons and len(reasons) == len(runs) and all(r[1] == r[2] and not r[3] for r in reasons):
        label, rejected, _, _, why = reasons[0]
        raise CliError(f"all {rejected:,} requests were rejected, nothing was served{why}")
    for label, rejected, total, _, why in reasons:
        print(f"note: {label}: {rejected:,} of {total:,} requests rejected{why}", file=sys.stderr)


# ---- after simulate / compare, and the explain command ----------------------------------------
def run_outputs(args: argparse.Namespace, runs: list[RunResult], title: str) -> dict[str, Any]:
    """The explanation, the saved run and the report, once ``simulate``/``compare`` printed their
    tables; returns what ``simulate --json`` adds (``{"explanation": ...}`` with ``--explain``)."""
    extra: dict[str, Any] = {}
    explanations: list[RunExplanation] = []
    if getattr(args, "explain", False):
        threshold = tbt_threshold(args)
        for run in runs:
            x = explain_run(run, threshold)
            print()
            print_explanation(x, args.top)
            explanations.append(x)
        extra["explanation"] = (
            explanations[0].to_json() if len(explanations) == 1 else [x.to_json() for x in explanations]
        )
    if getattr(args, "save_run", None):
        for run in runs:
            write_json(args.save_run, run.to_json(), indent=None)  # 100s of MB: compact
    if getattr(args, "report", None):
        from tailserve.report.html import write_report

        if not explanations:
            explanations = [explain_run(run) for run in runs if run.batches is not None]
        path = write_report(args.report, runs, title=title, explanation=explanations)
        print(f"report: {path}", file=sys.stderr)
    return extra
