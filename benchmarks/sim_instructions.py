"""Instructions one simulation takes, counted by valgrind's callgrind: a figure the machine's load
does not move, for comparing two versions of the loop on a shared machine.

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.out \\
        $(python -c 'import sys; print(sys.executable)') -m benchmarks.sim_instructions sglang 500

(the interpreter's real path: a pyenv shim is a shell script valgrind would follow no further).
The workload is ``sim_speed``'s (the Azure conversation lengths, Poisson arrivals at 5 req/s,
seed 0) and the policy one of its cases. Instrumentation is switched on (``callgrind_control``)
just before ``run_policy`` and off after it, so imports are not counted; engine build and trace
parsing are. callgrind prints the count as ``I refs``; with ``PYTHONHASHSEED=0`` two runs of one
version agree to about 0.02%.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks.sim_speed import AZURE, CASES, azure_lengths, write_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policy", choices=[c.name for c in CASES])
    parser.add_argument("requests", type=int)
    args = parser.parse_args()
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.policies.registry import parse_policy_list
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    spec = next(c.spec for c in CASES if c.name == args.policy)
    with tempfile.TemporaryDirectory() as tmp:
        ours, _ = write_workload(args.requests, azure_lengths(AZURE), Path(tmp))
        built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
        workload = WorkloadBuilder(WorkloadSpec("trace", trace_path=str(ours)))
        toggle = ["callgrind_control", "-i"]
        subprocess.run([*toggle, "on", str(os.getpid())], capture_output=True, check=False)
        run = run_policy(built, parse_policy_list(spec)[0], workload)
        subprocess.run([*toggle, "off", str(os.getpid())], capture_output=True, check=False)
    print(f"{args.policy} {args.requests} requests, {run.summary()['num_iterations']} iterations")


if __name__ == "__main__":
    main()
