"""TGI's chunking mode with and without its chunk run (``core/chunk_run.py``), side by side.

The same requests as ``sim_speed.py`` (Azure conversation lengths, Poisson 5 req/s, Llama-3-8B on
A100), runs interleaved (the order flips each repeat): tailserve's loop CPU for each, whether the
summaries are identical, and a census of the iterations still stepped one by one (admission
forwards, forwards with a prompt in progress) beside the iterations the chunk run covered.

    python benchmarks/tgi_chunk_run.py [--requests 20000] [--repeats 5] [--specs "tgi;tgi:max_batch_prefill_tokens=512"]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
from pathlib import Path

import sim_speed

from tailserve.core import chunk_run
from tailserve.core.engine import Engine
from tailserve.policies.registry import parse_policy_list
from tailserve.policies.tgi import TgiPolicy
from tailserve.sim.deployment import Deployment, build_cost_model
from tailserve.sim.run import RunResult, run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

WITH_RUN = TgiPolicy.chunk_run_budget


def simulate(spec: str, trace: Path, chunk_run_on: bool) -> RunResult:
    # Without the run, TGI reports no chunk budget: the engine then never tries it (as before).
    TgiPolicy.chunk_run_budget = WITH_RUN if chunk_run_on else (lambda self: None)  # type: ignore[method-assign]
    try:
        built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
        workload = WorkloadBuilder(WorkloadSpec("trace", trace_path=str(trace)))
        return run_policy(built, parse_policy_list(spec)[0], workload)
    finally:
        TgiPolicy.chunk_run_budget = WITH_RUN  # type: ignore[method-assign]


def census(spec: str, trace: Path) -> tuple[int, dict[str, int], int]:
    """Iterations in all, the stepped ones by kind, and those the chunk run covered."""
    kinds: collections.Counter[str] = collections.Counter()
    covered = 0
    step, advance = Engine.step, chunk_run.advance_chunk_run

    def counted_step(engine: Engine) -> bool:
        ok = step(engine)
        out = engine.scheduler.last_output
        if ok and out is not None and not out.is_empty:
            prompts = sum(1 for s in out.scheduled if s.num_new_tokens > 1)
            kinds[f"{'admission' if out.num_admitted else 'forward'} with {prompts} prompt(s)"] += 1
        return ok

    def counted_advance(engine: Engine) -> int:
        nonlocal covered
        k = advance(engine)
        covered += k
        return k

    Engine.step, chunk_run.advance_chunk_run = counted_step, counted_advance  # type: ignore[method-assign]
    try:
        run = simulate(spec, trace, True)
    finally:
        Engine.step, chunk_run.advance_chunk_run = step, advance  # type: ignore[method-assign]
    return run.summary()["num_iterations"], dict(kinds), covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--specs", default="tgi;tgi:max_batch_prefill_tokens=512", help="';'-separated")
    parser.add_argument("--trace", default=str(sim_speed.AZURE))
    args = parser.parse_args()
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be >= 1")
    trace_path = Path(args.trace)
    if not trace_path.is_file():
        parser.error(f"no trace at {trace_path} (--trace PATH: the Azure conversation CSV)")
    folder = Path(tempfile.mkdtemp())
    trace, _ = sim_speed.write_workload(args.requests, sim_speed.azure_lengths(trace_path), folder)
    print(f"load before: {os.getloadavg()}")
    for spec in args.specs.split(";"):
        cpu: dict[bool, list[float]] = {True: [], False: []}
        summaries: dict[bool, str] = {}
        for i in range(args.repeats):
            for on in (True, False) if i % 2 == 0 else (False, True):
                run = simulate(spec, trace, on)
                cpu[on].append(run.loop_cpu_s)
                summaries[on] = json.dumps(run.summary(), sort_keys=True, default=str)
        total, kinds, covered = census(spec, trace)
        print(
            f"{spec}: loop CPU min {min(cpu[True]):.2f} s with the chunk run, {min(cpu[False]):.2f} s "
            f"without (all: {[round(x, 2) for x in cpu[True]]} / {[round(x, 2) for x in cpu[False]]}); "
            f"summaries identical: {summaries[True] == summaries[False]}"
        )
        print(f"  {total} iterations, {covered} in chunk runs, stepped: {kinds}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
