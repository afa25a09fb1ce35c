"""``tailserve`` command line: compare, simulate, cost, calibrate, models, hardware."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Sequence
from typing import Any

from tailserve import __version__
from tailserve.cli_explain import add_explain_parser, add_run_outputs, run_outputs, wants_batches
from tailserve.metrics.summary import Slo
from tailserve.report.compare_text import compare_paragraph
from tailserve.report.tables import print_calibration, print_cost, print_runs
from tailserve.sim.deployment import SEED_PRESET, BuiltCostModel, Deployment, build_cost_model
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WORKLOADS, WorkloadSpec

# The essay's engines side by side: Orca, vLLM V0, vLLM V1 at two budgets, Sarathi, SGLang, TGI.
DEFAULT_COMPARE_POLICIES = "orca,vllm-v0,vllm,vllm:max_num_batched_tokens=8192,sarathi,sglang,tgi"


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with the README's promise kept: a bad option or choice is one line on stderr
    (no usage block), naming the command and pointing to its --help. Subcommand parsers are
    made with the same class."""

    command_names: tuple[str, ...] = ()  # the subcommands, set by build_parser

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


POLICY_FLAGS_EPILOG = (
    "Policy flags follow with the engine's own names, e.g. --max-num-batched-tokens 512 "
    "--no-enable-chunked-prefill (vllm), --chunked-prefill-size 1024 (sglang), "
    "--max-batch-prefill-tokens 4096 (tgi); `tailserve policies` lists every policy's flags "
    "and its engine's defaults."
)


# ---- shared options -----------------------------------------------------------------------
def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument(
        "--model",
        default=SEED_PRESET.model,
        help="catalog name or path to a HF config.json (default: %(default)s)",
    )
    g.add_argument(
        "--hardware",
        default=SEED_PRESET.hardware,
        help="GPU from the catalog (default: %(default)s)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=None,
        help=f"tensor-parallel size (default: {SEED_PRESET.tp} for the seed deployment, else 1)",
    )
    g.add_argument(
        "--calibration",
        default="auto",
        help="none | seed | generic | FILE.json | vidur:DIR | measured points "
        "'prefill:4096=0.120,decode:10x1024=0.018' (default auto: seed for Llama-3-70B on A100-80GB, "
        "none otherwise; docs/cost_model.md)",
    )


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    from tailserve.workloads.arrivals import ARRIVAL_FORMS
    from tailserve.workloads.lengths import LENGTH_FORMS

    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default="hol",
        choices=WORKLOADS,
        help="built-in workload (default: %(default)s)",
    )
    g.add_argument(
        "--trace",
        metavar="PATH",
        help="replay a trace instead (Azure CSV, Mooncake JSONL, tailserve JSONL)",
    )
    g.add_argument(
        "--rate", type=float, default=4.0, help="arrival rate, requests/s (sessions/s for multi-turn)"
    )
    g.add_argument("--num-requests", type=int, default=200, help="requests (chat, random)")
    g.add_argument("--input-len", default="1024", help=f"random: prompt lengths ({' | '.join(LENGTH_FORMS)})")
    g.add_argument("--output-len", default="128", help="random: output lengths, same forms")
    g.add_argument(
        "--arrival",
        default="poisson",
        help=f"random: arrival process ({' | '.join(ARRIVAL_FORMS)})",
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="trace: multiply the arrival rate (2 = twice as fast)",
    )
    g.add_argument("--max-requests", type=int, default=None, help="trace: keep the first N requests")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    g.add_argument("--shared-fraction", type=float, default=0.8, help="shared-prefix: requests using one")
    g.add_argument("--num-sessions", type=int, default=40, help="multi-turn: conversations")
    g.add_argument("--turns", default="2:6", help="multi-turn: turns per session, LOW:HIGH")
    g.add_argument("--think-time", type=float, default=5.0, help="multi-turn: mean seconds between turns")
    g.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    g.add_argument(
        "--priorities",
        default=None,
        help="give requests priorities from a mix, PRIORITY=FRACTION,... e.g. 0=0.8,10=0.2 (lower is more urgent in vLLM)",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="OUT", help="write the results as JSON")
    g.add_argument("--slo", default=None, help="goodput SLO, e.g. 'ttft=2s,tpot=100ms'")
    g.add_argument(
        "--check-integrity",
        action="store_true",
        help="check KV and request invariants after every iteration (slow)",
    )
    g.add_argument(
        "--no-fast-forward",
        action="store_true",
        help="step every iteration (for checking the exact fast path)",
    )


