"""Options several commands share: the deployment, the workload and the output groups, and the
config objects made from them. Defaults are read from ``Deployment`` and ``WorkloadSpec``; the
options parsed from text (lengths, arrivals, turns, priorities) default to None, meaning the
spec's own default."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tailserve.cli.base import CliError, default_of
from tailserve.cli.run_outputs import tbt_threshold, wants_batches
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import SEED_PRESET, BuiltCostModel, Deployment
from tailserve.executors.simulated.moe_comm import BACKENDS
from tailserve.executors.simulated.pipeline import PP_LINKS
from tailserve.metrics.summary import Slo
from tailserve.sim.workload_spec import WORKLOADS, WorkloadSpec, parse_priorities


def _spec(name: str) -> Any:
    return default_of(WorkloadSpec, name)


def _length(name: str) -> str:
    """A default length distribution as the user would type it (``1024`` for ``Fixed(1024)``)."""
    dist = _spec(name)
    return str(getattr(dist, "value", dist))


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument(
        "--model",
        default=default_of(Deployment, "model"),
        help="catalog name or path to a HF config.json (default: %(default)s)",
    )
    g.add_argument(
        "--hardware",
        default=default_of(Deployment, "hardware"),
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
        default=default_of(Deployment, "calibration"),
        help="none | seed | generic | FILE.json | vidur:DIR | gemm:FILE (GEMMs timed by scripts/gpu_gemm.py) | "
        "aisim:FILE[:GPU] (AISimulate's GEMM, fused-MoE and MLA module tables, exported by "
        "benchmarks/_aisim_tables.py) | measured points "
        "'prefill:4096=0.120,decode:10x1024=0.018' (default auto: seed for Llama-3-70B on A100-80GB, "
        "none otherwise; docs/cost_model.md)",
    )
    g.add_argument(
        "--quantization",
        default="",
        metavar="FORMAT",
        help="weights' number format, as vLLM's flag: fp8, fp8_static (modelopt), fp8_block, int8, int4 (AWQ/GPTQ), mxfp4, "
        "nvfp4 (default: the model's own, bf16 unless its checkpoint says otherwise)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="FORMAT",
        help="KV cache number format, as vLLM's flag: auto (the model's), fp8 (fp8_e4m3, fp8_e5m2), nvfp4, "
        "int8 / int4 (per token head), bf16, fp16 (default: %(default)s)",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: experts split whole over the TP ranks (and DP ranks), as vLLM's flag (default: "
        "each expert sliced over them)",
    )
    g.add_argument(
        "--data-parallel-size",
        "--dp",
        dest="dp",
        type=int,
        default=default_of(Deployment, "dp"),
        metavar="N",
        help="data-parallel ranks of --tp GPUs each, as vLLM's flag (SGLang: --dp-size with "
        "--enable-dp-attention). An MoE model: one engine whose ranks step together, attention "
        "and KV per rank, experts over all ranks; a dense model: independent replicas behind the "
        "engine's balancer (default: %(default)s)",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "--pp",
        dest="pp",
        type=int,
        default=default_of(Deployment, "pp"),
        metavar="N",
        help="pipeline stages of --tp GPUs each, as vLLM's flag (-pp): the layers split over them, the "
        "engine keeping N batches in flight (N + 1 with async scheduling); the vllm policy, trtllm, and "
        "sarathi, orca and vllm-v0 in Sarathi-Serve's pipelined engine "
        '(docs/cost_model.md, "Pipeline parallelism") (default: %(default)s)',
    )
    g.add_argument(
        "--pp-link",
        default=default_of(Deployment, "pp_link"),
        choices=PP_LINKS,
        help="with --pipeline-parallel-size: the link between the stages; auto: NVLink while --tp x "
        "stages fit one NVLink domain, ib-ndr past it; a network: the stages on separate nodes joined by "
        "it (default: %(default)s)",
    )
    g.add_argument(
        "--kernels",
        default=default_of(Deployment, "kernels"),
        metavar="ENGINE",
        help="whose GEMM and fused-MoE kernels price the layers: auto | vllm | sglang | trtllm. auto: the "
        "policy's engine (trtllm -> TensorRT-LLM's, sglang -> SGLang's, every other policy -> vLLM's); a GPU "
        "without that engine's set keeps vLLM's, with a note (docs/cost_model.md) (default: %(default)s)",
    )
    g.add_argument(
        "--all2all-backend",
        default=default_of(Deployment, "all2all_backend"),
        choices=BACKENDS,
        help="with --data-parallel-size and an MoE model: how each MoE layer moves tokens between "
        "the ranks, as vLLM's flag; deepep_auto is SGLang's --deepep-mode auto (low-latency kernels for "
        "decode steps, normal ones when a prompt runs; the sglang policy only) (default: %(default)s)",
    )
    g.add_argument(
        "--expert-imbalance",
        type=float,
        default=default_of(Deployment, "expert_imbalance"),
        metavar="R",
        help="with --enable-expert-parallel: how unevenly the router spreads tokens over the EP ranks, "
        "(max - mean) / mean per rank as the engine reports it without EPLB (TensorRT-LLM's "
        "report_load_statistics imbalance-ratio; from vLLM's logged EPLB balancedness b: 1/b - 1; "
        "DeepSeek-R1 at EP 32: 1.56). The busiest rank's experts and exchange set each MoE layer's "
        "time (docs/cost_model.md) (default: %(default)s, uniform routing)",
    )
    g.add_argument(
        "--enable-eplb",
        action="store_true",
        help="expert-parallel load balancing, as vLLM's flag (SGLang's --enable-eplb, TensorRT-LLM's "
        "load_balancer): experts placed, and --num-redundant-experts hot ones replicated, by their "
        "measured load",
    )
    g.add_argument(
        "--num-redundant-experts",
        type=int,
        default=default_of(Deployment, "num_redundant_experts"),
        metavar="N",
        help="with --enable-eplb: extra expert slots over the EP ranks (vLLM's eplb_config "
        "num_redundant_experts, SGLang's --ep-num-redundant-experts); their weights take KV memory "
        "(default: %(default)s)",
    )


RATE_HELP = "arrival rate, requests/s (sessions/s for multi-turn)"

# The workloads that read each workload option; given for another one it would be ignored.
_SYNTHETIC = ("chat", "random", "shared-prefix", "multi-turn")
WORKLOAD_OPTIONS = {
    "--rate": _SYNTHETIC,
    "--num-requests": ("chat", "random", "shared-prefix"),
    "--input-len": ("random",),
    "--output-len": ("random",),
    "--arrival": ("random",),
    "--rate-scale": ("trace",),
    "--max-requests": ("trace",),
    "--num-prefixes": ("shared-prefix",),
    "--prefix-len": ("shared-prefix",),
    "--shared-fraction": ("shared-prefix",),
    "--num-sessions": ("multi-turn",),
    "--turns": ("multi-turn",),
    "--think-time": ("multi-turn",),
}
_FIXED = {
    "hol": "hol is fixed: ten 512-token prompts decoding when one 8,192-token prompt arrives; "
    "--workload chat, random, shared-prefix or multi-turn for one of a chosen size and rate",
    "trace": "a trace keeps its own requests and arrival times; --rate-scale and --max-requests change them",
}


class _Given(argparse.Action):
    """Stores the value and remembers that the option was given, so that one the chosen workload
    does not read is refused (``check_workload_options``) instead of silently ignored."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, values)
        given = getattr(namespace, "given_workload_options", ())
        namespace.given_workload_options = (*given, self.option_strings[0])


