"""``--engine-cmd "vllm serve ..."``: a real launch line as the policy and the deployment of a
simulation (``engines/translate.py``), for ``simulate``. The GPU is not on a launch line, so
``--hardware`` stays tailserve's; the rest comes from the line, and giving it twice (``--policy``
or a policy flag, a different ``--tp``) is one error line rather than a silent choice."""

from __future__ import annotations

import argparse
import sys

from tailserve.cli.base import CliError

ENGINE_CMD_HELP = (
    'an engine launch line, quoted ("vllm serve MODEL --max-num-batched-tokens 2048 -tp 2", '
    '"python -m sglang.launch_server --model-path MODEL ...", "trtllm-serve MODEL ..."): its model, '
    "TP, formats and scheduling flags become the deployment and --policy; the GPU is --hardware's. "
    "`tailserve lint` shows what each flag does"
)


def add_engine_cmd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine command")
    g.add_argument("--engine-cmd", metavar="COMMAND", default=None, help=ENGINE_CMD_HELP)
    g.add_argument(
        "--engine-version",
        metavar="V",
        default=None,
        help="--engine-cmd: the engine's version (default: the newest tailserve has)",
    )


def apply_engine_cmd(args: argparse.Namespace) -> None:
    """Set ``args``' policy, policy flags and deployment from ``--engine-cmd`` (so one engine
    and a cluster of them read it alike); print the one line saying what was taken and what was
    not simulated. Nothing without ``--engine-cmd``."""
    if not args.engine_cmd:
        if args.engine_version:
            raise CliError("--engine-version reads --engine-cmd: give the engine command too")
        return
    from tailserve.engines.lint import lint
    from tailserve.engines.translate import translate
    from tailserve.executors.simulated.hardware import get_hardware

    if args.policy_flags or args.policy != "vllm":
        given = ", ".join(
            ["--policy"] * (args.policy != "vllm") + [f"--{f.replace('_', '-')}" for f in args.policy_flags]
        )
        raise CliError(
            f"--engine-cmd sets the policy and its flags: drop {given} or put it in the engine command"
        )
    report = lint(args.engine_cmd, args.engine_version)
    device = get_hardware(args.hardware).device_info
    translation = translate(report, device)
    deployment = translation.deployment
    if "model" not in deployment:
        raise CliError(
            "--engine-cmd names no model: add it as the engine takes it (vllm serve MODEL, --model-path MODEL)"
        )
    if args.tp is not None and args.tp != deployment.get("tp", 1):
        raise CliError(
            f"--tp {args.tp} and the engine command's TP {deployment.get('tp', 1)} differ: give it once"
        )
    args.model = deployment["model"]
    args.tp = deployment.get("tp", 1)
    for key in ("quantization", "kv_cache_dtype"):
        if key in deployment:
            setattr(args, key, deployment[key])
    if deployment.get("expert_parallel"):
        args.enable_expert_parallel = True
    args.policy = translation.spec.name
    args.policy_flags = {**translation.spec.flags, **translation.spec.engine_flags}
    print(f"engine command: {translation.summary(report)}", file=sys.stderr)
