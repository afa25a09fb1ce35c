"""``tailserve calibrate``: fit the cost model to measured iteration times (``POINTS`` or a
preset); with ``--executor torch --model DIR``, profile the real executor on this host; with
``--from-server URL``, probe a running OpenAI-compatible server (``fidelity/server_calibrate.py``);
with ``--from-trace FILE``, read the clean moments of traffic already recorded
(``fidelity/trace_calibrate.py``). The last three write a calibration file (``--out``) that ``--calibration FILE`` loads.
With ``--time-gemms FILE`` on a CUDA machine, time the GPU's GEMMs (``fidelity/gpu_gemm.py``) into
FILE, which ``--calibration gemm:FILE`` loads."""

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
    _add_server_args(p)
    g = p.add_argument_group("GPU GEMMs (on a CUDA machine; price with --calibration gemm:FILE)")
    g.add_argument("--time-gemms", metavar="FILE", help="time this GPU's bf16 and FP8 GEMMs into FILE "
                   "(48 weight shapes x 13 token counts, ~25 s on an H200)")  # fmt: skip
    g.add_argument("--dense", action="store_true", help="--time-gemms: 73 token counts (~100 s on an H200)")
    p.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    if getattr(args, "dp", 1) > 1:
        raise CliError(
            "--data-parallel-size runs in `tailserve simulate`, `cost` and `tune` (one DP engine, or "
            "--gpus N --plan-dp); `calibrate` prices one engine"
        )
    sources = [
        name
        for name, on in (
            ("--from-server", args.from_server is not None),
            ("--from-trace", args.from_trace is not None),
            ("--executor torch", args.executor == "torch"),
            ("--time-gemms", args.time_gemms is not None),
        )
        if on
    ]
    if len(sources) > 1:
        raise CliError(
            "calibrate takes one of --from-server, --from-trace, --executor torch, --time-gemms; got "
            + " and ".join(sources)
        )
    _check_source_options(args)
    if args.time_gemms is not None:
        return cmd_calibrate_gemms(args)
    if args.from_server is not None:
        return cmd_calibrate_server(args)
    if args.from_trace is not None:
        return cmd_calibrate_trace(args)
    if args.executor == "torch":
        return cmd_calibrate_torch(args)
    if args.points is None:
        raise CliError(
            "calibrate needs POINTS (or --executor torch --model DIR, --from-server URL or --from-trace FILE)"
        )
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
SERVER_OUT = "calibration-server.json"
TRACE_OUT = "calibration-trace.json"


def _add_torch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("real-executor calibration (--executor torch)")
    g.add_argument(
        "--executor",
        choices=("points", "torch"),
        default="points",
        help="points: fit the POINTS given; torch: profile the real executor on this host (default: %(default)s)",
    )
    g.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help=f"calibration file to write (default: {DEFAULT_OUT}, or {SERVER_OUT} with --from-server)",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default_of(EngineArgs, "dtype"),
        help="the engine's dtype while profiling, as serve --dtype: calibrate the dtype you serve; with "
        "--from-server --hardware cpu, the dtype the server computes in (its GEMM rate is measured) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of the profiling grid (--executor torch, default 2) or of each probe (--from-server, "
        "default 3); median per shape",
    )
    g.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads while profiling (default: torch's own)"
    )
    g.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time in this thread's CPU time, not wall time (a shared machine; use with --threads 1)",
    )


# Options only one source reads (attribute, flag, the sources that read it): given to another
# source they were silently ignored (--prefill 0 with --executor torch profiled its own grid).
_SOURCE_OPTIONS = (
    ("served_model", "--served-model", ("from_server",)),
    ("api_key", "--api-key", ("from_server",)),
    ("prefill", "--prefill", ("from_server",)),
    ("decode", "--decode", ("from_server",)),
    ("context_prefill", "--context-prefill", ("from_server",)),
    ("mixed", "--mixed", ("from_server",)),
    ("decode_tokens", "--decode-tokens", ("from_server",)),
    ("no_server_metrics", "--no-server-metrics", ("from_server",)),
    ("max_num_batched_tokens", "--max-num-batched-tokens", ("from_server", "from_trace")),
    ("no_prefix_caching", "--no-prefix-caching", ("from_trace",)),
    ("dense", "--dense", ("time_gemms",)),
)


