"""Instructions one simulation takes, counted by valgrind's callgrind: a figure the machine's load
does not move, for comparing two versions of the loop on a shared machine.

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.out \\
        $(python -c 'import sys; print(sys.executable)') -m benchmarks.sim_instructions sglang 500

(the interpreter's real path: a pyenv shim is a shell script valgrind would follow no further).
The workload is ``sim_speed``'s (the Azure conversation lengths, Poisson arrivals at 5 req/s,
seed 0) and the policy one of its cases (their ``vllm`` and ``sglang`` pin async scheduling and the
overlap scheduler off, as ``sim_speed``'s do; ``vllm-default``, ``sglang-default`` and
``trtllm-default`` are the engines' defaults, ``slo`` tailserve's policy). Instrumentation is
switched on (``callgrind_control``) just before ``run_policy`` and off after it, so imports are
not counted; engine build and trace parsing are — or, with ``--loop-only``, around the
simulation loop (``SimDriver.run``) alone, the figure to divide by iterations. callgrind prints
the count as ``I refs``; with ``PYTHONHASHSEED=0`` two runs of one version agree to about 0.02%.

``--measure`` runs that under valgrind itself (loop only), once per size, and prints (and with
``--json`` writes) instructions per iteration and per request: whether the loop's cost per
iteration stays flat as the run grows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.sim_speed import AZURE, CASES, RATE, azure_lengths, write_workload

# issue 35 item 1's chunked-prefill cases at small budgets, beside sim_speed's own.
EXTRA = {
    "sarathi512": "sarathi:chunk_size=512,max_num_seqs=256",
    "vllm512": "vllm:max_num_batched_tokens=512,max_num_seqs=256,async_scheduling=false",
    "vllm2048": "vllm:max_num_batched_tokens=2048,max_num_seqs=256,async_scheduling=false",
    "sglang2048": "sglang:chunked_prefill_size=2048,max_running_requests=256,disable_overlap_schedule=true",
    # Each engine's defaults (async scheduling / overlap schedulers on) and tailserve's slo.
    "vllm-default": "vllm",
    "sglang-default": "sglang",
    "trtllm-default": "trtllm",
    "slo": "slo",
}


def spec_of(name: str) -> str:
    by_name = {c.name: c.spec for c in CASES} | EXTRA
    if name not in by_name:
        raise SystemExit(f"sim_instructions: error: unknown case {name!r}; known: {', '.join(by_name)}")
    return by_name[name]


def simulate(name: str, requests: int, loop_only: bool, rate: float) -> None:
    from tailserve.executors.simulated import driver
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.policies.registry import parse_policy_list
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    toggle = ["callgrind_control", "-i"]

    def instrument(on: bool) -> None:
        subprocess.run([*toggle, "on" if on else "off", str(os.getpid())], capture_output=True, check=False)

    if loop_only:
        loop = driver.SimDriver.run

        def counted(self: driver.SimDriver) -> None:
            instrument(True)
            loop(self)
            instrument(False)

        driver.SimDriver.run = counted  # type: ignore[method-assign]
    spec = spec_of(name)
    with tempfile.TemporaryDirectory() as tmp:
        ours, _ = write_workload(requests, azure_lengths(AZURE), Path(tmp), rate=rate)
        built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
        workload = WorkloadBuilder(WorkloadSpec("trace", trace_path=str(ours)))
        if not loop_only:
            instrument(True)
        run = run_policy(built, parse_policy_list(spec)[0], workload)
        if not loop_only:
            instrument(False)
    # Requests in the batch, summed over iterations: what an O(running) loop's cost follows.
    print(f"{name} {requests} requests, {len(run.log)} iterations, {sum(run.log.batch_size)} scheduled")


def measure(name: str, requests: int, rate: float) -> dict:
    """One loop-only run under callgrind: its instructions, iterations and process CPU seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
            sys.executable, "-m", "benchmarks.sim_instructions", name, str(requests), "--loop-only",
            "--rate", str(rate),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        t0 = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise SystemExit(f"sim_instructions: error: {name} {requests}: {done.stderr.strip()[-400:]}")
        found = re.search(r"(\d+) requests, (\d+) iterations, (\d+) scheduled", done.stdout)
        totals = re.search(r"^totals: (\d+)", out.read_text(), re.MULTILINE)
        if found is None or totals is None:
            raise SystemExit(f"sim_instructions: error: {name} {requests}: no count in callgrind's output")
    instructions, iterations, scheduled = int(totals.group(1)), int(found.group(2)), int(found.group(3))
    return {
        "case": name,
        "spec": spec_of(name),
        "requests": requests,
        "rate_req_per_s": rate,
        "iterations": iterations,
        "loop_instructions": instructions,
        "per_iteration": round(instructions / iterations),
        "per_request": round(instructions / requests),
        "mean_batch": round(scheduled / iterations, 2),
        "per_scheduled_request": round(instructions / scheduled),
        "valgrind_wall_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policy", help=f"a case: {', '.join([c.name for c in CASES] + list(EXTRA))}")
    parser.add_argument("requests", help="requests; with --measure a comma-separated list of sizes")
    parser.add_argument("--loop-only", action="store_true", help="count the simulation loop alone")
    parser.add_argument("--measure", action="store_true", help="run under callgrind, loop only, per size")
    parser.add_argument(
        "--rate", type=float, default=RATE, help=f"Poisson arrivals per second (default {RATE:g})"
    )
    parser.add_argument("--json", help="with --measure: append the results to this JSON list")
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.requests.split(",")]
    except ValueError:
        raise SystemExit(
            f"sim_instructions: error: requests must be integers, got {args.requests!r}"
        ) from None
    if any(n <= 0 for n in sizes):
        raise SystemExit(f"sim_instructions: error: requests must be positive, got {args.requests!r}")
    spec_of(args.policy)
    if not args.rate > 0:
        raise SystemExit(f"sim_instructions: error: --rate must be positive, got {args.rate:g}")
    if not args.measure:
        if len(sizes) != 1:
            raise SystemExit("sim_instructions: error: one size without --measure")
        simulate(args.policy, sizes[0], args.loop_only, args.rate)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("sim_instructions: error: --measure needs valgrind (apt-get install valgrind)")
    rows = []
    for n in sizes:
        row = measure(args.policy, n, args.rate)
        rows.append(row)
        print(
            f"{row['case']} {n:,} requests: {row['iterations']:,} iterations, {row['loop_instructions'] / 1e6:,.1f} M "
            f"instructions in the loop, {row['per_iteration']:,}/iteration, {row['per_request']:,}/request, "
            f"mean batch {row['mean_batch']}, {row['per_scheduled_request']:,}/scheduled request",
            flush=True,
        )
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
