"""Lockstep P/D simulation speed: quiet decode replicas run ahead, against every replica bounding
every other, same requests, in one process, alternating.

The vLLM and SGLang pairs step their replicas in lockstep (``cluster/lockstep_pd.py``). A decode
replica that holds no request able to act on the prefill side runs up to the prefill side's next
iteration or the next arrival; the baseline bounds it by every replica's next iteration (the
loop before r55), which on two decode replicas stepped them one iteration per turn. Both runs
must give the same results to the bit (checked: every request's token times and P/D timeline).

    python -m benchmarks.pd_speed                       # vLLM, Mooncake, 6 prefill + 2 decode
    python -m benchmarks.pd_speed --policy sglang --prefill 4 --decode 4 --max-requests 4000

Prints and saves (``benchmarks/out/pd_speed.json`` unless ``--out``) wall and CPU seconds per
run, the decode replicas' turns, the ratio, the load and the CPU's SIMD flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks._common import CpuMeter, check_trace, cpu_line, default_out, default_trace, simd_flags
from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.disagg import make_pd_cluster, pd_specs
from tailserve.cluster.lockstep_pd import LockstepPdCluster
from tailserve.cluster.spec import replicated
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

MODEL, GPU = "Llama-3.1-8B", "H100-SXM"


def one_run(args: argparse.Namespace, strict: bool) -> tuple[dict, list]:
    deployment = Deployment.of(MODEL, GPU, 1)
    pspecs, dspecs = pd_specs(
        replicated(args.prefill, deployment, PolicySpec.make(args.policy, {})),
        replicated(args.decode, deployment, PolicySpec.make(args.policy, {})),
    )
    prefill = build_stage(pspecs, "prefix-aware", shares_prefixes=True, name_prefix="p", pd_pair=True)
    decode = build_stage(dspecs, "least-kv", shares_prefixes=True, name_prefix="d", pd_pair=True)
    cluster = make_pd_cluster(prefill, decode, "ib-ndr")
    assert isinstance(cluster, LockstepPdCluster)
    turns = [0] * args.decode
    step = cluster._step

    def counted(i: int, t: float, horizon: float) -> None:
        if i < args.decode:
            turns[i] += 1
        step(i, t, horizon)

    cluster._step = counted  # type: ignore[method-assign]
    if strict:  # the loop before r55: every replica's next iteration bounds every other
        cluster._coupled_first = lambda i: cluster._first()[0]  # type: ignore[method-assign]
    wb = WorkloadBuilder(WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests))
    requests = workload_requests(wb, pspecs)
    with CpuMeter() as meter:
        run = cluster.run(requests)
    result = [
        (r.request_id, r.status.name, r.token_times, asdict(run.pd_timeline[r.request_id]))
        for r in run.requests
    ]
    return {**meter.result(), "decode_turns": turns}, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(default_trace("mooncake_conversation.jsonl")))
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--policy", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--prefill", type=int, default=6)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each, alternating")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    missing = check_trace(args.trace)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.repeats < 1 or args.prefill < 1 or args.decode < 1:
        ap.error("--repeats, --prefill and --decode must be >= 1")
    print(cpu_line(), flush=True)
    print(
        f"{args.policy} P/D {args.prefill}+{args.decode} x {GPU}, {MODEL}, {Path(args.trace).name}"
        f"{f' (first {args.max_requests})' if args.max_requests else ''}; load {os.getloadavg()}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"strict": [], "quiet_ahead": []}
    reference = None
    for _ in range(args.repeats):
        for name in ("strict", "quiet_ahead"):
            record, result = one_run(args, strict=name == "strict")
            if reference is None:
                reference = result
            elif result != reference:
                print(f"error: the {name} run's results differ from the first run's", file=sys.stderr)
                return 1
            runs[name].append(record)
            print(
                f"  {name:<12} wall {record['wall_s']:7.2f} s  cpu {record['own_cpu_s']:7.2f} s  "
                f"other cpu {record['other_cpu_s']:5.2f} s  decode turns {sum(record['decode_turns']):,}",
                flush=True,
            )
    best = {name: min(r["own_cpu_s"] for r in records) for name, records in runs.items()}
    ratio = best["strict"] / best["quiet_ahead"]
    print(f"identical results; strict / quiet-ahead CPU (best of {args.repeats}): {ratio:.2f}x")
    out = args.out or default_out("pd_speed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(sys.argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "policy": args.policy,
        "prefill": args.prefill,
        "decode": args.decode,
        "max_requests": args.max_requests,
        "num_requests": len(reference or ()),
        "runs": runs,
        "cpu_ratio_strict_over_quiet_ahead": ratio,
        "loadavg_after": os.getloadavg(),
        "cpu_flags": simd_flags(),
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
