"""``tailserve cost``: the cost model's predicted time of one prefill and one decode iteration
(and, with ``--swap``, of swapping KV over PCIe) on a deployment."""

from __future__ import annotations

import argparse
from typing import Any

from tailserve.cli.base import CliError, write_json
from tailserve.cli.options import add_deployment_args, deployment_from, print_notes
from tailserve.executors.simulated.deployment import build_cost_model
from tailserve.report.tables import print_cost


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cost", help="predicted iteration times of a prefill and a decode step")
    add_deployment_args(p)
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
    p.add_argument(
        "--drafts",
        type=int,
        default=None,
        metavar="K",
        help="also price the decode batch verifying K draft tokens each and the drafter's pass "
        "(speculative decoding), and its time per output token at --acceptance-length",
    )
    p.add_argument(
        "--draft-method",
        default="mtp",
        choices=("mtp", "eagle", "eagle3", "ngram", "ngram_gpu"),
        help="--drafts: the drafter, as vLLM's speculative method (default: %(default)s)",
    )
    p.add_argument(
        "--acceptance-length",
        type=float,
        default=None,
        metavar="L",
        help="--drafts: mean tokens per verification, the bonus token included (default: 1 + K/2)",
    )
    p.add_argument("--json", metavar="OUT", help="write {prefill_s, decode_s} (and swap_s, drafts) as JSON")
    p.set_defaults(run=cmd_cost)


def cmd_cost(args: argparse.Namespace) -> int:
    from tailserve.executors.simulated.cost_model import BatchShape
    from tailserve.executors.simulated.module_formats import group_dtypes
    from tailserve.executors.simulated.window import WindowShape

    # Every count checked before any work: a prefill of 0 or -5 tokens, or a negative cached
    # context, was priced and printed as if it were a step (and a bad --swap came after the table).
    if args.prefill < 1:
        raise CliError(f"--prefill must be >= 1 token, got {args.prefill}")
    if args.prefill_context < 0:
        raise CliError(f"--prefill-context must be >= 0 tokens, got {args.prefill_context}")
    if args.swap is not None and args.swap < 1:
        raise CliError(f"--swap must be >= 1 token, got {args.swap}")
    if args.drafts is None and args.acceptance_length is not None:
        raise CliError("--acceptance-length prices --drafts K: give the draft count too")
    if args.drafts is not None and args.drafts < 1:
        raise CliError(f"--drafts must be >= 1 token, got {args.drafts}")
    built = build_cost_model(deployment_from(args))
    cm = built.cost_model
    batch, ctx = _parse_decode(args.decode)
    _check_fits(cm, args.prefill)  # before the notes: a deployment that cannot load is one line
    print_notes(built)
    prefill = [(args.prefill, args.prefill_context)]
    prefill_shape = BatchShape.of(prefill, [])
    decode_shape = BatchShape.of([], [ctx] * batch)
    window = cm.model.sliding_window if cm.windowed else 0
    prefill_window = WindowShape.of(prefill, [], window) if window else None
    decode_window = WindowShape.of([], [ctx] * batch, window) if window else None
    result: dict[str, Any] = {
        "prefill_s": cm.iteration_time(prefill_shape, prefill_window),
        "decode_s": cm.iteration_time(decode_shape, decode_window),
    }
    print_cost(
        built,
        args.prefill,
        args.prefill_context,
        batch,
        ctx,
        result,
        cm.roofline(prefill_shape, prefill_window),
        cm.roofline(decode_shape, decode_window),
    )
    # every group's weight format (module_formats.py): which GEMMs run quantized, which do not
    result["weight_formats"] = group_dtypes(cm.model)
    if built.kernels != "vllm":  # the catalog's own curves are vLLM's: named only when another's priced it
        result["kernels"] = built.kernels
    if cm.dp > 1:
        per_layer = cm.exchange_time(batch) * 1e6
        print(
            f"data-parallel attention: each of the {cm.dp} DP ranks (TP {cm.tp}) runs the batch above "
            f"({cm.dp}x the requests in all); experts over {cm.dp * cm.tp} GPUs"
            f"{' whole (EP)' if cm.expert_parallel else ' sliced'}; {cm.all2all} exchange "
            f"{per_layer:.1f} us per MoE layer at the decode batch ({cm.model.num_moe_layers} layers)"
        )
        result["dp"] = cm.dp
    if cm.pipeline is not None:
        result["pipeline"] = _pipeline_stages(cm, prefill_shape, decode_shape, result)
    if args.drafts is not None:
        result["drafts"] = _price_drafts(
            cm, batch, ctx, args.drafts, args.draft_method, args.acceptance_length
        )
        d = result["drafts"]
        print(
            f"drafts: {args.drafts} per request ({args.draft_method}): a step verifying {1 + args.drafts} tokens "
            f"of each of the {batch} decodes takes {d['step_s'] * 1e3:.2f} ms (target {d['verify_s'] * 1e3:.2f} + "
            f"drafter {d['drafter_s'] * 1e3:.2f}); at {d['acceptance_length']:g} tokens per verification "
            f"{d['per_token_s'] * 1e3:.2f} ms per output token against {result['decode_s'] * 1e3:.2f} without "
            f"drafts ({result['decode_s'] / d['per_token_s']:.2f}x)"
        )
    if args.swap is not None:
        result["swap_s"] = cm.swap_time(args.swap)
        per_gpu = args.swap * cm.model.kv_bytes_per_token(cm.tp)
        print(
            f"swap {args.swap:,} tokens: {per_gpu / 1e9:.2f} GB of KV per GPU "
            f"({args.swap * cm.model.kv_bytes_per_token() / 1e9:.2f} GB in all) over "
            f"{cm.hardware.pcie_bandwidth / 1e9:.0f} GB/s PCIe: {result['swap_s'] * 1e3:.1f} ms"
        )
    if args.json:
        write_json(args.json, result)
    return 0


