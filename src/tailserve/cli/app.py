"""The ``tailserve`` command: one parser, a subcommand per module, one-line errors.

Each command module has ``add_parser(sub)``, which adds its subparser and sets ``run`` (the
function ``main`` calls with the parsed arguments); a command that takes one policy's flags by
their engine names adds them with ``policy_flags.add_policy_flags`` (generated from the policies'
config dataclasses), and ``main`` checks them against ``--policy`` once, into
``args.policy_flags``. The command line is parsed once.
"""

from __future__ import annotations

import difflib
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
    lint,
    model,
    router,
    run,
    serve,
    simulate,
    tune,
)
from tailserve.cli.base import CliError, OneLineParser, check_output_paths
from tailserve.cli.options import check_workload_options
from tailserve.cli.policy_flags import flag_owners, policy_flags_from


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
    lint.add_parser(sub)
    model.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    run.add_parser(sub)
    router.add_parser(sub)
    parser.command_names = tuple(sub.choices)
    parser.commands = dict(sub.choices)
    return parser


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
        if extra:
            raise CliError(_unrecognized(extra, parser.commands.get(args.command)))
        if hasattr(args, "workload"):
            check_workload_options(args)  # before any work: an option the workload would ignore
        settle = getattr(args, "settle_args", None)
        if settle is not None:
            settle(args)  # a command's own reading of its arguments (lint --json "LINE")
        check_output_paths(args)  # before any work: its results are not lost at the end
        if getattr(args, "takes_policy_flags", False):
            args.policy_flags = policy_flags_from(args)  # a flag --policy lacks: one line, now
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


def _unrecognized(extra: list[str], command: OneLineParser | None) -> str:
    """``unrecognized argument --bogus`` (the options among ``extra``, else all of it), with the
    command's nearest option when one is close."""
    named = [word for word in extra if word.startswith("-")] or extra
    text = f"unrecognized argument{'s' if len(named) > 1 else ''} {' '.join(named)}"
    if command is None or not named[0].startswith("--"):
        return text
    options = [s for a in command._actions for s in a.option_strings if s.startswith("--")]
    flag = named[0].partition("=")[0][2:].removeprefix("no-").replace("-", "_")
    owners = flag_owners(flag)
    if owners and "--policies" in options:  # compare, tune: flags go in the policy list
        return (
            text + f" (a flag of {', '.join(owners)}: give it in --policies, e.g. {owners[0]}:{flag}=VALUE)"
        )
    if owners:
        return (
            text
            + f" (a flag of {', '.join(owners)}; tailserve {command.prog.split()[-1]} takes no policy flags)"
        )
    if named[0].partition("=")[0] == "--dtype" and "--quantization" in options:
        # vLLM's --dtype is the activations' type; users reach for it to say FP8 or FP4.
        return text + (
            " (a GPU's activations are priced in 16 bits here; the weights' number format is "
            "--quantization, e.g. --quantization fp8, and the KV cache's --kv-cache-dtype fp8)"
        )
    close = difflib.get_close_matches(named[0].partition("=")[0], options, n=1)
    return text + (f" (did you mean {close[0]}?)" if close else "")


def _command_first(argv: list[str], commands: Sequence[str]) -> str:
    """The command line with the options before its command moved after it: ``--model M
    compare`` -> ``tailserve compare --model M`` (a suggestion that runs as printed, not one with
    the command twice); the words from the command on keep their order, so ``--out D model init``
    -> ``tailserve model init --out D``. ``compare`` when no command is named."""
    named = next((i for i, word in enumerate(argv) if word in commands), None)
    if named is None:
        return " ".join(["tailserve", "compare", *argv])
    return " ".join(["tailserve", *argv[named:], *argv[:named]])
