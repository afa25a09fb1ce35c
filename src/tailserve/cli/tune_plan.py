"""``tailserve tune --gpus N``: capacity of every layout of a GPU budget (all aggregated replicas
and each prefill:decode split) under the SLO, as a table and JSON (tune/cluster_plan.py). The
cluster runs go through the sweep options like every tune: ``--workers``, ``--ray-address``, ``--quiet``,
and ``--out FILE.jsonl`` (resumed unless ``--no-resume``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from tailserve.cli.base import CliError, write_json
from tailserve.cli.sweep_options import make_sweep
from tailserve.cluster.dp_group import balancer_label
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec, parse_policy_list
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import CapacitySlo
from tailserve.tune.cluster_plan import PlanRow, plan, plannable_pps, unfit
from tailserve.tune.sweep import ResultsFile

console = Console()


# The --plan-* options' defaults: one that differs was given, and only a GPU budget reads them.
PLAN_DEFAULTS: dict[str, str | None] = {
    "plan_policy": "vllm",
    "plan_router": "prefix-aware",
    "plan_link": "ib-ndr",
    "plan_tps": None,
    "plan_dp": None,
    "plan_ep": "both",
    "plan_eplb": None,
    "plan_pp": None,
}


def check_plan_args(args: argparse.Namespace) -> None:
    """Without --gpus (or --data-parallel-size) tune sweeps one replica and never reads the
    --plan-* options: one given is refused, not silently ignored."""
    for name, default in PLAN_DEFAULTS.items():
        if getattr(args, name) != default:
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag} plans a GPU budget: it needs --gpus N (docs/cluster.md)")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity planning (docs/cluster.md)")
    g.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="plan a GPU budget instead: the capacity of N GPUs as aggregated replicas and as each "
        "prefill:decode split (replicas of --tp GPUs each)",
    )
    g.add_argument(
        "--plan-policy",
        default=PLAN_DEFAULTS["plan_policy"],
        help="--gpus: each replica's policy (default: %(default)s)",
    )
    g.add_argument(
        "--plan-router",
        default=PLAN_DEFAULTS["plan_router"],
        help="--gpus: router of the aggregated and prefill side (default: %(default)s)",
    )
    g.add_argument(
        "--plan-link",
        default=PLAN_DEFAULTS["plan_link"],
        help="--gpus: KV link of a P/D split (default: %(default)s)",
    )
    g.add_argument(
        "--plan-tps",
        default=None,
        metavar="1,2,4,8",
        help="--gpus: also search the replicas' TP over these degrees (those dividing the GPUs and "
        "the model's heads; default: --tp only)",
    )
    g.add_argument(
        "--plan-dp",
        default=None,
        metavar="2,4,8",
        help="--gpus, MoE models: also plan one engine of data-parallel attention over the whole "
        "budget at these DP sizes, TP = GPUs / DP (ranks in lockstep behind the engine's own balancer; "
        "experts as --plan-ep)",
    )
    g.add_argument(
        "--plan-ep",
        default=PLAN_DEFAULTS["plan_ep"],
        choices=("off", "on", "both"),
        help="--gpus --plan-tps, MoE models: experts sliced over the TP ranks, split whole "
        "(--enable-expert-parallel), or both (default: %(default)s)",
    )
    g.add_argument(
        "--plan-eplb",
        default=PLAN_DEFAULTS["plan_eplb"],
        metavar="off,0,32",
        help="--gpus or --data-parallel-size, expert-parallel layouts: each once per EPLB setting, off or "
        "its redundant experts (vLLM's --enable-eplb with num_redundant_experts); what EPLB balances is "
        "--expert-imbalance's routing (docs/tune.md)",
    )
    g.add_argument(
        "--plan-pp",
        default=PLAN_DEFAULTS["plan_pp"],
        metavar="1,2,4",
        help="--gpus: also plan each replica shape at these pipeline-parallel sizes, replicas of TP x PP "
        "GPUs (those dividing the GPUs, with room for a KV cache on the fullest stage; PP > 1: aggregated "
        "replicas only, a --plan-policy simulated under stages: vllm, trtllm, sarathi, orca, vllm-v0, the "
        "last three where the stages divide the layers; default: --pipeline-parallel-size only)",
    )


def _ms(summary: dict[str, Any] | None, metric: str) -> str:
    if summary is None or summary["metrics"][metric]["p99"] is None:
        return "-"
    return f"{summary['metrics'][metric]['p99'] * 1e3:,.0f}"


def run_plan(
    args: argparse.Namespace,
    deployment: Deployment,
    workload: WorkloadSpec,
    slo: CapacitySlo,
    label: str,
    policy: PolicySpec | None = None,
) -> int:
    """``policy``: the engine's (an --engine-cmd line's, or --policies' one) instead of
    --plan-policy's."""
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    if policy is None:
        policies = parse_policy_list(args.plan_policy)
        if len(policies) != 1:
            raise ValueError(f"--plan-policy takes one policy, got {args.plan_policy!r}")
        policy = policies[0]
    tps = _tps(args.plan_tps) if args.plan_tps else None
    pps = list(dict.fromkeys(_tps(args.plan_pp, "--plan-pp", "PP sizes"))) if args.plan_pp else None
    dp_only = deployment.dp > 1  # tune --data-parallel-size: that one DP engine's capacity
    dps = (
        [deployment.dp]
        if dp_only
        else (_tps(args.plan_dp, "--plan-dp", "DP sizes") if args.plan_dp else None)
    )
    if pps:  # the PP sizes the policy runs on, before the heading names them
        pps, note = plannable_pps(policy, deployment, pps)
        if note:
            print(f"tailserve: --plan-pp: {note}", file=sys.stderr)
    if not dp_only:
        _print_left_out(args.gpus, deployment, tps, pps)
    eplb = _eplb_settings(args.plan_eplb, deployment) if args.plan_eplb else None
    results = ResultsFile(args.out, resume=not args.no_resume) if args.out else None
    notes: list[str] = []
    with make_sweep(args, results) as sweep:
        rows = plan(
            args.gpus, deployment, policy, workload, slo, router=args.plan_router, link=args.plan_link,
            rel_tol=args.rel_tol, sweep=sweep, tps=[deployment.tp] if dp_only else tps,
            expert_parallel=("on" if deployment.expert_parallel else "off") if dp_only else args.plan_ep,
            dps=dps, dp_only=dp_only, eplb=eplb, notes=notes, pps=pps,
        )  # fmt: skip
    for note in notes:
        print(f"tailserve: --plan-eplb: {note}", file=sys.stderr)
    where = f" ({sweep.num_reused} reused from {results.path})" if results is not None else ""
    print(f"runs: {sweep.num_executed} simulated{where}", file=sys.stderr)
    own_pp = f" x PP {deployment.pp}" if deployment.pp > 1 else ""
    if tps:  # the replicas' TP is searched: the deployment's own is not the one run
        label = label.replace(f", TP {deployment.tp}{own_pp},", ",", 1)
    elif pps and own_pp:  # its PP is
        label = label.replace(f", TP {deployment.tp}{own_pp},", f", TP {deployment.tp},", 1)
    console.print(f"{label} — {workload.label}")
    shape = f"replicas of TP {', '.join(map(str, tps))}" if tps else f"replicas of TP {deployment.tp}"
    shape += f" x PP {', '.join(map(str, pps))}" if pps else own_pp
    if dp_only:
        shape = f"one engine of DP {deployment.dp} x TP {deployment.tp}"
    elif dps:
        shape += f", and one engine of DP {', '.join(map(str, dps))} ranks"
    routing = f"router {args.plan_router}, P/D link {args.plan_link}"
    if dp_only:
        routing = f"the engine's balancer {balancer_label(policy, deployment.data_parallel_group)}"
    console.print(f"SLO: {slo}; {args.gpus} GPUs as {shape}, {policy.label}, {routing}")
    table = Table(title="capacity of each layout (highest rate meeting the SLO)", title_justify="left")
    for name in ("layout", "capacity\nreq/s", "TTFT p99\nms", "TBT p99\nms", "prefix hit"):
        table.add_column(name, justify="left" if name == "layout" else "right")
    best = max(rows, key=lambda r: r.rate)
    for row in rows:
        s = row.summary_at_rate
        hit = "-" if s is None else f"{s['prefix_cache']['hit_rate_tokens']:.1%}"
        rate = f"{row.rate:.3g}" if row.rate > 0 else "none"
        marker = " *" if row is best and row.rate > 0 else ""
        table.add_row(row.layout.label + marker, rate, _ms(s, "ttft_s"), _ms(s, "itl_s"), hit)
    console.print(table)
    if args.json:
        write_json(args.json, {"gpus": args.gpus, "slo": str(slo), "rows": [_row_json(r) for r in rows]})
    return 0