def _pipeline_stages(cm: Any, prefill: Any, decode: Any, result: dict[str, Any]) -> dict[str, Any]:
    """Each step above on the stages (``pipeline.py``): the stage times, the send between two,
    and a trip through all of them (the overhead is the host's, once before stage 1)."""
    pipe, overhead = cm.pipeline, cm.efficiency.overhead
    out: dict[str, Any] = {"pp": pipe.pp, "layers": list(pipe.layers), "link": pipe.link.name}
    for name, shape in (("prefill", prefill), ("decode", decode)):
        stages, send = cm.pipeline_split(result[f"{name}_s"] - overhead, shape.num_tokens, shape.num_logits)
        trip = overhead + sum(stages) + send * (pipe.pp - 1)
        # A stage past the first receives its batch's activations before computing it.
        pace = max(t + (send if k else 0.0) for k, t in enumerate(stages))
        out[name] = {"stages_s": list(stages), "send_s": send, "trip_s": trip, "pace_s": pace}
        print(
            f"{name} on {pipe.pp} stages ({'/'.join(map(str, pipe.layers))} layers): "
            f"{' + '.join(f'{t * 1e3:.2f}' for t in stages)} ms, {send * 1e6:.1f} us each send "
            f"({pipe.link.name}); a trip {trip * 1e3:.2f} ms with the host's {overhead * 1e3:.2f}; "
            f"the pipeline takes a new batch every {pace * 1e3:.2f} ms when full"
        )
    return out


def _price_drafts(cm: Any, batch: int, ctx: int, k: int, method: str, length: float | None) -> dict[str, Any]:
    """A decode step of ``batch`` requests at ``ctx`` tokens, each verifying ``1 + k`` tokens,
    priced as the simulated executor prices one (``advanced_batch_shape``: a small chunk after
    its context with logits at every position; the drafter's pass, ``DrafterCost``), and the time
    per output token at ``length`` tokens per verification."""
    from tailserve.executors.simulated.cost_model import BatchShape
    from tailserve.executors.simulated.spec_decode import DrafterCost, SpecDecoding, resolve_acceptance_rates

    length = 1 + k / 2 if length is None else length
    try:
        spec = SpecDecoding(method, k, resolve_acceptance_rates(k, None, length))
    except ValueError as e:
        raise CliError(f"--acceptance-length: {e}") from None
    q = 1 + k
    verify = BatchShape(
        batch * q, batch * q, batch * (q * ctx + q * (q + 1) // 2), batch * (q + ctx), 0, 0, 0
    )
    verify_s = cm.iteration_time(verify)
    drafter_s = DrafterCost(cm, spec).time(verify, batch, batch * (ctx + q))
    step_s = verify_s + drafter_s
    return {
        "num_drafts": k,
        "method": method,
        "acceptance_length": length,
        "verify_s": verify_s,
        "drafter_s": drafter_s,
        "step_s": step_s,
        "per_token_s": step_s / length,
    }


def _check_fits(cm: Any, prefill_tokens: int) -> None:
    """The same memory check ``simulate`` makes (vLLM's default memory fraction and block size,
    activations for the priced prefill): a deployment that cannot load is an error, not a time."""
    from tailserve.executors.simulated.kv_capacity import kv_capacity
    from tailserve.policies.registry import get_policy_cls

    vllm = get_policy_cls("vllm")
    model, extra, pp = cm.fullest_stage  # the fullest stage's weights and KV, as simulate sizes them
    kv_capacity(
        model,
        cm.hardware,
        cm.tp,
        vllm.default_gpu_memory_utilization,
        vllm.default_block_size,
        max(prefill_tokens, 1),
        dp=cm.dp,
        extra_weights=extra,
        pp=pp,
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
