"""``--engine-cmd "vllm serve ..."``: real launch lines as the policies and the deployment of a run
(``engines/translate.py``), for ``simulate``, ``compare`` (several lines, one policy each) and
``tune`` (one line: its engine and deployment, its budget swept from there). The GPU is not on a
launch line, so ``--hardware`` stays tailserve's; the rest comes from the line, and giving it
twice (``--policy`` or a policy flag, a different ``--tp``) is one error line rather than a
silent choice. Every line runs on one deployment: lines whose model, TP or formats differ are
refused."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from tailserve.cli.base import CliError, default_of
from tailserve.policies.registry import PolicySpec

ENGINE_CMD_HELP = (
    'an engine launch line, quoted ("vllm serve MODEL --max-num-batched-tokens 2048 -tp 2", '
    '"python -m sglang.launch_server --model-path MODEL ...", "trtllm-serve MODEL ... --config FILE"): its '
    "model, TP, formats and scheduling flags (and those of trtllm-serve's YAML) become the deployment and "
    "the policy; the GPU is --hardware's. `tailserve lint` shows what each flag does"
)


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """One launch line as tailserve runs it."""

    label: str  # its engine and version, "vLLM 0.32.0"
    spec: PolicySpec
    deployment: dict[str, Any]  # model, tp, quantization, kv_cache_dtype, expert_parallel
    summary: str  # what was taken and what was not simulated, one line


def add_engine_cmd_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    g = p.add_argument_group("engine command")
    if several:
        help_text = (
            ENGINE_CMD_HELP + "; once per line to compare, each run labelled by its engine and version"
        )
        g.add_argument("--engine-cmd", metavar="COMMAND", action="append", default=None, help=help_text)
    else:
        g.add_argument("--engine-cmd", metavar="COMMAND", default=None, help=ENGINE_CMD_HELP)
    g.add_argument(
        "--acceptance-length",
        metavar="L",
        type=_acceptance_length,
        default=None,
        help="--engine-cmd lines that speculate: the drafts' mean acceptance length, tokens per verification "
        "with the bonus token (what your server reports: vLLM's 1 + spec_decode_num_accepted_tokens / "
        "spec_decode_num_drafts), where the line gives none (vLLM's synthetic_acceptance_* keys, SGLang's "
        "SGLANG_SIMULATE_ACC_LEN; TensorRT-LLM has no setting for it)",
    )
    g.add_argument(
        "--engine-version",
        metavar="V",
        default=None,
        help="--engine-cmd: the engine's version, V for every line or ENGINE=V,... (vllm=0.11,sglang=0.5.23) "
        "(default: the newest tailserve has, TensorRT-LLM 1.2.1)",
    )


def add_pd_engine_cmd_args(p: argparse.ArgumentParser) -> None:
    """``simulate``'s P/D pair from two launch lines (its --prefill-/--decode-replicas)."""
    g = p.add_argument_group("engine commands of a P/D pair (with --prefill-replicas / --decode-replicas)")
    g.add_argument(
        "--prefill-engine-cmd",
        metavar="COMMAND",
        default=None,
        help="the prefill side's launch line (vLLM with its kv-transfer connector, SGLang with "
        "--disaggregation-mode prefill, ...): its policy, flags, TP and formats for the prefill replicas",
    )
    g.add_argument(
        "--decode-engine-cmd",
        metavar="COMMAND",
        default=None,
        help="the decode side's launch line, as --prefill-engine-cmd for the decode replicas",
    )


# The flags that make a line one side of a P/D pair: what the P/D simulation itself stands for.
_PD_SIDE_FLAGS = ("--kv-transfer-config", "--disaggregation-mode")


# The command line's deployment options (args name -> the ``Deployment`` field they become).
_DEPLOYMENT_ARGS = {
    "model": "model",
    "tp": "tp",
    "quantization": "quantization",
    "kv_cache_dtype": "kv_cache_dtype",
    "enable_expert_parallel": "expert_parallel",
    "dp": "dp",
    "all2all_backend": "all2all_backend",
    "enable_eplb": "enable_eplb",
    "num_redundant_experts": "num_redundant_experts",
}


