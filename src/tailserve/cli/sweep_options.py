"""The sweep options (``--workers``, ``--ray-address``, ``--quiet``) ``compare`` and ``tune``
share, and the ``Sweep`` they make."""

from __future__ import annotations

import argparse

from tailserve.cli.base import CliError
from tailserve.tune.backends import usable_cpus
from tailserve.tune.sweep import ResultsFile, Sweep, make_backend


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"local worker processes, or the CPUs of --ray-address local (default: the usable CPUs, "
        f"here {usable_cpus()}; 1 runs in this process)",
    )
    g.add_argument(
        "--ray-address",
        "--ray",
        dest="ray",
        metavar="ADDRESS",
        default=None,
        help="run on Ray: 'local' starts a Ray of --workers CPUs for this command, 'auto' attaches to "
        "this machine's Ray or starts one, HOST:PORT or ray://HOST:PORT names a cluster",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def check_sweep_args(args: argparse.Namespace) -> None:
    """The sweep options alone, read first: a command that found them wrong only when it made
    its sweep had already printed its results file and notes."""
    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    if args.ray not in (None, "local") and args.workers is not None:
        raise CliError(
            f"--workers {args.workers} with --ray-address {args.ray}: a running Ray runs as many runs "
            "at a time as it has CPUs; --workers sizes the local pool or --ray-address local"
        )


def make_sweep(args: argparse.Namespace, results: ResultsFile | None = None) -> Sweep:
    check_sweep_args(args)
    try:
        backend = make_backend(args.workers, args.ray)
    except ValueError as error:
        raise CliError(str(error)) from None
    return Sweep(backend, results, quiet=args.quiet)