def _eplb_settings(text: str, deployment: Deployment) -> list[int]:
    """``--plan-eplb off,0,32``: -1 for off, else the redundant experts; a note when the routing
    is uniform (EPLB then has nothing to balance)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "off":
            out.append(-1)
            continue
        try:
            n = int(item)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(
                f"--plan-eplb takes off or redundant-expert counts >= 0, separated by commas, got {text!r}"
            )
        out.append(n)
    if not out:
        raise ValueError(f"--plan-eplb takes off or redundant-expert counts, got {text!r}")
    if deployment.expert_imbalance == 0:
        print(
            "note: --plan-eplb with uniform routing: EPLB has nothing to balance and its redundant experts "
            "only take KV memory; give --expert-imbalance R (the ratio your engine reports)",
            file=sys.stderr,
        )
    return list(dict.fromkeys(out))


def _print_left_out(gpus: int, deployment: Deployment, tps: list[int] | None, pps: list[int] | None) -> None:
    """On stderr, each TP of ``tps`` that fits at none of the PP sizes (``pps``, else the
    deployment's own) whose replicas divide the budget, and with ``pps`` each TP x PP left out
    where the TP fits at another."""
    sizes = pps or [deployment.pp]
    for tp in tps or [deployment.tp]:
        reasons = {pp: unfit(deployment, [tp], pp=pp).get(tp) for pp in sizes if gpus % (tp * pp) == 0}
        if not reasons:
            continue
        if tps and all(reasons.values()):  # at the largest PP: the nearest it came to fitting
            pp, reason = max(reasons.items())
            at = f" (at PP {pp})" if pps else ""
            print(f"tailserve: --plan-tps: TP {tp} left out{at}: {_reason(reason)}", file=sys.stderr)
        elif pps:
            for pp, reason in reasons.items():
                if reason:
                    print(
                        f"tailserve: --plan-pp: TP {tp} x PP {pp} left out: {_reason(reason)}",
                        file=sys.stderr,
                    )


def _reason(reason: str | None) -> str:
    return (reason or "").split(", try --tp")[0]


def _tps(text: str, flag: str = "--plan-tps", what: str = "TP degrees") -> list[int]:
    try:
        tps = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes {what} separated by commas, got {text!r}") from None
    if not tps or min(tps) < 1:
        raise ValueError(f"{flag} takes {what} >= 1, got {text!r}")
    return tps


def _row_json(row: PlanRow) -> dict[str, Any]:
    return {
        "layout": row.layout.label,
        "num_prefill": row.layout.num_prefill,
        "num_decode": row.layout.num_decode,
        "tp": row.layout.tp or None,
        "expert_parallel": row.layout.expert_parallel,
        "dp": row.layout.dp or None,
        "pp": row.layout.pp or None,
        "capacity_rps": row.rate,
        "upper_rps": row.upper,
        "summary": row.summary_at_rate,
    }