def read_pd_engine_cmds(args: argparse.Namespace) -> tuple[Any, Any, Any, Any] | None:
    """(prefill spec, decode spec, prefill deployment, decode deployment) from the two sides'
    lines (one stderr line each; the sides may differ in TP and formats, not in model), or None
    without --prefill-/--decode-engine-cmd. ``args``' deployment is left the prefill side's."""
    from tailserve.cli.options import deployment_from

    given = [getattr(args, "prefill_engine_cmd", None), getattr(args, "decode_engine_cmd", None)]
    if not any(given):
        return None
    if not all(given):
        raise CliError("--prefill-engine-cmd and --decode-engine-cmd go together (one line per side)")
    if args.engine_cmd:
        raise CliError(
            "--engine-cmd runs one engine: give the P/D pair's lines as --prefill-/--decode-engine-cmd"
        )
    for name in ("prefill_policy", "decode_policy"):
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            raise CliError(
                f"{flag} and the {flag.split('-')[2]} side's engine command set the same policy: give one"
            )
    if args.prefill_replicas is None or args.decode_replicas is None:
        raise CliError(
            "--prefill-engine-cmd / --decode-engine-cmd need --prefill-replicas and --decode-replicas"
        )
    if args.policy_flags or args.policy != "vllm":
        raise CliError("the P/D lines set each side's policy and flags: drop --policy and policy flags")
    sides = []
    deployments = []
    before = {name: getattr(args, name, None) for name in _DEPLOYMENT_ARGS}
    for side, text in zip(("prefill", "decode"), given, strict=True):
        for name, value in before.items():  # each line from the command line's own options
            setattr(args, name, value)
        args.engine_cmd = text
        try:
            (command,) = read_engine_cmds(args, pd_side=True)
        finally:
            args.engine_cmd = None
        deployment = deployment_from(args)
        if deployment.dp > 1:
            raise CliError(
                f"the {side} line's data parallelism (DP {deployment.dp}): a P/D side runs replicas of one engine"
            )
        deployments.append(deployment)
        print(f"{side} engine command: {command.summary}", file=sys.stderr)
        sides.append(command)
    if deployments[0].model != deployments[1].model:
        raise CliError(
            f"the P/D lines serve different models ({deployments[0].model}, {deployments[1].model}): a pair serves one"
        )
    for name, field in _DEPLOYMENT_ARGS.items():  # the prefill side's, for the run's title and workload
        setattr(args, name, getattr(deployments[0], field))
    return sides[0].spec, sides[1].spec, deployments[0], deployments[1]


def apply_engine_cmd(args: argparse.Namespace) -> None:
    """``simulate``: set ``args``' policy, policy flags and deployment from ``--engine-cmd`` (so one
    engine and a cluster of them read it alike). Nothing without ``--engine-cmd``."""
    if args.engine_cmd and (args.policy_flags or args.policy != "vllm"):
        given = ", ".join(
            ["--policy"] * (args.policy != "vllm") + [f"--{f.replace('_', '-')}" for f in args.policy_flags]
        )
        raise CliError(
            f"--engine-cmd sets the policy and its flags: drop {given} or put it in the engine command"
        )
    commands = read_engine_cmds(args)
    if commands:
        args.policy = commands[0].spec.name
        args.policy_flags = {**commands[0].spec.flags, **commands[0].spec.engine_flags}


def read_engine_cmds(args: argparse.Namespace, pd_side: bool = False) -> list[EngineCommand]:
    """Each ``--engine-cmd`` line as a policy spec, ``args``' deployment set from them (model, TP,
    formats), and one line on stderr per command saying what was taken and what was not
    simulated; [] without ``--engine-cmd``. ``pd_side``: the line is one side of a P/D pair
    (the caller says it), whose own P/D flags the pair simulates."""
    texts = (
        args.engine_cmd if isinstance(args.engine_cmd, list) else [args.engine_cmd] * bool(args.engine_cmd)
    )
    acceptance = getattr(args, "acceptance_length", None)
    if not texts:
        if args.engine_version:
            raise CliError("--engine-version reads --engine-cmd: give the engine command too")
        if acceptance is not None:
            raise CliError(
                "--acceptance-length reads --engine-cmd: give the engine command too (a --policy takes its "
                "engine's own acceptance flag, e.g. vllm:...:synthetic_acceptance_length=L)"
            )
        return []
    from tailserve.engines.command import parse_launch
    from tailserve.engines.lint import ENGINE_NAMES, lint
    from tailserve.engines.translate import translate
    from tailserve.executors.simulated.hardware import get_hardware

    versions = _versions(args.engine_version, ENGINE_NAMES)
    device = get_hardware(args.hardware).device_info
    commands = []
    speculates = False
    for text in texts:
        engine = parse_launch(text).engine
        report = lint(text, versions.get(engine, versions.get("")))
        translation = translate(report, device, acceptance, experts=_routed_experts)
        if pd_side:  # the pair and its KV link (--kv-link) simulate what these flags set up
            kept = tuple(i for i in translation.ignored if not i.startswith(_PD_SIDE_FLAGS))
            translation = dataclasses.replace(translation, ignored=kept)
        _check_sglang_replicas(report, translation.deployment)
        speculates = speculates or translation.speculates
        label = f"{ENGINE_NAMES[report.engine]} {report.version.version}"
        commands.append(
            EngineCommand(label, translation.spec, translation.deployment, translation.summary(report))
        )
    if acceptance is not None and not speculates:
        raise CliError(
            "--acceptance-length: no engine command has drafts tailserve simulates (none speculates, or its "
            "drafter is one listed as not simulated)"
        )
    _take_deployment(args, commands)
    for command in commands if not pd_side else ():
        print(f"engine command: {command.summary}", file=sys.stderr)
    return commands


