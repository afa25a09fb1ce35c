"""``tailserve simulate --replicas N | --cluster SPEC | --prefill-replicas P --decode-replicas D``:
the cluster options of ``simulate`` and the run they select (docs/cluster.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tailserve.cli.base import CliError, write_json

DEFAULT_SCRAPE_INTERVAL = 0.05  # seconds: llm-d's endpoint picker refreshes metrics every 50 ms
DEFAULT_ROUTER = "round-robin"


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (docs/cluster.md)")
    g.add_argument("--replicas", type=int, default=None, help="N data-parallel replicas of the deployment")
    g.add_argument(
        "--cluster",
        metavar="SPEC",
        default=None,
        help="heterogeneous replicas, [COUNTx]GPU[:tpN],... e.g. 2xH100-SXM:tp1,2xA100-80GB:tp2",
    )
    g.add_argument(
        "--router",
        default=None,
        help="round-robin | random | least-requests | least-kv | power-of-two | session | prefix-aware | "
        "kv-aware | vllm-dp, with flags NAME:flag=value,... (default: round-robin; not with "
        "--data-parallel-size, whose ranks sit behind the engine's own balancer)",
    )
    g.add_argument(
        "--scrape-interval",
        type=float,
        default=DEFAULT_SCRAPE_INTERVAL,
        help="seconds between the router's /metrics scrapes of each replica; 0 = always fresh (default: %(default)s)",
    )
    g.add_argument("--prefill-replicas", type=int, default=None, help="P/D: prefill replicas")
    g.add_argument("--decode-replicas", type=int, default=None, help="P/D: decode replicas")
    g.add_argument(
        "--prefill-policy", default=None, help="P/D: prefill policy NAME[:flag=value...] (default: --policy)"
    )
    g.add_argument(
        "--decode-policy",
        default=None,
        help="P/D: decode policy, vllm, sarathi or sglang (SGLang's decode server: pre-allocates KV before the prefill; its prefill side must be sglang) (default: --policy)",
    )
    g.add_argument(
        "--prefill-router", default=None, help="P/D: router in front of the prefill side (default: --router)"
    )
    g.add_argument(
        "--decode-router",
        default="least-kv",
        help="P/D: router picking the decode replica (default: %(default)s)",
    )
    g.add_argument(
        "--kv-link",
        default="ib-ndr",
        help="P/D: KV transfer link, ib-ndr | ib-hdr | roce-400g | roce-100g | nvlink | inf (default: %(default)s)",
    )


def cluster_requested(args: argparse.Namespace) -> bool:
    return any(
        getattr(args, name, None) is not None
        for name in ("replicas", "cluster", "prefill_replicas", "decode_replicas")
    )


def cluster_router(args: argparse.Namespace) -> str:
    return args.router or DEFAULT_ROUTER


def run_cluster(args: argparse.Namespace) -> int:
    from tailserve.cli.options import deployment_from, parse_slo, workload_from
    from tailserve.cluster.attribution import explain_cluster
    from tailserve.cluster.build import build_stage, workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.disagg import make_pd_cluster, pd_specs
    from tailserve.cluster.metrics import cluster_summary
    from tailserve.cluster.spec import parse_cluster, replicated
    from tailserve.core.engine import EngineOptions
    from tailserve.policies.registry import PolicySpec, parse_policy_list
    from tailserve.sim.workload_builder import WorkloadBuilder

    pd = args.prefill_replicas is not None or args.decode_replicas is not None
    if pd and (args.prefill_replicas is None or args.decode_replicas is None):
        raise CliError("--prefill-replicas and --decode-replicas go together")
    if pd and (args.replicas is not None or args.cluster is not None):
        raise CliError("--prefill-replicas/--decode-replicas cannot be combined with --replicas or --cluster")
    if args.replicas is not None and args.cluster is not None:
        raise CliError("--replicas and --cluster are alternatives; give one")
    if not pd and any(
        getattr(args, n) is not None for n in ("prefill_policy", "decode_policy", "prefill_router")
    ):
        raise CliError(
            "--prefill-policy, --decode-policy and --prefill-router need --prefill-replicas/--decode-replicas"
        )
    if getattr(args, "iterations", None) or getattr(args, "save_run", None) or getattr(args, "report", None):
        raise CliError(
            "--iterations, --save-run and --report describe one engine; not available with a cluster"
        )

    policy = PolicySpec.make(args.policy, args.policy_flags)
    deployment = deployment_from(args)
    workload = WorkloadBuilder(workload_from(args))
    # No batch record: the cluster's explanation reads routing decisions and P/D timelines.
    options = EngineOptions(fast_forward=not args.no_fast_forward, check_integrity=args.check_integrity)
    common = dict(
        shares_prefixes=workload.shares_prefixes,
        min_max_model_len=workload.min_max_model_len,
        scrape_interval=args.scrape_interval,
        options=options,
    )

    def one_policy(text: str | None, flag: str) -> PolicySpec:
        if text is None:
            return policy
        specs = parse_policy_list(text)
        if len(specs) != 1:
            raise CliError(f"{flag} {text!r}: one policy expected")
        return specs[0]

    if pd:
        lines = getattr(args, "pd_lines", None)  # --prefill-/--decode-engine-cmd
        prefill_policy = lines[0] if lines else one_policy(args.prefill_policy, "--prefill-policy")
        decode_policy = lines[1] if lines else one_policy(args.decode_policy, "--decode-policy")
        decode_deployment = lines[3] if lines else deployment
        prefill_specs, decode_specs = pd_specs(
            replicated(args.prefill_replicas, deployment, prefill_policy, "--prefill-replicas"),
            replicated(args.decode_replicas, decode_deployment, decode_policy, "--decode-replicas"),
        )
        prefill = build_stage(
            prefill_specs,
            args.prefill_router or cluster_router(args),
            name_prefix="p",
            pd_pair=True,
            **common,
        )
        decode = build_stage(decode_specs, args.decode_router, name_prefix="d", pd_pair=True, **common)
        cluster = make_pd_cluster(prefill, decode, args.kv_link)
        print_notes([*prefill.replicas, *decode.replicas])
        run = cluster.run(workload_requests(workload, prefill_specs))
        sides = f"tp{deployment.tp}" + (
            f"/tp{decode_deployment.tp}" if decode_deployment.tp != deployment.tp else ""
        )
        title = (
            f"P/D {args.prefill_replicas}+{args.decode_replicas} x {deployment.hardware}:{sides}, "
            f"KV over {cluster.links[0].name}"
        )
    else:
        if args.cluster is not None:
            specs = parse_cluster(
                args.cluster,
                deployment.model,
                policy,
                tp=args.tp,
                calibration=deployment.calibration,
                pp=deployment.pp,
                pp_link=deployment.pp_link,
                base=deployment,
            )
        else:
            specs = replicated(args.replicas, deployment, policy)
        stage = build_stage(specs, cluster_router(args), **common)
        print_notes(stage.replicas)
        run = run_aggregated(stage, workload_requests(workload, specs))
        title = f"{len(specs)} replicas" if args.cluster is None else f"cluster {args.cluster}"
    summary = cluster_summary(run, parse_slo(args.slo))
    label = policy.label
    if pd and (prefill_policy, decode_policy) != (policy, policy):  # each side's own policy
        label = f"prefill {prefill_policy.label}, decode {decode_policy.label}"
    summary["label"] = f"{title}, {label}, {workload.spec.label}"
    print_cluster(summary)
    print_run_notes(summary)
    if args.explain:
        explanation = explain_cluster(run)
        print()
        for line in explanation["lines"]:
            print(line)
        summary["explanation"] = explanation
    if args.json:
        write_json(args.json, summary)
    return 0


def run_data_parallel(args: argparse.Namespace) -> int:
    """``simulate --data-parallel-size N``: the engine's DP ranks behind its own balancer, in
    lockstep for an MoE model (cluster/dp_group.py)."""
    from tailserve.cli.options import deployment_from, parse_slo, workload_from
    from tailserve.cluster.attribution import explain_cluster
    from tailserve.cluster.build import workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.dp_group import balancer_label, build_dp_stage
    from tailserve.cluster.metrics import cluster_summary
    from tailserve.cluster.replica import ReplicaSpec
    from tailserve.core.engine import EngineOptions
    from tailserve.metrics.explain_text import expert_load_words, stream_words
    from tailserve.policies.registry import PolicySpec
    from tailserve.sim.run import expert_load_config
    from tailserve.sim.workload_builder import WorkloadBuilder

    if cluster_requested(args):
        raise CliError(
            "--data-parallel-size describes one engine: it cannot be combined with --replicas, --cluster or P/D"
        )
    if getattr(args, "iterations", None) or getattr(args, "save_run", None) or getattr(args, "report", None):
        raise CliError(
            "--iterations, --save-run and --report describe one rank; not available with --data-parallel-size"
        )
    policy = PolicySpec.make(args.policy, args.policy_flags)
    deployment = deployment_from(args)
    balancer = balancer_label(policy, deployment.data_parallel_group)
    if getattr(args, "router", None) is not None or getattr(args, "prefill_router", None) is not None:
        # The engine places requests on its own ranks: a router would be a claim the run does
        # not honour.
        raise CliError(
            f"--router {args.router or args.prefill_router} routes between replicas; with --data-parallel-size "
            f"the engine's own balancer ({balancer}) places requests on its ranks: drop --router, "
            "or use --replicas N for independent engines behind a router"
        )
    workload = WorkloadBuilder(workload_from(args))
    options = EngineOptions(fast_forward=not args.no_fast_forward, check_integrity=args.check_integrity)
    stage = build_dp_stage(
        deployment,
        policy,
        shares_prefixes=workload.shares_prefixes,
        min_max_model_len=workload.min_max_model_len,
        options=options,
    )
    print_notes(stage.replicas, stage.cost_notes)
    run = run_aggregated(stage, workload_requests(workload, [ReplicaSpec(deployment, policy)]))
    summary = cluster_summary(run, parse_slo(args.slo))
    kind = (
        f"one engine, DP {deployment.dp} x TP {deployment.tp} in lockstep, experts over {deployment.gpus} GPUs"
        f"{' (EP)' if deployment.expert_parallel else ''}, {deployment.all2all_backend}"
        if deployment.data_parallel_group
        else f"{deployment.dp} independent DP ranks of TP {deployment.tp}"
        + (f" x PP {deployment.pp}" if deployment.pp > 1 else "")
    )
    routing = expert_load_config(stage.cost_model) if deployment.data_parallel_group else None
    run_config: dict[str, Any] = {}  # what explain reads of the run (sim/run.py's run config)
    if routing is not None:
        kind += f", {deployment.expert_load.describe()}"
        summary["expert_load"] = run_config["expert_load"] = routing
    if run.stream.is_set:
        run_config["stream_interval"] = run.stream.to_json()
    summary["label"] = (
        f"{deployment.model} on {deployment.hardware}: {kind}, balancer {balancer}, "
        f"{policy.label}, {workload.spec.label}"
    )
    print_cluster(summary)
    if args.explain:
        explanation = explain_cluster(run)
        # the run's streaming and routing, as one engine's explain says them
        said = stream_words(run_config, run.requests) + expert_load_words(run_config)
        if said:
            explanation["lines"].append(said.strip())
        print()
        for line in explanation["lines"]:
            print(line)
        summary["explanation"] = explanation
    if args.json:
        write_json(args.json, summary)
    return 0


def print_run_notes(summary: dict[str, Any]) -> None:
    """What each replica's policy says of the run, on stderr, one line each."""
    import sys

    for stage in summary["stages"].values():
        for replica in stage["replicas"]:
            for note in replica["notes"]:
                print(f"note: {replica['name']}: {note}", file=sys.stderr)


