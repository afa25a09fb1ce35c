"""Bounded memory: a million simulated requests with streamed metrics, peak RSS and wall time.

Requests are generated as the engine reaches them (``IteratorSource`` over a numpy generator
drawn in blocks: Poisson arrivals, log-normal lengths), finished ones go into the engine's
``FinishedStore`` (``EngineOptions(stream_finished=True)``), so nothing grows with the request
count except the arrays the summary needs: ~56 bytes per request, 36 per iteration, 8 per output
token (the pooled ITL keeps every gap, for exact percentiles and mean). Llama-3-8B on one
A100-80GB. Each run is its own process (peak RSS from ``os.wait4``). The loop is the one
``tailserve simulate`` runs: ``SimDriver`` with its exact fast paths between steps (``--stepped``:
every iteration stepped, the engine's own loop, as this benchmark ran before r47).

    python -m benchmarks.sim_memory [--requests 1000000] [--policy vllm] [--stepped] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import cpu_line, default_out, module_cmd, module_env, simd_flags

BLOCK = 65_536  # requests drawn per numpy call


def requests(n: int, rate: float, seed: int):
    """``n`` requests, made lazily: exponential gaps at ``rate``/s, log-normal prompt (median
    1,024, sigma 0.8, 1..8,192) and output (median 128, sigma 0.8, 1..2,048) lengths."""
    from tailserve.core.request import Request

    rng = np.random.default_rng(seed)
    t = 0.0
    made = 0
    while made < n:
        k = min(BLOCK, n - made)
        arrivals = t + np.cumsum(rng.exponential(1.0 / rate, k))
        t = float(arrivals[-1])
        prompt = np.clip(np.round(rng.lognormal(np.log(1024), 0.8, k)), 1, 8192).astype(np.int64)
        output = np.clip(np.round(rng.lognormal(np.log(128), 0.8, k)), 1, 2048).astype(np.int64)
        for i, (a, p, o) in enumerate(zip(arrivals.tolist(), prompt.tolist(), output.tolist())):
            yield Request(f"req-{made + i}", p, o, a)
        made += k


def worker(n: int, policy: str, rate: float, seed: int, stepped: bool) -> None:
    from tailserve.assemble import BuildOptions, build_engine
    from tailserve.core.engine import EngineOptions
    from tailserve.core.stream_source import IteratorSource
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.executors.simulated.driver import SimDriver
    from tailserve.metrics.summary import summarize

    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    engine = build_engine(
        built,
        policy,
        "sim",
        BuildOptions(min_max_model_len=8192 + 2048, engine=EngineOptions(stream_finished=True)),
        source=IteratorSource(requests(n, rate, seed)),
    ).engine
    t0 = time.perf_counter()
    engine.run() if stepped else SimDriver(engine).run()
    loop = time.perf_counter() - t0
    rss_loop = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    store = engine.finished_store
    held = {  # MiB each structure holds at the end of the loop
        "itl_gaps": (sum(c.nbytes for c in store._gap_chunks) + 8 * store._fill) / 2**20,
        "per_request_arrays": sum(
            len(a) * a.itemsize
            for a in (store.arrival_time, store.first_token_time, store.last_token_time,
                      store.first_scheduled_time, store.num_output_tokens, store.prompt_len,
                      store.num_cached_tokens)
        ) / 2**20,
        "iteration_log": sum(len(getattr(engine.log, f)) * getattr(engine.log, f).itemsize for f in engine.log.FIELDS) / 2**20,
    }  # fmt: skip
    summary = summarize(store)
    total = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "requests": summary["num_requests"],
                "finished": summary["num_finished"],
                "iterations": len(engine.log),
                "loop_s": loop,
                "loop_plus_summary_s": total,
                "output_tokens": int(
                    np.frombuffer(engine.finished_store.num_output_tokens, dtype=np.int64).sum()
                ),
                "peak_rss_after_loop_mib": rss_loop,
                "held_mib": {k: round(v, 1) for k, v in held.items()},
                "ttft_p99_s": summary["metrics"]["ttft_s"]["p99"],
                "itl_p99_s": summary["metrics"]["itl_s"]["p99"],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--policy", default="vllm", help="policy spec (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=5.0, help="arrivals per second (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stepped", action="store_true", help="step every iteration (no fast paths): the engine's own loop"
    )
    parser.add_argument("--out", default=None, help="results JSON (default: benchmarks/out/sim_memory.json)")
    args = parser.parse_args()
    if args.requests < 1 or args.rate <= 0:
        raise SystemExit("sim_memory: error: --requests must be >= 1 and --rate > 0")
    if args.worker:
        worker(args.requests, args.policy, args.rate, args.seed, args.stepped)
        return
    cmd = module_cmd(sys.executable, "sim_memory", "--worker", "--requests", args.requests)
    cmd += ["--policy", args.policy, "--rate", str(args.rate), "--seed", str(args.seed)]
    cmd += ["--stepped"] if args.stepped else []
    load_start = os.getloadavg()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=module_env({**os.environ, "OMP_NUM_THREADS": "1"})
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"sim_memory: error: the worker failed: {err.read()[-2000:]}")
        result = json.loads(out.read().strip().splitlines()[-1])
    result.update(
        policy=args.policy,
        loop="stepped" if args.stepped else "SimDriver",
        rate_req_per_s=args.rate,
        process_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_mib=usage.ru_maxrss // 1024,
        loadavg_start=load_start,
        loadavg_end=os.getloadavg(),
    )
    print(
        f"{result['requests']:,} requests ({result['finished']:,} finished, {result['iterations']:,} iterations, "
        f"{result['output_tokens']:,} output tokens), {args.policy}, {result['loop']}: loop {result['loop_s']:.1f} s, "
        f"process {wall:.1f} s, peak RSS {result['peak_rss_mib']:,} MiB; load "
        f"{' '.join(f'{x:.2f}' for x in load_start)}"
    )
    path = Path(args.out) if args.out else default_out("sim_memory.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    print(cpu_line())
    path.write_text(json.dumps({**result, "cpu_flags": simd_flags()}, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