def check_workload_options(args: argparse.Namespace) -> None:
    name = "trace" if args.trace else args.workload
    for option in getattr(args, "given_workload_options", ()):
        readers = WORKLOAD_OPTIONS[option]
        if name not in readers:
            hint = _FIXED.get(name, f"it is read by {', '.join(readers)}")
            raise CliError(f"{option} is not used by the {name} workload: {hint}")


def add_workload_args(p: argparse.ArgumentParser, rate_help: str = RATE_HELP) -> None:
    """The workload group; every default in the help is the one the command runs with (a
    command's ``set_defaults`` shows there too)."""
    from tailserve.workloads.arrivals import ARRIVAL_FORMS
    from tailserve.workloads.lengths import LENGTH_FORMS

    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default=_spec("name"),
        choices=WORKLOADS,
        help="built-in workload (default: %(default)s)",
    )
    g.add_argument(
        "--trace",
        metavar="PATH",
        help="replay a trace instead (Azure CSV, Mooncake JSONL, tailserve JSONL)",
    )
    g.add_argument(
        "--rate",
        action=_Given,
        type=float,
        default=_spec("rate"),
        help=f"{rate_help} (default: %(default)s)",
    )
    g.add_argument(
        "--num-requests",
        action=_Given,
        type=int,
        default=_spec("num_requests"),
        help="requests (chat, random, shared-prefix) (default: %(default)s)",
    )
    # Parsed from text, these default to None (WorkloadSpec's own); the help says what that is.
    g.add_argument(
        "--input-len",
        action=_Given,
        default=None,
        help=f"random: prompt lengths ({' | '.join(LENGTH_FORMS)}) (default: {_length('input_len')})",
    )
    g.add_argument(
        "--output-len",
        action=_Given,
        default=None,
        help=f"random: output lengths, same forms (default: {_length('output_len')})",
    )
    g.add_argument(
        "--arrival",
        action=_Given,
        default=None,
        help=f"random: arrival process ({' | '.join(ARRIVAL_FORMS)}) (default: {_spec('arrival')})",
    )
    g.add_argument(
        "--rate-scale",
        action=_Given,
        type=float,
        default=_spec("rate_scale"),
        help="trace: multiply the arrival rate (2 = twice as fast) (default: %(default)s)",
    )
    g.add_argument(
        "--max-requests",
        action=_Given,
        type=int,
        default=_spec("max_requests"),
        help="trace: keep the first N requests (default: all of them)",
    )
    g.add_argument(
        "--num-prefixes",
        action=_Given,
        type=int,
        default=_spec("num_prefixes"),
        help="shared-prefix: distinct system prompts (default: %(default)s)",
    )
    g.add_argument(
        "--prefix-len",
        action=_Given,
        type=int,
        default=_spec("prefix_len"),
        help="shared-prefix: system prompt tokens (default: %(default)s)",
    )
    g.add_argument(
        "--shared-fraction",
        action=_Given,
        type=float,
        default=_spec("shared_fraction"),
        help="shared-prefix: fraction of requests using one (default: %(default)s)",
    )
    g.add_argument(
        "--num-sessions",
        action=_Given,
        type=int,
        default=_spec("num_sessions"),
        help="multi-turn: conversations (default: %(default)s)",
    )
    g.add_argument(
        "--turns",
        action=_Given,
        default=None,
        help="multi-turn: turns per session, LOW:HIGH (default: {}:{})".format(*_spec("turns")),
    )
    g.add_argument(
        "--think-time",
        action=_Given,
        type=float,
        default=_spec("think_time"),
        help="multi-turn: mean seconds between turns (default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=_spec("seed"), help="random seed (default: %(default)s)")
    g.add_argument(
        "--priorities",
        default=None,
        help="give requests priorities from a mix, PRIORITY=FRACTION,... e.g. 0=0.8,10=0.2 (lower is more urgent in vLLM)",
    )
    g.add_argument(
        "--tenants",
        default=None,
        help="give requests tenants from a mix, TENANT=FRACTION,... e.g. a=0.9,b=0.1 (for --fairness vtc, SLO classes)",
    )


def add_output_args(p: argparse.ArgumentParser) -> None:
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


def deployment_from(args: argparse.Namespace) -> Deployment:
    """Names resolved to the catalog's once, here; everything after reads the canonical ones."""
    return Deployment.of(
        args.model,
        args.hardware,
        args.tp,
        args.calibration,
        getattr(args, "quantization", ""),
        getattr(args, "kv_cache_dtype", ""),
        getattr(args, "enable_expert_parallel", False),
        getattr(args, "dp", 1),
        getattr(args, "all2all_backend", default_of(Deployment, "all2all_backend")),
        getattr(args, "kernels", default_of(Deployment, "kernels")),
        expert_imbalance=getattr(args, "expert_imbalance", 0.0),
        enable_eplb=getattr(args, "enable_eplb", False),
        num_redundant_experts=getattr(args, "num_redundant_experts", 0),
        pp=getattr(args, "pp", 1),
        pp_link=getattr(args, "pp_link", default_of(Deployment, "pp_link")),
    )


def workload_from(args: argparse.Namespace) -> WorkloadSpec:
    from tailserve.workloads.arrivals import parse_arrival
    from tailserve.workloads.lengths import parse_length

    parsed: dict[str, Any] = {}  # options given as text; absent: WorkloadSpec's default
    if args.input_len is not None:
        parsed["input_len"] = parse_length(args.input_len)
    if args.output_len is not None:
        parsed["output_len"] = parse_length(args.output_len)
    if args.arrival is not None:
        parsed["arrival"] = parse_arrival(args.arrival)
    if args.priorities:
        parsed["priorities"] = parse_priorities(args.priorities)
    if args.turns is not None:
        parsed["turns"] = parse_turns(args.turns)
    if getattr(args, "tenants", None):
        from tailserve.workloads.tenants import parse_tenant_mix

        parsed["tenants"] = parse_tenant_mix(args.tenants)
    spec = WorkloadSpec(
        name="trace" if args.trace else args.workload,
        num_requests=args.num_requests,
        rate=args.rate,
        seed=args.seed,
        trace_path=args.trace,
        rate_scale=args.rate_scale,
        max_requests=args.max_requests,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        shared_fraction=args.shared_fraction,
        num_sessions=args.num_sessions,
        think_time=args.think_time,
        **parsed,
    )
    check_workload_memory(spec)
    return spec


# A built-in workload's requests are all made before the run starts: ~530 bytes each (a million
# random requests measured 527 MB of peak RSS), more while they run.
REQUEST_BYTES = 530


def check_workload_memory(spec: WorkloadSpec, available: float | None = None) -> None:
    """Refuse a workload whose requests alone need more memory than the machine has: the
    kernel's OOM killer would end the run partway, with no message (--num-requests 1e9 did)."""
    if spec.name == "multi-turn":
        count, flag, value = spec.num_sessions * spec.turns[1], "--num-sessions", spec.num_sessions
    elif spec.name in ("chat", "random", "shared-prefix"):
        count, flag, value = spec.num_requests, "--num-requests", spec.num_requests
    else:
        return  # hol is fixed; a trace's size is its file's
    need = count * REQUEST_BYTES
    if need < 2**30:
        return  # small enough not to read /proc/meminfo
    if available is None:
        from tailserve.core.host_memory import cpu_memory_available

        available = cpu_memory_available()
    if available is not None and need > available:
        raise CliError(
            f"{flag} {value:,}: its requests alone need ~{need / 2**30:,.0f} GiB before the run "
            f"(~{REQUEST_BYTES} bytes each), more than the {available / 2**30:,.1f} GiB available "
            "(MemAvailable in /proc/meminfo); use fewer"
        )


def parse_turns(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        turns = (int(low), int(high or low))
    except ValueError:
        raise CliError(f"--turns {text!r}: expected LOW:HIGH, e.g. 2:6") from None
    if not 1 <= turns[0] <= turns[1]:
        raise CliError(f"--turns {text!r}: expected 1 <= LOW <= HIGH")
    return turns


def engine_options(args: argparse.Namespace) -> EngineOptions:
    tbt_threshold(args)  # --top and --tbt-threshold refused before the run, not after its table
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


def print_notes(built: BuiltCostModel) -> None:
    for note in built.notes:
        print(f"note: {note}", file=sys.stderr)
    if built.fit is not None:
        for warning in built.fit.warnings:
            print(f"warning: calibration {built.calibration!r}: {warning}", file=sys.stderr)
