"""vLLM's side of ``engine_cpu.py``: run with vLLM's venv python, never imported by tailserve.

    ${TAILSERVE_PEERS:-.peers}/vllm/bin/python -m benchmarks._vllm_driver SPEC.json OUT.json

SPEC (written by ``engine_cpu.py``): the model directory and dtype, the W prompts and their
``max_tokens``, the fresh single-request TTFT prompts, warm-up prompts, the Poisson run's
requests, how many W outputs to return for the token-for-token check, and the quiet-gate
settings. OUT: startup time, each timed section's figures with its CPU accounting, versions and
thread settings. One ``vllm.LLM`` serves everything (startup costs ~30 s): W through offline
``LLM.generate`` after ``reset_prefix_cache()``, the Poisson run through its ``LLMEngine``'s
``add_request`` / ``step`` loop, submitted at arrival times exactly as tailserve's is.
``VLLM_CPU_KVCACHE_SPACE`` (default 2 GiB) and ``VLLM_CPU_OMP_THREADS_BIND`` come from the
environment the parent sets.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._arrivals import TimedRequest, drive, median, summarize
from benchmarks._common import CpuMeter, gated


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # the NUMA-node memory check fails otherwise
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    quiet = spec["quiet"]
    result: dict[str, Any] = {
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "env": {
            k: os.environ.get(k)
            for k in (
                "VLLM_CPU_KVCACHE_SPACE",
                "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "OMP_NUM_THREADS",
            )
        },
    }
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"])
    result["startup_s"] = time.perf_counter() - t0
    result["torch_num_threads_frontend"] = torch.get_num_threads()

    def prompts(ids: list[list[int]]) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": p} for p in ids]

    llm.generate(
        prompts(spec["warmup_prompts"]),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )

    # W: one offline batch, nothing of it in the prefix cache.
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=spec["w_max_tokens"], temperature=0, ignore_eos=True)
    gate = gated(quiet["threshold_cores"], quiet["timeout_s"])
    with CpuMeter() as meter:
        outs = llm.generate(prompts(spec["w_prompts"]), params, use_tqdm=False)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result["w"] = {
        "quiet": gate,
        "cpu": meter.result(),
        "wall_s": meter.wall_s,
        "output_tokens": num_out,
        "output_tok_s": num_out / meter.wall_s,
        "outputs": [list(o.outputs[0].token_ids) for o in outs[: spec["check_k"]]],
    }

    # Single-request TTFT: max_tokens=1 on fresh prompts, one at a time.
    gate = gated(quiet["threshold_cores"], quiet["timeout_s"])
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    with CpuMeter() as meter:
        for p in spec["ttft_prompts"]:
            t = time.perf_counter()
            llm.generate(prompts([p]), one, use_tqdm=False)
            times.append(time.perf_counter() - t)
    result["ttft"] = {"quiet": gate, "cpu": meter.result(), "runs_s": times, "median_s": median(times)}

    # Poisson: LLMEngine's step loop, requests submitted at their arrival times.
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    requests = [TimedRequest.from_json(r) for r in spec["poisson"]]
    ours: dict[str, str] = {}

    def add(r: TimedRequest) -> None:
        p = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        internal = engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, p)
        ours[r.request_id] = r.request_id
        ours[internal] = r.request_id  # vLLM may suffix the id it uses inside

    def step() -> list[tuple[str, int, bool]]:
        return [(ours[o.request_id], len(o.outputs[0].token_ids), o.finished) for o in engine.step()]

    gate = gated(quiet["threshold_cores"], quiet["timeout_s"])
    with CpuMeter() as meter:
        timings = drive(requests, add, step, engine.has_unfinished_requests)
    result["poisson"] = {
        "quiet": gate,
        "cpu": meter.result(),
        **summarize(timings),
        "timings": [t.to_json() for t in timings],
    }
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks._vllm_driver SPEC.json OUT.json")
    main(sys.argv[1], sys.argv[2])
