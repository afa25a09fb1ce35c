"""Simulation cost of vLLM's async scheduling against the synchronous pass, side by side.

The same Azure conversation requests as ``sim_speed.py`` (its lengths and Poisson arrivals at
5 req/s), Llama-3-8B on one A100-80GB, ``vllm`` with a 4,096-token budget, run in this process
with ``async_scheduling`` off and on, interleaved (the order flips each repeat) so a loaded
machine slows both alike. Reports each run's loop CPU seconds (``RunResult.loop_cpu_s``: the
simulation alone, no imports nor trace load) and iterations, and the async/sync ratio of the
medians. ``--no-fast-forward`` steps every iteration (the exact fast paths off), for the cost
they save.

    python -m benchmarks.async_speed [--sizes 2000,20000] [--repeats 3] [--no-fast-forward]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks._common import check_trace
from benchmarks.sim_speed import AZURE, azure_lengths, write_workload

POLICY = "vllm:max_num_batched_tokens=4096,max_num_seqs=256"


def run_once(trace: Path, async_scheduling: bool, fast_forward: bool) -> tuple[float, int]:
    """(loop CPU seconds, iterations) of one simulation of ``trace``."""
    from tailserve.core.engine import EngineOptions
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.policies.registry import parse_policy_list
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    spec = parse_policy_list(f"{POLICY},async_scheduling={str(async_scheduling).lower()}")[0]
    workload = WorkloadBuilder(WorkloadSpec("trace", trace_path=str(trace)))
    run = run_policy(built, spec, workload, options=EngineOptions(fast_forward=fast_forward))
    return run.loop_cpu_s, len(run.log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,20000", help="request counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", default=str(AZURE), help="Azure conversation trace (the lengths)")
    parser.add_argument("--no-fast-forward", action="store_true", help="step every iteration")
    args = parser.parse_args()
    if (problem := check_trace(args.trace)) is not None:
        raise SystemExit(f"async_speed: error: {problem}")
    lengths = azure_lengths(Path(args.trace))
    fast = not args.no_fast_forward
    with tempfile.TemporaryDirectory(prefix="async_speed_") as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            trace, _ = write_workload(n, lengths, Path(tmp))
            cpu: dict[bool, list[float]] = {False: [], True: []}
            iterations: dict[bool, int] = {}
            for rep in range(args.repeats):
                for mode in (False, True) if rep % 2 == 0 else (True, False):
                    seconds, iterations[mode] = run_once(trace, mode, fast)
                    cpu[mode].append(seconds)
            sync, asyn = (statistics.median(cpu[m]) for m in (False, True))
            print(
                f"{n:>7,} requests: sync {sync:.2f} s ({min(cpu[False]):.2f}-{max(cpu[False]):.2f}, "
                f"{iterations[False]:,} iterations), async {asyn:.2f} s ({min(cpu[True]):.2f}-"
                f"{max(cpu[True]):.2f}, {iterations[True]:,} iterations): async/sync {asyn / sync:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