def _deployment(args: argparse.Namespace) -> Deployment:
    """Names resolved to the catalog's once, here; everything after reads the canonical ones."""
    return Deployment.of(args.model, args.hardware, args.tp, args.calibration)


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    from tailserve.sim.workload_spec import parse_priorities
    from tailserve.workloads.arrivals import parse_arrival
    from tailserve.workloads.lengths import parse_length

    return WorkloadSpec(
        name="trace" if args.trace else args.workload,
        num_requests=args.num_requests,
        rate=args.rate,
        seed=args.seed,
        input_len=parse_length(args.input_len),
        output_len=parse_length(args.output_len),
        arrival=parse_arrival(args.arrival),
        trace_path=args.trace,
        rate_scale=args.rate_scale,
        max_requests=args.max_requests,
        priorities=parse_priorities(args.priorities) if args.priorities else (),
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        shared_fraction=args.shared_fraction,
        num_sessions=args.num_sessions,
        turns=_parse_turns(args.turns),
        think_time=args.think_time,
    )


def _parse_turns(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        turns = (int(low), int(high or low))
    except ValueError:
        raise CliError(f"--turns {text!r}: expected LOW:HIGH, e.g. 2:6") from None
    if not 1 <= turns[0] <= turns[1]:
        raise CliError(f"--turns {text!r}: expected 1 <= LOW <= HIGH")
    return turns


def _engine_options(args: argparse.Namespace) -> Any:
    from tailserve.core.engine import EngineOptions

    return EngineOptions(
        fast_forward=not args.no_fast_forward,
        check_integrity=args.check_integrity,
        record_batches=wants_batches(args),
    )


def parse_slo(text: str | None) -> Slo | None:
    if not text:
        return None
    values: dict[str, float] = {}
    for item in text.split(","):
        key, eq, raw = item.strip().partition("=")
        if not eq and ":" in item:
            key, _, raw = item.strip().partition(":")
        key = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}.get(key.strip().lower(), "")
        if not key:
            raise CliError(f"--slo item {item!r}: expected ttft=, tpot= or e2e= with a time like 2s or 200ms")
        values[key] = _parse_seconds(raw.strip(), item)
    return Slo(**values)


def _parse_seconds(raw: str, item: str) -> float:
    try:
        if raw.endswith("ms"):
            return float(raw[:-2]) / 1000
        if raw.endswith("s"):
            return float(raw[:-1])
        return float(raw) / 1000  # a bare number is milliseconds, as in vllm bench --goodput
    except ValueError:
        raise CliError(f"--slo item {item!r}: {raw!r} is not a time like 2s or 200ms") from None


def _print_notes(built: BuiltCostModel) -> None:
    for note in built.notes:
        print(f"note: {note}", file=sys.stderr)
    if built.fit is not None:
        for warning in built.fit.warnings:
            print(f"warning: calibration {built.calibration!r}: {warning}", file=sys.stderr)


def _write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


# ---- commands -----------------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> int:
    from tailserve.policies.registry import parse_policy_list

    built = build_cost_model(_deployment(args))
    _print_notes(built)
    specs = parse_policy_list(args.policies)
    workload = WorkloadBuilder(_workload(args))
    slo = parse_slo(args.slo)
    from tailserve.cli_tune import compare_runs

    runs = compare_runs(args, specs, workload.spec, slo)
    summaries = [r.summary(slo) for r in runs]
    for note in dict.fromkeys(n for r in runs for n in r.notes):
        print(f"note: {note}", file=sys.stderr)
    print_runs(runs, summaries, built, workload.spec)
    print()
    print(compare_paragraph(runs, summaries, built, workload.spec))
    run_outputs(args, runs, f"tailserve compare: {workload.spec.label}")
    if args.json:
        _write_json(args.json, {"runs": [{"label": r.label, **s} for r, s in zip(runs, summaries)]})
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from tailserve.policies.registry import PolicySpec

    spec = PolicySpec.make(args.policy, _parse_policy_flags(args.extra))
    built = build_cost_model(_deployment(args))
    _print_notes(built)
    workload = WorkloadBuilder(_workload(args))
    slo = parse_slo(args.slo)
    run = run_policy(built, spec, workload, options=_engine_options(args))
    summary = run.summary(slo)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    print_runs([run], [summary], built, workload.spec)
    summary.update(run_outputs(args, [run], f"tailserve simulate: {run.label}, {workload.spec.label}"))
    if args.json:
        _write_json(args.json, {"label": run.label, **summary})
    if args.iterations:
        run.log.write_jsonl(args.iterations)
    return 0


