"""``tailserve policies`` (every policy's flags and its engine's defaults for a GPU), ``tailserve
models`` and ``tailserve hardware`` (the catalogs)."""

from __future__ import annotations

import argparse
from typing import Any

from tailserve.cli.base import CliError, default_of
from tailserve.executors.simulated.deployment import Deployment


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("policies", help="every policy with its flags and its engine's defaults for a GPU")
    p.add_argument(
        "--hardware",
        default=default_of(Deployment, "hardware"),
        help="GPU whose defaults to show (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        default=default_of(Deployment, "model"),
        help="model whose context length to assume (default: %(default)s)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.set_defaults(run=cmd_policies)
    sub.add_parser("models", help="list the model catalog").set_defaults(run=cmd_catalog)
    sub.add_parser("hardware", help="list the hardware catalog").set_defaults(run=cmd_catalog)


def cmd_policies(args: argparse.Namespace) -> int:
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.executors.simulated.models import get_model
    from tailserve.report.tables import print_policies

    if args.max_model_len is not None and args.max_model_len < 1:  # the default budget derives from it
        raise CliError(f"--max-model-len must be >= 1 token, got {args.max_model_len}")
    hardware = get_hardware(args.hardware)
    model = get_model(args.model)
    print_policies(
        hardware, model.max_position_embeddings if args.max_model_len is None else args.max_model_len
    )
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    from tailserve.report.tables import print_hardware, print_models

    if args.command == "models":
        print_models()
    else:
        print_hardware()
    return 0
