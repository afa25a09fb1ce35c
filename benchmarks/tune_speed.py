"""How fast is a full ``tailserve tune``, serially, on a 2-process pool and on a local Ray?

The job: Llama-3-70B / A100-80GB / TP 4 (the seed calibration) on the Azure LLM inference 2023
conversation trace (first N requests), the default SLO (p99 TTFT <= 2 s, p99 TBT <= 200 ms), the
six default policies (vllm, sarathi, sglang, tgi, vllm-v0, slo), capacity by bisection to 5%, each
capacity replayed with twice the requests, the throughput ceiling (3 runs), then 8 budget / chunk
sizes (128 ... 16,384) per policy with a budget (slo has none) at the best capacity: 91 runs with
the default 2,000 requests. On a 2-core machine the pool's gain depends on the other load (none at
load average 4.5-6.8; docs/tune.md#speed). The same job runs three times with a fresh results
file each time (nothing reused): ``--workers 1``, ``--workers 2`` and ``--ray auto`` (a local Ray
instance started for the run, its start-up included in the wall time and also reported alone). Prints and saves the wall times, the speedups over one worker,
and whether the three produced identical results.

    python benchmarks/tune_speed.py [--trace PATH] [--max-requests N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from _paths import check_trace, default_out, default_trace

from tailserve.policies.registry import parse_policy_list
from tailserve.sim.deployment import Deployment
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import DEFAULT_SLO, parse_capacity_slo
from tailserve.tune.recommend import DEFAULT_TUNE_POLICIES, TuneConfig, tune, tune_json
from tailserve.tune.sweep import ProcessBackend, RayBackend, ResultsFile, SerialBackend, Sweep

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = default_trace("azure_llm_2023_conv.csv")


def one_tune(name: str, config: TuneConfig, make_backend) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results = ResultsFile(Path(tmp) / "runs.jsonl")
        loadavg = os.getloadavg()
        t0 = time.perf_counter()
        backend = make_backend()
        start_s = time.perf_counter() - t0
        with Sweep(backend, results, quiet=True) as sweep:
            result = tune(config, sweep)
        wall = time.perf_counter() - t0
        # Seconds the simulations took where they ran: with a busy machine or two runs sharing
        # the cores each run takes longer, which this shows apart from the scheduling of runs.
        sim_s = sum(row["wall_s"] for row in results.rows())
    print(
        f"{name:>10}: {wall:6.1f} s wall ({start_s:.1f} s to start), {sweep.num_executed} runs "
        f"taking {sim_s:.1f} s where they ran (parallelism {sim_s / (wall - start_s):.2f})"
    )
    return {
        "backend": name,
        "wall_s": wall,
        "start_s": start_s,
        "num_runs": sweep.num_executed,
        "sum_run_s": sim_s,
        "parallelism": sim_s / (wall - start_s),
        "loadavg_before": loadavg,
        "loadavg_after": os.getloadavg(),
        "result": tune_json(result),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/out/tune_speed.json, git-ignored)"
    )
    args = parser.parse_args()
    args.out = args.out or str(default_out("tune_speed.json"))
    if (problem := check_trace(args.trace)) is not None:
        raise SystemExit(f"tune_speed: error: {problem}")

    config = TuneConfig(
        Deployment("Llama-3-70B", "A100-80GB", 4),
        WorkloadSpec("trace", trace_path=args.trace, max_requests=args.max_requests),
        parse_capacity_slo(DEFAULT_SLO),
        tuple(parse_policy_list(DEFAULT_TUNE_POLICIES)),
    )
    runs = [
        one_tune("1 worker", config, SerialBackend),
        one_tune("2 workers", config, lambda: ProcessBackend(2)),
        one_tune("local Ray", config, lambda: RayBackend("auto")),
    ]
    serial = runs[0]
    identical = all(
        json.dumps(r["result"], sort_keys=True) == json.dumps(serial["result"], sort_keys=True) for r in runs
    )
    out = {
        "job": (
            f"tune, Llama-3-70B / A100-80GB / TP 4 (seed calibration), Azure conversation trace first "
            f"{args.max_requests} requests, SLO {DEFAULT_SLO}, policies {DEFAULT_TUNE_POLICIES}, "
            "8 sizes, capacity to 5%"
        ),
        "runs": [{k: v for k, v in r.items() if k != "result"} for r in runs],
        "speedup_2_workers": serial["wall_s"] / runs[1]["wall_s"],
        "speedup_local_ray": serial["wall_s"] / runs[2]["wall_s"],
        "identical_results": identical,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "result": serial["result"],
    }
    print(
        f"speedup over 1 worker: 2 workers {out['speedup_2_workers']:.2f}x, local Ray {out['speedup_local_ray']:.2f}x; "
        f"identical results: {identical}"
    )
    for p in serial["result"]["policies"]:
        print(
            f"  {p['policy']:>8}: capacity {p['capacity_req_s']:.3g} req/s, best {p['knob']} {p['best_size']}"
        )
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