def _parse_policy_flags(extra: list[str], policy: str | None = None) -> dict[str, str]:
    """``--max-num-batched-tokens 512 --no-enable-chunked-prefill`` -> {name: value}.

    With ``policy``, each name is checked against that policy's flags (and the engine-wide
    ones): an unknown one is an unrecognized argument of the command, and a flag that takes a
    value but has none says so, instead of failing later on a converted ``true``."""
    flags: dict[str, str] = {}
    bare: set[str] = set()  # flags given without a value
    i = 0
    while i < len(extra):
        token = extra[i]
        if not token.startswith("--"):
            raise CliError(f"unrecognized argument {token}")
        name, eq, value = token[2:].partition("=")
        if not eq:
            if name.startswith("no-"):
                name, value = name[3:], "false"
            elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                value = extra[i + 1]
                i += 1
            else:
                value = "true"
                bare.add(name.replace("-", "_"))
        flags[name.replace("-", "_")] = value
        i += 1
    if policy is not None:
        _check_policy_flags(policy, flags, bare)
    return flags


def _check_policy_flags(policy: str, flags: dict[str, str], bare: set[str]) -> None:
    from tailserve.policies.registry import ENGINE_FLAGS, get_policy_cls, policy_flags, resolve_policy_name

    name = resolve_policy_name(policy)
    known = {**policy_flags(get_policy_cls(name)), **ENGINE_FLAGS}
    for flag in flags:
        option = "--" + flag.replace("_", "-")
        if flag not in known:
            raise CliError(
                f"unrecognized argument {option} (not an option of this command, nor a flag of "
                f"policy {name}; `tailserve policies` lists each policy's flags)"
            )
        kind = known[flag]
        if flag in bare and kind is not bool and bool not in typing.get_args(kind):
            kinds = [k for k in typing.get_args(kind) or (kind,) if k is not type(None)]
            kind_name = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
            raise CliError(f"policy flag {option} needs a value ({kind_name}), e.g. {option} VALUE")


def cmd_cost(args: argparse.Namespace) -> int:
    from tailserve.executors.simulated.cost_model import BatchShape

    built = build_cost_model(_deployment(args))
    cm = built.cost_model
    batch, ctx = _parse_decode(args.decode)
    _check_fits(cm, args.prefill)  # before the notes: a deployment that cannot load is one line
    _print_notes(built)
    prefill_shape = BatchShape.of([(args.prefill, args.prefill_context)], [])
    decode_shape = BatchShape.of([], [ctx] * batch)
    result = {
        "prefill_s": cm.iteration_time(prefill_shape),
        "decode_s": cm.iteration_time(decode_shape),
    }
    print_cost(
        built,
        args.prefill,
        args.prefill_context,
        batch,
        ctx,
        result,
        cm.roofline(prefill_shape),
        cm.roofline(decode_shape),
    )
    if args.swap is not None:
        if args.swap < 1:
            raise CliError(f"--swap must be >= 1 token, got {args.swap}")
        result["swap_s"] = cm.swap_time(args.swap)
        per_gpu = args.swap * cm.model.kv_bytes_per_token(cm.tp)
        print(
            f"swap {args.swap:,} tokens: {per_gpu / 1e9:.2f} GB of KV per GPU "
            f"({args.swap * cm.model.kv_bytes_per_token() / 1e9:.2f} GB in all) over "
            f"{cm.hardware.pcie_bandwidth / 1e9:.0f} GB/s PCIe: {result['swap_s'] * 1e3:.1f} ms"
        )
    if args.json:
        _write_json(args.json, result)
    return 0


def _check_fits(cm: Any, prefill_tokens: int) -> None:
    """The same memory check ``simulate`` makes (vLLM's default memory fraction and block size,
    activations for the priced prefill): a deployment that cannot load is an error, not a time."""
    from tailserve.executors.simulated.kv_capacity import kv_capacity
    from tailserve.policies.registry import get_policy_cls

    vllm = get_policy_cls("vllm")
    kv_capacity(
        cm.model,
        cm.hardware,
        cm.tp,
        vllm.default_gpu_memory_utilization,
        vllm.default_block_size,
        max(prefill_tokens, 1),
    )