def print_notes(replicas: Any, cost_notes: tuple[str, ...] = ()) -> None:
    """The replicas' engines' notes, each once, on stderr (vLLM's async scheduling on or off,
    and why; uneven expert routing), as ``simulate`` prints one engine's."""
    from tailserve.executors.simulated.deployment import expert_load_note

    routing = []
    for r in replicas:
        cost = getattr(r.engine.executor, "cost_model", None)
        if cost is not None and (not cost.expert_load.is_uniform or cost.expert_load.eplb):
            routing.append(expert_load_note(cost))
    for note in dict.fromkeys([*(n for r in replicas for n in r.built.notes), *cost_notes, *routing]):
        print(f"note: {note}", file=sys.stderr)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def print_cluster(summary: dict[str, Any]) -> None:
    from rich.table import Table

    from tailserve.report.tables import console

    m = summary["metrics"]
    overall = Table(title=summary["label"], title_justify="left")
    for col in (
        "requests",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TBT p99 ms",
        "prefix hit",
        "out tok/s",
        "sim wall s",
    ):
        overall.add_column(col, justify="right")
    overall.add_row(
        f"{summary['num_finished']}/{summary['num_requests']}",
        _ms(m["ttft_s"]["p50"]),
        _ms(m["ttft_s"]["p99"]),
        _ms(m["itl_s"]["p99"]),
        f"{summary['prefix_cache']['hit_rate_tokens']:.1%}",
        f"{summary['throughput']['output_tokens_per_s']:,.0f}",
        f"{summary['wall_s']:.2f}",
    )
    console.print(overall)
    for name, stage in summary["stages"].items():
        table = Table(title=f"{name}: router {stage['router']}", title_justify="left")
        for col in (
            "replica",
            "GPU",
            "routed",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "busy",
            "prefix hit",
            "preempt",
        ):
            table.add_column(col, justify="right")
        for r in stage["replicas"]:
            table.add_row(
                r["name"],
                r["deployment"],
                str(r["num_routed"]),
                _ms(r["ttft_s"]["p50"]),
                _ms(r["ttft_s"]["p99"]),
                f"{r['busy_fraction']:.0%}",
                f"{r['prefix_hit_rate_tokens']:.1%}",
                str(r["num_preemptions"]),
            )
        console.print(table)
    if "kv_transfer_s" in summary:
        x = summary["kv_transfer_s"]
        console.print(f"KV transfer: p50 {_ms(x['p50'])} ms, p99 {_ms(x['p99'])} ms")
    if "decode_admission_wait_s" in summary:
        x = summary["decode_admission_wait_s"]
        console.print(
            f"decode admission (the prompt's KV kept on its prefill replica until then): "
            f"p50 {_ms(x['p50'])} ms, p99 {_ms(x['p99'])} ms"
        )
