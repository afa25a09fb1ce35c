"""``tailserve calibrate``: fit the cost model to measured iteration times (``POINTS`` or a
preset), or, with ``--executor torch --model DIR``, profile the real executor on this host, fit
the cost model and write a calibration file (``--out``) that ``--calibration FILE`` loads."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from tailserve.cli.base import CliError, default_of, write_json
from tailserve.cli.options import add_deployment_args, deployment_from
from tailserve.executors.simulated.deployment import build_cost_model
from tailserve.llm.engine_args import DTYPES, EngineArgs
from tailserve.report.tables import print_calibration


def add_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model to measured iteration times")
    add_deployment_args(p)
    p.add_argument(
        "points", nargs="?", help="'prefill:4096=0.120,decode:10x1024=0.018' or a preset name (seed)"
    )
    p.add_argument("--json", metavar="OUT", help="write the fit as JSON")
    _add_torch_args(p)
    p.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    if getattr(args, "dp", 1) > 1:
        raise CliError(
            "--data-parallel-size runs in `tailserve simulate`, `cost` and `tune` (one DP engine, or "
            "--gpus N --plan-dp); `calibrate` prices one engine"
        )
    if args.executor == "torch":
        return cmd_calibrate_torch(args)
    if args.points is None:
        raise CliError("calibrate needs POINTS (or --executor torch --model DIR)")
    deployment = deployment_from(args)
    built = build_cost_model(replace(deployment, calibration=args.points))
    print_calibration(built)
    if args.json and built.fit is not None:
        fit = built.fit
        write_json(
            args.json,
            {
                "efficiency": {
                    k: getattr(fit.efficiency, k) for k in ("compute", "memory", "comm", "overhead")
                },
                "points": [
                    {"point": str(p), "measured_s": p.seconds, "predicted_s": q}
                    for p, q in zip(fit.points, fit.predicted)
                ],
                "warnings": list(fit.warnings),
            },
        )
    return 0


DEFAULT_OUT = "calibration-cpu.json"


def _add_torch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("real-executor calibration (--executor torch)")
    g.add_argument(
        "--executor",
        choices=("points", "torch"),
        default="points",
        help="points: fit the POINTS given; torch: profile the real executor on this host (default: %(default)s)",
    )
    g.add_argument(
        "--out", metavar="FILE", default=DEFAULT_OUT, help="calibration file to write (default: %(default)s)"
    )
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default_of(EngineArgs, "dtype"),
        help="the engine's dtype while profiling, as serve --dtype: calibrate the dtype you serve "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--repeats", type=int, default=2, help="runs of the profiling grid; median per shape (default: 2)"
    )
    g.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads while profiling (default: torch's own)"
    )
    g.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time in this thread's CPU time, not wall time (a shared machine; use with --threads 1)",
    )


def cmd_calibrate_torch(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from tailserve.executors.simulated.calibration_files import write_calibration_file
    from tailserve.fidelity.torch_calibrate import calibrate_torch, default_grid, error_table

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"--model {args.model}: not a model directory (no config.json); make one with tailserve model init"
        )
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    from tailserve.executors.simulated.models import load_hf_config

    grid = default_grid(load_hf_config(model_dir).max_position_embeddings)
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("profiling the real executor", total=len(grid) * args.repeats)
        cal, fit = calibrate_torch(
            model_dir,
            args.repeats,
            lambda label: bar.update(task, advance=1, description=label),
            grid,
            cpu_clock=args.cpu_clock,
            dtype=args.dtype,
        )
    write_calibration_file(args.out, cal, fit)
    out = Console()
    e = cal.efficiency
    out.print(cal.source)
    out.print(
        f"fitted: compute {e.compute:.3g} and memory {e.memory:.3g} of the measured rates, sharpness "
        f"{e.sharpness:.3g}, overhead {e.overhead * 1e3:.2f} ms per step, {e.per_token * 1e6:.1f} us per token, "
        f"prefill attention x{e.prefill_attention:.3g}, decode attention x{e.decode_attention:.3g}"
    )
    table = Table(title="fitted iteration time vs measured (|relative error|)", title_justify="left")
    for col in ("points", "n", "median", "p90"):
        table.add_column(col, justify="right" if col != "points" else "left")
    for kind, row in error_table(fit).items():
        table.add_row(kind, str(row["n"]), f"{row['median']:.1%}", f"{row['p90']:.1%}")
    out.print(table)
    for w in fit.warnings:
        out.print(f"warning: {w}")
    out.print(f"wrote {args.out}; use it with --calibration {args.out} --model {args.model}")
    return 0