def _parse_decode(text: str) -> tuple[int, int]:
    batch, x, ctx = text.lower().partition("x")
    try:
        b, c = int(batch), int(ctx)
    except ValueError:
        raise CliError(f"--decode {text!r}: expected BATCHxCONTEXT, e.g. 10x1024") from None
    if not x or b < 1 or c < 0:
        raise CliError(f"--decode {text!r}: expected BATCHxCONTEXT with batch >= 1, e.g. 10x1024")
    return b, c


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.executor == "torch":
        from tailserve.cli_calibrate import cmd_calibrate_torch

        return cmd_calibrate_torch(args)
    if args.points is None:
        raise CliError("calibrate needs POINTS (or --executor torch --model DIR)")
    deployment = _deployment(args)
    built = build_cost_model(Deployment(deployment.model, deployment.hardware, deployment.tp, args.points))
    print_calibration(built)
    if args.json and built.fit is not None:
        fit = built.fit
        _write_json(
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


def cmd_policies(args: argparse.Namespace) -> int:
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.executors.simulated.models import get_model
    from tailserve.report.tables import print_policies

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


# ---- parser -------------------------------------------------------------------------------
def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="tailserve",
        description="Why does p99 TTFT spike? Serving policies side by side on a simulated GPU.",
    )
    parser.add_argument("--version", action="version", version=f"tailserve {__version__}")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser(
        "compare",
        help="several policies on the same deployment and workload (default: the seed essay's scenario)",
    )
    p.add_argument(
        "--policies",
        default=DEFAULT_COMPARE_POLICIES,
        help="comma list, each NAME[:flag=value...] (default: %(default)s)",
    )
    _add_deployment_args(p)
    _add_workload_args(p)
    _add_output_args(p)
    from tailserve.cli_tune import add_sweep_args, add_tune_parser

    add_sweep_args(p)
    add_run_outputs(p, simulate=False)
    p.set_defaults(run=cmd_compare)

    p = sub.add_parser(
        "simulate",
        help="one policy; its flags follow with the engine's own names, e.g. --max-num-batched-tokens 512",
        epilog=POLICY_FLAGS_EPILOG,
    )
    p.add_argument(
        "--policy",
        default="vllm",
        help="static | orca | vllm-v0 | vllm | sarathi | sglang | tgi (default: %(default)s)",
    )
    p.set_defaults(run=cmd_simulate, takes_policy_flags=True)
    _add_deployment_args(p)
    _add_workload_args(p)
    _add_output_args(p)
    p.add_argument("--iterations", metavar="OUT.jsonl", help="write the per-iteration log as JSON lines")
    add_run_outputs(p, simulate=True)

    p = sub.add_parser("cost", help="predicted iteration times of a prefill and a decode step")
    _add_deployment_args(p)
    p.add_argument("--prefill", type=int, default=4096, help="prefill tokens (default: %(default)s)")
    p.add_argument(
        "--prefill-context",
        type=int,
        default=0,
        help="tokens already cached before the prefill chunk",
    )
    p.add_argument("--decode", default="10x1024", help="decode batch BATCHxCONTEXT (default: %(default)s)")
    p.add_argument(
        "--swap",
        type=int,
        default=None,
        metavar="TOKENS",
        help="also price swapping this many tokens of KV over PCIe",
    )
    p.add_argument("--json", metavar="OUT", help="write {prefill_s, decode_s} (and swap_s) as JSON")
    p.set_defaults(run=cmd_cost)

    p = sub.add_parser("calibrate", help="fit the cost model to measured iteration times")
    _add_deployment_args(p)
    p.add_argument(
        "points", nargs="?", help="'prefill:4096=0.120,decode:10x1024=0.018' or a preset name (seed)"
    )
    p.add_argument("--json", metavar="OUT", help="write the fit as JSON")
    from tailserve.cli_calibrate import add_torch_args

    add_torch_args(p)
    p.set_defaults(run=cmd_calibrate)

    p = sub.add_parser("policies", help="every policy with its flags and its engine's defaults for a GPU")
    p.add_argument(
        "--hardware", default=SEED_PRESET.hardware, help="GPU whose defaults to show (default: %(default)s)"
    )
    p.add_argument(
        "--model",
        default=SEED_PRESET.model,
        help="model whose context length to assume (default: %(default)s)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.set_defaults(run=cmd_policies)

    sub.add_parser("models", help="list the model catalog").set_defaults(run=cmd_catalog)
    sub.add_parser("hardware", help="list the hardware catalog").set_defaults(run=cmd_catalog)
    # Commands in their own modules: each adds its parser and sets ``run``.
    add_explain_parser(sub)
    add_tune_parser(sub)
    from tailserve.cli_model import add_model_parser

    add_model_parser(sub)
    from tailserve.cli_bench import add_bench_parser
    from tailserve.cli_serve import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    from tailserve.cli_run import add_run_parser

    add_run_parser(sub)
    for name in ("serve", "run"):  # their modules build the parsers; the epilog is shared here
        sub.choices[name].epilog = POLICY_FLAGS_EPILOG
    parser.command_names = tuple(sub.choices)
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
            f"tailserve compare {' '.join(argv)} (commands: {commands})",
            file=sys.stderr,
        )
        return 2
    args, extra = parser.parse_known_args(argv)
    try:
        if extra and not getattr(args, "takes_policy_flags", False):
            raise CliError(f"unrecognized argument{'s' if len(extra) > 1 else ''} {' '.join(extra)}")
        if getattr(args, "takes_policy_flags", False):
            _parse_policy_flags(extra, args.policy)  # unknown or value-less flags: one line, now
        args.extra = extra  # a command with takes_policy_flags reads them with _parse_policy_flags
        run = getattr(args, "run", None)
        if run is None:
            parser.print_help()
            return 2
        return run(args)
    except (CliError, ValueError) as e:
        print(f"tailserve: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tailserve: error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