def _check_source_options(args: argparse.Namespace) -> None:
    for attr, flag, sources in _SOURCE_OPTIONS:
        given = getattr(args, attr) not in (None, False)
        if given and not any(getattr(args, source) is not None for source in sources):
            needs = " or ".join("--" + source.replace("_", "-") for source in sources)
            raise CliError(f"{flag} is read with {needs} only; this calibrate would ignore it")


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
    args.repeats = 2 if args.repeats is None else args.repeats
    args.out = args.out or DEFAULT_OUT
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
        f"{e.per_logit * 1e6:.0f} us per sampled row, prefill attention x{e.prefill_attention:.3g}, "
        f"decode attention x{e.decode_attention:.3g}"
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


def _add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "calibration from a running server (--from-server URL; --model and --hardware say what it runs, "
        "--hardware cpu for a CPU server on this host)"
    )
    g.add_argument(
        "--from-server",
        metavar="URL",
        default=None,
        help="probe this OpenAI-compatible server (tailserve serve, vllm serve, SGLang, ...) with timed "
        "requests, read its Prometheus histograms where it has them, fit, write --out",
    )
    g.add_argument(
        "--served-model",
        metavar="NAME",
        default=None,
        help="the model name to send (default: the served model --model names, by id or directory)",
    )
    g.add_argument(
        "--from-trace",
        metavar="FILE",
        default=None,
        help="fit to a recorded trace (bench or router --record-trace): the TTFTs of requests that "
        "ran alone and the gaps of pure decode, no request sent; write --out",
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="with --from-trace: the engine ran without prefix caching (default: shared prompt "
        "prefixes count as cached, vLLM V1's default)",
    )
    g.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the server's token budget: prefill probes stay within it, so no prompt is chunked; "
        "with --from-trace, longer prompts are not prefill points "
        "(default: 2048, vLLM's API-server default on CPUs and most GPUs)",
    )
    g.add_argument(
        "--prefill", metavar="P,...", default=None, help="prefill probe lengths, e.g. 128,512,2048"
    )
    g.add_argument(
        "--decode", metavar="BxL,...", default=None, help="decode probes: batch x context, e.g. 1x128,16x512"
    )
    g.add_argument(
        "--context-prefill",
        metavar="Q@C,...",
        default=None,
        help="prefills of Q new tokens over C tokens the server's prefix cache holds (sent once "
        "before), C a multiple of 128, e.g. 256@1024; '' for none (default: four up to the context)",
    )
    g.add_argument(
        "--mixed",
        metavar="BxL+P,...",
        default=None,
        help="a prefill of P tokens sent beside B streams decoding at L tokens of context, e.g. "
        "8x256+512; '' for none (default: 4x256+128, 8x256+512, 16x512+256)",
    )
    g.add_argument(
        "--decode-tokens", type=int, default=None, help="tokens each decode stream generates (default: 32)"
    )
    g.add_argument(
        "--no-server-metrics",
        action="store_true",
        help="fit the client's timings even where the server's /metrics has its own",
    )


