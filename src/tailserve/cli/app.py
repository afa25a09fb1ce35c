"""The ``tailserve`` command: one parser, a subcommand per module, one-line errors.

Each command module has ``add_parser(sub)``, which adds its subparser and sets ``run`` (the
function ``main`` calls with the parsed arguments) and, for commands that take one policy's
flags by their engine names, ``takes_policy_flags``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tailserve import __version__
from tailserve.cli import (
    bench,
    calibrate,
    catalog,
    compare,
    cost,
    explain,
    model,
    router,
    run,
    serve,
    simulate,
    tune,
)
from tailserve.cli.base import POLICY_FLAGS_EPILOG, CliError, OneLineParser, policy_help
from tailserve.cli.policy_flags import parse_policy_flags


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="tailserve",
        description="Why does p99 TTFT spike? Serving policies side by side on a simulated GPU.",
    )
    parser.add_argument("--version", action="version", version=f"tailserve {__version__}")
    sub = parser.add_subparsers(dest="command")
    compare.add_parser(sub)
    simulate.add_parser(sub)
    cost.add_parser(sub)
    calibrate.add_parser(sub)
    catalog.add_parsers(sub)  # policies, models, hardware
    explain.add_parser(sub)
    tune.add_parser(sub)
    model.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    run.add_parser(sub)
    router.add_parser(sub)
    for name in ("serve", "run"):  # their modules build the parsers; what is shared is set here:
        sub.choices[name].epilog = POLICY_FLAGS_EPILOG  # the policy-flags epilog
        _option(sub.choices[name], "--policy").help = policy_help()  # the registry's policy names
    parser.command_names = tuple(sub.choices)
    return parser


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["compare"]
    if argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        commands = ", ".join(parser.command_names)
        print(
            f"tailserve: error: {argv[0]} is an option of a command: name the command first, e.g. "
            f"{_command_first(argv, parser.command_names)} (commands: {commands})",
            file=sys.stderr,
        )
        return 2
    args, extra = parser.parse_known_args(argv)
    if os.environ.get("TAILSERVE_CPU_ISA"):
        # A forced CPU level also lowers PyTorch's own kernel dispatch, which it reads once (the
        # import is here: the simulator's commands never load the torch executor's package).
        from tailserve.executors.pytorch import cpu_isa

        cpu_isa.apply_forced_level()
    try:
        if extra and not getattr(args, "takes_policy_flags", False):
            raise CliError(f"unrecognized argument{'s' if len(extra) > 1 else ''} {' '.join(extra)}")
        if getattr(args, "takes_policy_flags", False):
            parse_policy_flags(extra, args.policy)  # unknown or value-less flags: one line, now
        args.extra = extra  # a command with takes_policy_flags reads them with parse_policy_flags
        command = getattr(args, "run", None)
        if command is None:
            parser.print_help()
            return 2
        return command(args)
    except (CliError, ValueError) as e:
        print(f"tailserve: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tailserve: error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2


def _command_first(argv: list[str], commands: Sequence[str]) -> str:
    """The command line with the options before its command moved after it: ``--model M
    compare`` -> ``tailserve compare --model M`` (a suggestion that runs as printed, not one with
    the command twice); the words from the command on keep their order, so ``--out D model init``
    -> ``tailserve model init --out D``. ``compare`` when no command is named."""
    named = next((i for i, word in enumerate(argv) if word in commands), None)
    if named is None:
        return " ".join(["tailserve", "compare", *argv])
    return " ".join(["tailserve", *argv[named:], *argv[:named]])
