"""A tune sweep's scaling: the same configurations serially, on local worker processes and on a
local Ray of 1 and N processes, with their wall time, each run's CPU time and identical results.

The sweep: Llama-3-8B on one H100-SXM, the built-in ``chat`` workload of 2,000 requests at
10 req/s (seed 0), and up to 1,000 configurations of five policies, 200 each: vllm
(max_num_batched_tokens x max_num_seqs), sarathi (chunk_size x max_num_seqs), sglang
(chunked_prefill_size x max_running_requests), tgi (max_batch_prefill_tokens x max_batch_size)
and trtllm with chunked prefill (max_num_tokens x max_batch_size): 20 token budgets from 256 to
16,384 by 10 batch limits from 8 to 256. The configurations are shuffled with a fixed seed, so the
first ``--configs`` of them are a sample of the whole grid, not one policy's corner.

Each backend runs the same specs from scratch (no results file): ``serial`` (this process,
``--workers 1``), ``pool N`` (``--workers N``: spawned processes), ``ray N`` (``--ray-address
local`` with ``--workers N``: a Ray instance of N CPUs started for it, its start-up timed apart).
For each it reports the wall time (backend start included), the runs' own CPU seconds (each
run's thread, where it ran), the CPU seconds other processes of the machine used meanwhile
(``other_cpu_s``: the load the figure was taken under), and checks every summary against the
serial one. Scaling of N workers: (wall of 1 / wall of N) / N, 1.0 is linear.

    python -m benchmarks.tune_speed [--configs 1000] [--ray-configs 1000] [--workers 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from benchmarks._common import CpuMeter, cpu_line, save_results
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.backends import Backend, ProcessBackend, RayBackend, SerialBackend, usable_cpus
from tailserve.tune.sweep import RunOutcome, RunSpec, Sweep

TOKENS = (256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 4096,
          6144, 8192, 12288, 16384)  # fmt: skip
BATCH = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# policy -> (token-budget flag, batch-limit flag, fixed flags)
GRID: dict[str, tuple[str, str, dict[str, Any]]] = {
    "vllm": ("max_num_batched_tokens", "max_num_seqs", {}),
    "sarathi": ("chunk_size", "max_num_seqs", {}),
    "sglang": ("chunked_prefill_size", "max_running_requests", {}),
    "tgi": ("max_batch_prefill_tokens", "max_batch_size", {}),
    "trtllm": ("max_num_tokens", "max_batch_size", {"enable_chunked_prefill": True}),
}
DEPLOYMENT = Deployment("Llama-3-8B", "H100-SXM", 1)
WORKLOAD = WorkloadSpec("chat", num_requests=2000, rate=10.0, seed=0)


def sweep_specs(n: int) -> list[RunSpec]:
    configs = [
        (name, {tokens_flag: t, batch_flag: b, **fixed})
        for name, (tokens_flag, batch_flag, fixed) in GRID.items()
        for t in TOKENS
        for b in BATCH
    ]
    random.Random(0).shuffle(configs)
    return [RunSpec(DEPLOYMENT, WORKLOAD, PolicySpec.make(name, flags)) for name, flags in configs[:n]]


def one_sweep(name: str, workers: int, make: Callable[[], Backend], specs: list[RunSpec]) -> dict[str, Any]:
    loadavg = os.getloadavg()
    with CpuMeter() as meter:
        t0 = time.perf_counter()
        backend = make()
        start_s = time.perf_counter() - t0  # Ray's start; a pool's workers start with their first runs
        with Sweep(backend, quiet=True) as sweep:
            outcomes = sweep.run(specs)
    cpu = meter.result()
    wall = cpu["wall_s"]
    run_cpu = [o.cpu_s for o in outcomes]
    run_wall = [o.wall_s for o in outcomes]
    errors = sum(o.error is not None for o in outcomes)
    figures = load_figures(cpu, run_cpu)
    print(
        f"{name:>8}: {wall:7.1f} s wall ({start_s:.1f} s to start), {len(outcomes)} runs, "
        f"{sum(run_cpu) / len(outcomes):.3f} s CPU and {sum(run_wall) / len(outcomes):.3f} s loop wall per run, "
        f"the sweep held {figures['sweep_cores']:.2f} cores, other processes {figures['others_cores']:.2f}, load {loadavg[0]:.2f}->{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    return {
        "backend": name,
        "workers": workers,
        "num_runs": len(outcomes),
        "num_errors": errors,
        "wall_s": wall,
        "start_s": start_s,
        "cpu_s_per_run": sum(run_cpu) / len(outcomes),
        "loop_wall_s_per_run": sum(run_wall) / len(outcomes),
        "sum_run_cpu_s": sum(run_cpu),
        "runs_per_s": len(outcomes) / wall,
        "machine": cpu,
        **figures,
        "loadavg_before": loadavg,
        "loadavg_after": os.getloadavg(),
        "_outcomes": outcomes,
    }


def load_figures(cpu: dict[str, Any], run_cpu: list[float]) -> dict[str, float | None]:
    """The CPU the sweep held and what other processes took meanwhile. Ray's worker processes are
    children of its raylet, not of this process, so ``own_cpu_s`` misses them: the sweep's CPU is
    the larger of this process tree's and the runs' own."""
    runs_cpu_s = sum(run_cpu)
    sweep_cpu = max(cpu["own_cpu_s"], runs_cpu_s)
    others = cpu["machine_busy_cpu_s"] - sweep_cpu
    return {
        "sweep_cpu_s": sweep_cpu,
        "others_cpu_s": others,
        "sweep_cores": sweep_cpu / cpu["wall_s"],
        "others_cores": others / cpu["wall_s"],
        # What running them cost beyond the runs (imports, pickling, the driver's loop); not seen
        # for Ray, whose workers are outside this process tree.
        "overhead_cpu_ms_per_run": (cpu["own_cpu_s"] - runs_cpu_s) / len(run_cpu) * 1e3
        if cpu["own_cpu_s"] >= runs_cpu_s
        else None,
    }


def same(a: list[RunOutcome], b: list[RunOutcome]) -> bool:
    return [(o.key, json.dumps(o.summary, sort_keys=True), o.error) for o in a] == [
        (o.key, json.dumps(o.summary, sort_keys=True), o.error) for o in b
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", type=int, default=1000, help="configurations of the local sweeps (<= 1000)"
    )
    parser.add_argument(
        "--ray-configs",
        type=int,
        default=None,
        help="the first N of them on Ray (default: --configs; 0: no Ray)",
    )
    parser.add_argument("--workers", type=int, default=usable_cpus(), help="N (default: the usable CPUs)")
    parser.add_argument("--out", default=None, help="results JSON (default: benchmarks/out/tune_speed.json)")
    args = parser.parse_args()
    if not 1 <= args.configs <= len(TOKENS) * len(BATCH) * len(GRID):
        raise SystemExit(f"tune_speed: error: --configs must be in 1..1000, got {args.configs}")
    ray_configs = args.configs if args.ray_configs is None else min(args.ray_configs, args.configs)
    n = args.workers
    started = datetime.now(timezone.utc)
    print(cpu_line())
    print(
        f"sweep: {args.configs} configurations (Ray: the first {ray_configs}) of {WORKLOAD.num_requests} "
        f"chat requests at {WORKLOAD.rate:g}/s, Llama-3-8B / H100-SXM; N = {n} workers; "
        f"{usable_cpus()} usable CPUs, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    specs = sweep_specs(args.configs)
    local = [
        one_sweep("serial", 1, SerialBackend, specs),
        one_sweep(f"pool {n}", n, lambda: ProcessBackend(n), specs),
    ]
    ray_runs: list[dict[str, Any]] = []
    if ray_configs:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray is not installed: the Ray sweeps are left out (pip install 'tailserve[ray]')")
        else:
            for w in (1, n):
                ray_runs.append(
                    one_sweep(f"ray {w}", w, lambda w=w: RayBackend("local", w), specs[:ray_configs])
                )
    serial = local[0]["_outcomes"]
    identical = all(same(r["_outcomes"], serial[: r["num_runs"]]) for r in [*local, *ray_runs])

    def scaling(one: dict[str, Any], many: dict[str, Any]) -> dict[str, float]:
        speedup = one["wall_s"] / many["wall_s"]
        return {"speedup": speedup, "scaling": speedup / many["workers"]}

    out: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "command": "python -m benchmarks.tune_speed "
        + f"--configs {args.configs} --ray-configs {ray_configs} --workers {n}",
        "job": (
            f"{args.configs} configurations (shuffled grid of vllm, sarathi, sglang, tgi, trtllm: 20 token "
            f"budgets x 10 batch limits each) of chat, {WORKLOAD.num_requests} requests at "
            f"{WORKLOAD.rate:g}/s, seed 0, Llama-3-8B / H100-SXM TP 1"
        ),
        "cpu": cpu_line(),
        "usable_cpus": usable_cpus(),
        "python": platform.python_version(),
        "runs": [{k: v for k, v in r.items() if k != "_outcomes"} for r in [*local, *ray_runs]],
        "local_scaling": scaling(local[0], local[1]),
        "identical_results": identical,
    }
    if len(ray_runs) == 2:
        out["ray_scaling"] = scaling(ray_runs[0], ray_runs[1])
    print(
        f"local: {n} workers {out['local_scaling']['speedup']:.2f}x over serial, scaling "
        f"{out['local_scaling']['scaling']:.2f} of linear"
        + (
            f"; Ray: {n} processes {out['ray_scaling']['speedup']:.2f}x over 1, scaling "
            f"{out['ray_scaling']['scaling']:.2f}"
            if "ray_scaling" in out
            else ""
        )
        + f"; identical results: {identical}"
    )
    save_results(out, args.out, "tune_speed.json")


if __name__ == "__main__":
    main()
