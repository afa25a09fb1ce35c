"""NVIDIA's ADP-balance post as a DeepSeek-R1 end-to-end check (docs/fidelity.md, "The R1 decode
step, term by term"): TensorRT-LLM docs/source/blogs/tech_blog/blog10_ADP_Balance_Strategy.md,
8xGB200, DeepSeek-V3 NVFP4, attention DP 8 x EP 8 (WideEP), max_batch_size 512, max_num_tokens
4,678, kv_cache_free_gpu_mem_fraction 0.85, 16,000 requests (inputs mean 803.1, outputs mean
3,653.8: MLPerf's DeepSeek-R1 shape), concurrency 5,120 (more than the 8 x 512 slots: every slot
busy until the tail), balancing timeout 50 / batching wait 10: 34,140 output tok/s (25,664 without
balancing).

Simulated as ``fidelity_mlperf``'s GB200 R1 point's trace (its dataset, outputs scaled to the
post's mean) with every request at t = 0 (a queue that never empties before the tail, as the
post's client), on the catalog's ``DeepSeek-R1-FP4-v2`` (DeepSeek-V3's shape, NVIDIA's NVFP4
exclusions). The post names no CUDA-graph sizes: the MLPerf configs' 128/256/384/512 with padding.

    python -m benchmarks.r1_adp_balance_post [--no-balance] [--requests 16000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.fidelity_mlperf import POINTS, trace
from tailserve.cli.app import main as tailserve_main

PUBLISHED = {True: 34140.0, False: 25664.0}  # output tok/s, with / without balancing


def run(balance: bool, n: int) -> dict:
    p = next(q for q in POINTS if q.name == "nvidia-gb200-r1")
    p = dataclasses.replace(p, completed_tokens_per_s=3653.8 * p.completed_qps)  # out_mean 3,653.8
    reqs = [dict(r, arrival_time=0.0) for r in trace(p, 1.0, n, 0)]
    flags = ["--policy", "trtllm", "--quantization", "nvfp4", "--kv-cache-dtype", "fp8", "--enable-expert-parallel",
             "--max-batch-size", "512", "--max-num-tokens", "4678", "--capacity-scheduler-policy", "MAX_UTILIZATION",
             "--no-enable-chunked-prefill", "--no-enable-block-reuse", "--block-size", "32", "--max-model-len", "23140",
             "--gpu-memory-utilization", "0.85", "--cuda-graph-padding-enabled", "--cuda-graph-batch-sizes",
             "128,256,384,512"]  # fmt: skip
    if balance:
        flags += ["--attention-dp-enable-balance", "--attention-dp-batching-wait-iters", "10",
                  "--attention-dp-timeout-iters", "50"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "trace.jsonl", Path(tmp) / "run.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
        argv = ["simulate", "--model", "DeepSeek-R1-FP4-v2", "--hardware", "GB200", "--tp", "1",
                "--data-parallel-size", "8", "--trace", str(path), *flags, "--json", str(out)]  # fmt: skip
        if tailserve_main(argv) != 0:
            raise RuntimeError(f"tailserve {' '.join(argv)} failed")
        raw = json.loads(out.read_text())
    outputs = sum(r["max_tokens"] for r in reqs)
    tok_s = outputs / raw["duration_s"]
    return {
        "balance": balance,
        "requests": n,
        "input_mean": float(np.mean([r["prompt_len"] for r in reqs])),
        "output_mean": outputs / n,
        "finished": raw["num_finished"],
        "duration_s": raw["duration_s"],
        "output_tok_s": tok_s,
        "published_tok_s": PUBLISHED[balance],
        "error": tok_s / PUBLISHED[balance] - 1.0,
        "preemptions": raw["num_preemptions"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-balance", action="store_true", help="the post's baseline (no ADP balancing)")
    parser.add_argument("--requests", type=int, default=16000)
    args = parser.parse_args()
    r = run(not args.no_balance, args.requests)
    print(
        f"finished {r['finished']} in {r['duration_s']:.1f} s: {r['output_tok_s']:,.0f} output tok/s "
        f"(published {r['published_tok_s']:,.0f}: {r['error']:+.0%}), preemptions {r['preemptions']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