def cmd_calibrate_server(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from tailserve.executors.simulated.calibration_files import write_calibration_file
    from tailserve.executors.simulated.models import get_model
    from tailserve.fidelity import server_calibrate as sc
    from tailserve.fidelity.server_probe import Prompts, ServerProbe, choose_model, served_models

    url = args.from_server.rstrip("/")
    model = get_model(args.model)
    tp = args.tp or 1
    get_hardware_or_cpu(args.hardware)  # a GPU name that is not in the catalog: refused before probing
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    served = choose_model(served_models(url, headers), args.served_model, args.model)
    max_len = min(served.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    budget = args.max_num_batched_tokens or sc.DEFAULT_BUDGET
    tokens = args.decode_tokens or sc.DEFAULT_DECODE_TOKENS
    if tokens < 4:
        raise ValueError(f"--decode-tokens must be >= 4 (a steady middle to time), got {tokens}")
    repeats = 3 if args.repeats is None else args.repeats
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    plan = sc.default_plan(max_len, budget, repeats, tokens)
    if args.prefill:
        plan = replace(plan, prefill_lens=sc.parse_prefill_lens(args.prefill))
    if args.decode:
        plan = replace(plan, decode_shapes=sc.parse_decode_shapes(args.decode))
    if args.context_prefill is not None:
        plan = replace(
            plan,
            context_prefills=sc.parse_context_prefills(args.context_prefill) if args.context_prefill else (),
        )
    if args.mixed is not None:
        plan = replace(plan, mixed=sc.parse_mixed(args.mixed) if args.mixed else ())
    too_long = plan.too_long(max_len)
    if too_long:
        raise ValueError(f"probe lengths {too_long} do not fit the server's {max_len}-token context")
    over = plan.over_budget(budget)
    if over:
        raise ValueError(
            f"probes of {over} tokens in one step exceed --max-num-batched-tokens {budget}: the server "
            "would split them over steps"
        )

    probe = ServerProbe(url, served.id, headers)
    token_ids = probe.accepts_token_ids(model.vocab_size)
    prompts = Prompts(token_ids, model.vocab_size)
    if not token_ids:
        check = probe.stream(prompts.make(200), 1)  # words per token, from the server's own count
        prompts.words_per_token = 200 / check.prompt_tokens
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"probing {url}", total=plan.num_probes)
        first = probe.histograms() if not args.no_server_metrics else None
        points = sc.probe_server(
            probe,
            prompts,
            plan,
            use_metrics=not args.no_server_metrics,
            progress=lambda label: bar.update(task, advance=1, description=label),
        )
    measured = [p.measured() for p in points]
    last = probe.histograms() if first is not None else None
    threads = last.threads_since(first) if first is not None and last is not None else None
    hardware = _server_hardware(args, threads)
    fit = sc.fit_points(model, hardware, tp, measured)
    cal = sc.calibration_file(url, served.id, model, hardware, tp, plan, points, fit, token_ids, threads)
    out_path = args.out or SERVER_OUT
    write_calibration_file(out_path, cal, fit)

    out = Console()
    out.print(cal.source)
    table = Table(title="probes: fitted iteration time vs measured", title_justify="left")
    for col in ("probe", "from", "measured ms", "repeats", "client ms", "fitted ms", "error"):
        table.add_column(col, justify="left" if col in ("probe", "from") else "right")
    for p, predicted in zip(points, fit.predicted):
        table.add_row(
            p.label,
            p.source,
            f"{p.seconds * 1e3:.2f}",
            f"±{p.spread / 2:.0%}" if plan.repeats > 1 else "-",
            f"{p.client_s * 1e3:.2f}",
            f"{predicted * 1e3:.2f}",
            f"{predicted / p.seconds - 1:+.1%}",
        )
    out.print(table)
    moved = [p for p in points if p.spread > sc.SPREAD_WARNING]
    if moved and plan.repeats > 1:
        shown = ", ".join(f"{p.label} ({p.low_s * 1e3:.2f}-{p.high_s * 1e3:.2f} ms)" for p in moved[:4])
        more = f" and {len(moved) - 4} more" if len(moved) > 4 else ""
        out.print(
            f"warning: {len(moved)} of {len(points)} probes' repeats spread over {sc.SPREAD_WARNING:.0%} "
            f"of their median: {shown}{more}; the server's speed moved while they ran, and a fit "
            "to them carries it (more --repeats, or a quieter moment)"
        )
    _print_fit_summary(out, fit)
    out.print(f"wrote {out_path}; use it with --calibration {out_path} --model {args.model}")
    return 0


def cmd_calibrate_gemms(args: argparse.Namespace) -> int:
    """Time the GPU's GEMMs into ``--time-gemms FILE``, then show the curves ``gemm:FILE`` fits."""
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.executors.simulated.gemm_table import catalog_gpu, load_gemm_table
    from tailserve.fidelity import gpu_gemm

    rc = gpu_gemm.main(["--out", args.time_gemms, *(["--dense"] if args.dense else [])])
    if rc:
        return rc
    timed = catalog_gpu(load_gemm_table(args.time_gemms).gpu)
    if timed is not None and args.hardware == default_of(Deployment, "hardware"):
        args.hardware = timed  # no --hardware given: the GPU just timed
    built = build_cost_model(replace(deployment_from(args), calibration=f"gemm:{args.time_gemms}"))
    for note in built.notes:
        print(f"note: {note}")
    print(f"price with: --hardware {built.cost_model.hardware.name} --calibration gemm:{args.time_gemms}")
    return 0


def cmd_calibrate_trace(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tailserve.executors.simulated.calibration_files import CalibrationFile, write_calibration_file
    from tailserve.executors.simulated.models import get_model
    from tailserve.fidelity import server_calibrate as sc
    from tailserve.fidelity import trace_calibrate as tc
    from tailserve.workloads.recorded import has_measured, load_measured

    path = args.from_trace
    if not Path(path).is_file():
        raise CliError(f"--from-trace {path}: no such file")
    if not has_measured(path):
        raise CliError(f"--from-trace {path}: not a recorded trace (its lines have no 'measured' figures)")
    model = get_model(args.model)
    tp = args.tp or 1
    hardware = _server_hardware(args)
    options = tc.TraceCalibrationOptions(
        max_num_batched_tokens=args.max_num_batched_tokens or sc.DEFAULT_BUDGET,
        prefix_caching=not args.no_prefix_caching,
    )
    found = tc.trace_points(load_measured(path), options)
    tc.check_enough(found, path)
    measured = [p.measured() for p in found.points]
    fit = sc.fit_points(model, hardware, tp, measured)
    source = (
        f"tailserve calibrate --from-trace {path}: {found.num_requests} requests, {found.alone} ran "
        f"alone, {found.clean_gaps} pure-decode gaps; {len(found.points)} points (client timings)"
    )
    cal = CalibrationFile(hardware, fit.efficiency, model.name, tp, source, tuple(measured))
    out_path = args.out or TRACE_OUT
    write_calibration_file(out_path, cal, fit)

    out = Console()
    out.print(source)
    table = Table(title="clean moments: fitted iteration time vs measured", title_justify="left")
    for col in ("point", "measured ms", "fitted ms", "error"):
        table.add_column(col, justify="left" if col == "point" else "right")
    for p, predicted in zip(found.points, fit.predicted):
        table.add_row(
            p.label, f"{p.seconds * 1e3:.2f}", f"{predicted * 1e3:.2f}", f"{predicted / p.seconds - 1:+.1%}"
        )
    out.print(table)
    _print_fit_summary(out, fit)
    out.print(
        f"wrote {out_path}; replay the trace with it: tailserve simulate --trace {path} --calibration {out_path} --model {args.model}"
    )
    return 0


def get_hardware_or_cpu(name: str) -> Any:
    """The catalog's GPU of that name, or None for ``cpu`` (measured later)."""
    from tailserve.executors.simulated.hardware import get_hardware

    return None if name.strip().lower() == "cpu" else get_hardware(name)


def _server_hardware(args: argparse.Namespace, threads: dict[int, float] | None = None) -> Any:
    """The GPU a server runs on, or ``cpu``: this host measured in the server's dtype, at the
    thread count a tailserve server's executor ran longest during the probes (``threads``, its
    ``tailserve_cpu_thread_seconds``) where it said: on a 2-core host with one core taken by other
    work the server drops to one thread, and two threads timing the peak here would wait on the
    busy core at every barrier. The reading still moves +-30% run to run on a shared VM (steal);
    the fit's efficiencies absorb the level."""
    gpu = get_hardware_or_cpu(args.hardware)
    if gpu is not None:
        return gpu
    from tailserve.fidelity.torch_calibrate import measure_host_at

    return measure_host_at(args.dtype, max(threads, key=threads.__getitem__) if threads else None)


def _print_fit_summary(out: Any, fit: Any) -> None:
    from tailserve.fidelity.torch_calibrate import error_table

    rows = error_table(fit)
    out.print(
        "median |error|: "
        + ", ".join(f"{kind} {row['median']:.1%} (n={row['n']})" for kind, row in rows.items())
    )
    for w in fit.warnings:
        out.print(f"warning: {w}")