def _check_sglang_replicas(report: Any, deployment: dict[str, Any]) -> None:
    """SGLang's plain ``--dp N`` is N engines of ``--tp`` GPUs behind its round-robin
    controller: tailserve's DP of a dense model (independent replicas behind the engine's
    balancer), but for an MoE model tailserve's DP is attention DP in lockstep, another engine."""
    from tailserve.executors.simulated.models import get_model

    if report.engine != "sglang" or deployment.get("dp", 1) < 2:
        return
    if report.values.get("enable_dp_attention") or report.values.get("attn_dp_size"):
        return
    try:
        moe = get_model(str(deployment.get("model", ""))).is_moe
    except ValueError:
        return  # an unknown model: the deployment's own error says so
    if moe:
        raise CliError(
            f"SGLang's --dp {deployment['dp']} without --enable-dp-attention runs {deployment['dp']} independent "
            "engines; tailserve runs an MoE model's --data-parallel-size as attention DP in lockstep: add "
            "--enable-dp-attention, or drop --dp from the line and simulate the replicas with --replicas"
        )


def _acceptance_length(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not value >= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(
            f"expected a number >= 1 (tokens per verification, the bonus token included), got {text}"
        )
    return value


def _versions(text: str | None, engines: dict[str, str]) -> dict[str, str]:
    """``0.11`` -> {"": "0.11"} (every line); ``vllm=0.11,sglang=0.5.23`` -> by engine."""
    if not text:
        return {}
    if "=" not in text:
        return {"": text}
    found: dict[str, str] = {}
    for item in text.split(","):
        engine, _, version = item.strip().partition("=")
        if engine not in engines or not version:
            raise CliError(
                f"--engine-version {text!r}: expected V or ENGINE=V,... with ENGINE one of {', '.join(engines)}"
            )
        found[engine] = version
    return found


def _take_deployment(args: argparse.Namespace, commands: list[EngineCommand]) -> None:
    from tailserve.executors.simulated.deployment import Deployment

    first = commands[0]
    if "model" not in first.deployment:
        raise CliError(
            "--engine-cmd names no model: add it as the engine takes it (vllm serve MODEL, --model-path MODEL)"
        )
    tp = first.deployment.get("tp", 1)
    if args.tp is not None and args.tp != tp:
        raise CliError(f"--tp {args.tp} and the engine command's TP {tp} differ: give it once")

    def resolved(d: dict[str, Any]) -> Deployment:
        return Deployment.of(
            d.get("model", ""), args.hardware, d.get("tp", 1), args.calibration, d.get("quantization", ""),
            d.get("kv_cache_dtype", ""), d.get("expert_parallel", False), d.get("dp", 1),
            d.get("all2all_backend", default_of(Deployment, "all2all_backend")),
            enable_eplb=d.get("enable_eplb", False), num_redundant_experts=d.get("num_redundant_experts", 0),
            pp=d.get("pp", 1),
        )  # fmt: skip

    for other in commands[1:]:
        if "model" not in other.deployment or resolved(other.deployment) != resolved(first.deployment):
            raise CliError(
                f"the engine commands run different deployments ({first.label}: {_shown(first.deployment)}; "
                f"{other.label}: {_shown(other.deployment)}): compare runs every line on one deployment"
            )
    args.model = first.deployment["model"]
    args.tp = tp
    for key in ("quantization", "kv_cache_dtype"):
        if key in first.deployment:
            setattr(args, key, first.deployment[key])
    if first.deployment.get("expert_parallel"):
        args.enable_expert_parallel = True
    dp = first.deployment.get("dp", 1)
    if getattr(args, "dp", 1) not in (1, dp):
        raise CliError(
            f"--data-parallel-size {args.dp} and the engine command's DP {dp} differ: give it once"
        )
    args.dp = dp
    pp = first.deployment.get("pp", 1)
    if getattr(args, "pp", 1) not in (1, pp):
        raise CliError(
            f"--pipeline-parallel-size {args.pp} and the engine command's PP {pp} differ: give it once"
        )
    args.pp = pp
    if "all2all_backend" in first.deployment:
        args.all2all_backend = first.deployment["all2all_backend"]
    if first.deployment.get("enable_eplb"):
        line = (True, first.deployment.get("num_redundant_experts", 0))
        given = (getattr(args, "enable_eplb", False), getattr(args, "num_redundant_experts", 0))
        if given != (False, 0) and given != line:
            raise CliError(
                f"--enable-eplb / --num-redundant-experts {given[1]} and the engine command's EPLB "
                f"({line[1]} redundant experts) differ: give it once"
            )
        args.enable_eplb, args.num_redundant_experts = line


def _routed_experts(model: str) -> int:
    """The routed experts of a model as a launch line names it (TensorRT-LLM's load balancer
    counts slots, not redundant experts); ValueError when the catalog does not know it."""
    from tailserve.executors.simulated.models import get_model

    return get_model(model).num_experts


def _shown(deployment: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in deployment.items() if v not in ("", False)) or "no model"
