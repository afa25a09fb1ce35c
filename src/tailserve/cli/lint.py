"""``tailserve lint "COMMAND"``: an engine launch line read as the named engine version reads
it — each flag's verdict (scheduling, deployment, no-op, not modelled, other, refused, unknown),
what it does and the engine source line or issue that says so, the conflicts that stop the
engine, and the tailserve policy that schedules like it. Exit 0, or 1 when the engine would not
start with the line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from tailserve.cli.base import CliError, write_json
from tailserve.engines.flag_spec import FATAL, NO_OP
from tailserve.engines.lint import ENGINE_NAMES, VERSIONS, Report, lint

_STYLE = {"no-op": "yellow", "refused": "red", "unknown": "red", "not modelled": "cyan", "other": "dim"}


def add_parser(sub: Any) -> None:
    versions = "; ".join(
        f"{ENGINE_NAMES[e]} {', '.join(v.version for v in vs)}" for e, vs in VERSIONS.items()
    )
    p = sub.add_parser(
        "lint",
        help="what each flag of an engine launch line does, which do nothing, which conflict (exit 1 "
        "when the engine would not start)",
        description="Read a vLLM, SGLang or TensorRT-LLM launch line as the named engine version reads it. "
        "Exit status: 0, or 1 when the engine would refuse the line (a conflict or a flag it does not take).",
    )
    p.add_argument(
        "engine_command",
        metavar="COMMAND",
        nargs="?",  # taken from --json's value when it swallowed the line (settle_lint_args)
        help='the launch line, quoted: "vllm serve MODEL --max-num-batched-tokens 2048", '
        '"python -m sglang.launch_server --model-path MODEL ...", "trtllm-serve MODEL ..."',
    )
    p.add_argument(
        "--engine-version",
        metavar="V",
        default=None,
        help=f"the engine's version (default: the newest tailserve has, TensorRT-LLM 1.2.1; {versions})",
    )
    p.add_argument(
        "--json",
        metavar="OUT",
        nargs="?",
        const="-",
        help="write the verdicts as JSON to OUT (to stdout, instead of the table, without OUT)",
    )
    p.set_defaults(run=cmd_lint, settle_args=settle_lint_args)


def settle_lint_args(args: argparse.Namespace) -> None:
    """``lint --json "vllm serve M"``: argparse gives --json's optional OUT the next word, the
    launch line, and leaves COMMAND empty. Without a COMMAND there is nothing to write to an OUT,
    so that word is the line and the JSON goes to stdout (read before the output paths are
    checked: the line is not a file name)."""
    if args.engine_command is not None:
        return
    if args.json in (None, "-"):
        raise CliError('no launch line: tailserve lint "vllm serve MODEL ..." [--json [OUT]]')
    args.engine_command, args.json = args.json, "-"


def cmd_lint(args: argparse.Namespace) -> int:
    report = lint(args.engine_command, args.engine_version)
    if args.json == "-":
        print(json.dumps(to_json(report), indent=1))
    else:
        print_report(report)
        if args.json:
            write_json(args.json, to_json(report), indent=1)
    return 1 if report.refused else 0


def print_report(report: Report) -> None:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    engine = f"{ENGINE_NAMES[report.engine]} {report.version.version}"
    table = Table(title=f"{engine} ({report.version.source}): {report.launch.entry}", title_justify="left")
    for column in ("flag", "value", "verdict", "what it does", "source"):
        table.add_column(column, overflow="fold")
    for row in report.rows:
        style = _STYLE.get(row.verdict, "")
        table.add_row(row.flag, _show(row.value), row.verdict, row.what, row.source, style=style)
    console.print(table)
    for finding in report.conflicts:
        flags = ", ".join(report.version.option(f) for f in finding.flags)
        console.print(f"[red]conflict[/red] {flags}: {finding.what} ({finding.source})")
    quiet = [row.flag for row in report.rows if row.verdict == NO_OP]
    if quiet:
        console.print(f"do nothing in {engine}: {', '.join(quiet)}")
    policy = f"tailserve policy: {report.policy}" + (f" — {report.policy_why}" if report.policy_why else "")
    console.print(policy)
    if report.refused:
        fatal = len([r for r in report.rows if r.verdict in FATAL]) + len(report.conflicts)
        console.print(
            f"[red]{engine} would not start with this line[/red] ({fatal} problem{'s' * (fatal > 1)})"
        )


def to_json(report: Report) -> dict[str, Any]:
    return {
        "engine": report.engine,
        "version": report.version.version,
        "model": report.model,
        "policy": report.policy,
        "policy_why": report.policy_why,
        "refused": report.refused,
        "flags": [
            {
                "flag": r.flag,
                "name": r.name,
                "value": r.value,
                "verdict": r.verdict,
                "what": r.what,
                "source": r.source,
            }
            for r in report.rows
        ],
        "conflicts": [{"flags": list(f.flags), "what": f.what, "source": f.source} for f in report.conflicts],
        "unread": list(report.unread),  # options files the line names that are not there
    }


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "" if value is None else str(value)
