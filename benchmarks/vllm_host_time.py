"""vLLM's per-step scheduler host time against the number of scheduled requests (docs/fidelity.md,
"The dense points' step, decomposed (r39)"): the CPU time of its own ``Scheduler.schedule()`` and
``update_from_output()`` in a synchronous engine's step, driven standalone as
``src/tailserve/validate/drivers/vllm_v1.py`` drives it (a fake model runner: one token per
request that caught up with its prompt). Run with the peer venv's python (no tailserve imports):

    ${TAILSERVE_PEERS:-.peers}/vllm/bin/python -m benchmarks.vllm_host_time [--out FILE]

Thread CPU time (``time.thread_time``), median of 25 steps after 5 warm-up steps, so another job
on the machine slows it only through shared caches, not by preemption. Two step kinds at each
size: decode-only (every running request decodes) and mixed (the Red Hat MLPerf point's flags:
1,024-token budget per 128 running, long-prefill threshold 256, four fresh 870-token prompts
arriving per 128 running each step). Not the whole host part of a vLLM step: the model runner's
input preparation, the sampler's bookkeeping and the output serialisation come on top.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

DRIVERS = Path(__file__).resolve().parent.parent / "src" / "tailserve" / "validate" / "drivers"
PROMPT = 870  # MLPerf's CNN-DailyMail prompts average 870.7 tokens
SIZES = (128, 512)


def _load(name: str):
    """A driver module by its file (the drivers are scripts, not a package, and the benchmarks
    never edit the import path): registered under its own name, so ``vllm_v1``'s ``from _jsonl
    import ...`` finds its sibling."""
    spec = importlib.util.spec_from_file_location(name, DRIVERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _driver():
    _load("_jsonl")
    vllm_v1 = _load("vllm_v1")  # the differential tests' driver: vLLM's Scheduler built standalone
    return vllm_v1.Driver()


def _scheduler(d, budget: int):
    cfg = dict(max_model_len=65536, max_num_seqs=min(2048, budget), max_num_batched_tokens=budget,
               enable_chunked_prefill=True, long_prefill_token_threshold=256, scheduling_policy="fcfs",
               block_size=16, enable_prefix_caching=True, num_blocks=400_000)  # fmt: skip
    return d._scheduler(cfg), d.get_request_block_hasher(16, d.sha256)


def _add(d, scheduler, hasher, i: int) -> None:
    prompt = [(i * 7919 + j) % 30000 + 5 for j in range(PROMPT)]  # distinct prompts: no prefix hits
    params = d.SamplingParams(max_tokens=100_000, ignore_eos=True)
    scheduler.add_request(d.Request(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    pooling_params=None, arrival_time=0.0, block_hasher=hasher))  # fmt: skip


def _step(d, scheduler) -> tuple[float, float, int]:
    """One synchronous step: (schedule seconds, update_from_output seconds, requests scheduled)."""
    t0 = time.thread_time()
    out = scheduler.schedule()
    t1 = time.thread_time()
    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        r = scheduler.requests[rid]
        ids.append(rid)
        sampled.append([] if r.num_computed_tokens < r.num_tokens else [7])
    runner_output = d.runner_output(ids, sampled)
    t2 = time.thread_time()
    scheduler.update_from_output(out, runner_output)
    return t1 - t0, time.thread_time() - t2, len(out.num_scheduled_tokens)


def measure(d, running: int, mixed: bool, steps: int = 25, warm: int = 5) -> dict:
    budget = 1024 * (running // 128) + running if mixed else 8192
    scheduler, hasher = _scheduler(d, budget)
    for i in range(running):
        _add(d, scheduler, hasher, i)
    next_id = running
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        _step(d, scheduler)
    rows = []
    for k in range(warm + steps):
        if mixed:
            for _ in range(4 * (running // 128)):
                _add(d, scheduler, hasher, next_id)
                next_id += 1
        row = _step(d, scheduler)
        if k >= warm:
            rows.append(row)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    sched, update = median([r[0] for r in rows]), median([r[1] for r in rows])
    n = median([r[2] for r in rows])
    return {"running": running, "kind": "mixed" if mixed else "decode", "scheduled": n,
            "schedule_ms": round(sched * 1e3, 3), "update_ms": round(update * 1e3, 3),
            "us_per_request": round((sched + update) / n * 1e6, 1)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results file (default: print only)")
    args = parser.parse_args()
    d = _driver()
    import vllm

    rows = []
    for running in SIZES:
        for mixed in (False, True):
            row = measure(d, running, mixed)
            rows.append(row)
            print(f"{row['kind']:6s} running {running:4d}: {row['scheduled']:4d} scheduled, schedule "
                  f"{row['schedule_ms']:6.2f} ms + update_from_output {row['update_ms']:6.2f} ms = "
                  f"{row['us_per_request']:5.1f} us per scheduled request", flush=True)  # fmt: skip
    if args.out:
        result = {"vllm": vllm.__version__, "cpu_count": os.cpu_count(), "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
