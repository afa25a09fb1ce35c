"""The engine's decode step at W's full batch, part by part: W (64 prompts x 256 ids, 64 greedy
bf16 tokens) through the live engine, with wall-time wrappers around the engine step, the
executor, the attention metadata, the forward pass, the LM head and the sampler, counted only in
decode-only iterations of all 64 requests. What the step spends outside the model (scheduling,
input preparation, sampling) against the forward pass itself.

    python benchmarks/engine_decode_step.py [--models small] [--threads N] [--out FILE]

Wall time, so run it on a quiet machine; the VM this project runs on drifts 10-25% between runs
minutes apart, so compare the parts of one run, not runs.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
importlib.import_module("tailserve.executors.pytorch")  # its OpenMP wait policy before torch

from _arrivals import random_prompts  # noqa: E402
from _host import simd_flags  # noqa: E402
from _paths import save_results  # noqa: E402

from tailserve.executors.pytorch import executor as executor_mod  # noqa: E402
from tailserve.executors.pytorch.init_model import default_model_dir  # noqa: E402
from tailserve.llm import LLM, SamplingParams  # noqa: E402

BATCH, PROMPT, NEW, W_SEED = 64, 256, 64, 1234  # engine_cpu's W
PARTS = ("engine step", "executor", "attention metadata", "forward", "lm head", "sampler")


def measure(preset: str, threads: int | None) -> dict[str, Any]:
    llm = LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", threads=threads)
    engine, executor = llm.engine, llm.engine.stop_checker.inner
    seconds: dict[str, float] = collections.defaultdict(float)
    decode = [False]  # the iteration in flight is a full-batch decode

    def timed(fn, part: str):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if decode[0]:
                seconds[part] += time.perf_counter() - t
            return out

        return call

    steps = [0]
    execute = timed(executor.execute, "executor")

    def execute_marked(out):
        decode[0] = len(out.scheduled) == BATCH and all(s.num_new_tokens == 1 for s in out.scheduled)
        steps[0] += decode[0]
        return execute(out)

    executor.execute = execute_marked
    executor.model.forward = timed(executor.model.forward, "forward")
    executor.model.compute_logits = timed(executor.model.compute_logits, "lm head")
    executor.sampler.sample = timed(executor.sampler.sample, "sampler")
    build = executor_mod.build_metadata
    executor_mod.build_metadata = timed(build, "attention metadata")
    engine.step = timed(engine.step, "engine step")
    try:
        prompts = random_prompts(BATCH, PROMPT, executor.model.config.vocab_size, W_SEED)
        warm = SamplingParams(max_tokens=4, temperature=0.0)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm)
        seconds.clear()
        steps[0] = 0
        params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        executor_mod.build_metadata = build
    n = max(steps[0], 1)
    per_step = {part: seconds[part] / n * 1e3 for part in PARTS}
    model = per_step["forward"] + per_step["lm head"]
    return {
        "decode_steps": steps[0],
        "ms_per_step": {k: round(v, 3) for k, v in per_step.items()},
        "outside_model_ms": round(per_step["engine step"] - model, 3),
        "threads": executor.threads.label if executor.threads is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small")
    p.add_argument("--threads", type=int, default=None, help="fixed intra-op threads (default: adaptive)")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/out/engine_decode_step.json)")
    args = p.parse_args(argv)
    flags = simd_flags()
    print(f"CPU: {' '.join(flags) or 'no AVX-512/AMX flags'}")
    results: dict[str, Any] = {
        "cpu_flags": flags,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "models": {},
    }
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        r = results["models"][preset] = measure(preset, args.threads)
        print(f"{preset}: {r['decode_steps']} decode steps at batch {BATCH} ({r['threads']}), ms per step:")
        for part, ms in r["ms_per_step"].items():
            print(f"  {part:20s} {ms:8.2f}")
        print(f"  {'outside the model':20s} {r['outside_model_ms']:8.2f}  (engine step - forward - lm head)")
    save_results(results, args.out, "engine_decode_step.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
