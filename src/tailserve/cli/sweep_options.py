"""The sweep options (``--workers``, ``--ray``, ``--quiet``) ``compare`` and ``tune`` share, and
the ``Sweep`` they make."""

from __future__ import annotations

import argparse

from tailserve.cli.base import CliError
from tailserve.tune.sweep import ResultsFile, Sweep, make_backend


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="local worker processes (default: the CPU count; 1 runs in this process)",
    )
    g.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run on Ray: 'auto' attaches to this machine's Ray or starts one, else a cluster address",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def make_sweep(args: argparse.Namespace, results: ResultsFile | None = None) -> Sweep:
    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    return Sweep(make_backend(args.workers, args.ray), results, quiet=args.quiet)
