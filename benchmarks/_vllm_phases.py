"""vLLM's side of ``engine_phases.py``: W's steps one by one, timed inside vLLM's engine core.

    ${TAILSERVE_PEERS:-.peers}/vllm/bin/python benchmarks/_vllm_phases.py SPEC.json OUT.json

Runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by the parent), so the engine core lives in
this process and its methods can be wrapped: ``EngineCore.step`` (the whole iteration),
``Scheduler.schedule`` (what it scheduled: prefill and decode tokens, batch size) and the model
executor's ``execute_model`` + ``sample_tokens`` (the forward pass and sampling). SPEC: the
model directory, dtype, W prompts, max_tokens, warm-up prompts, repeats. OUT: one record per
step of each repeat, and vLLM's version and thread settings.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"])
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    steps: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    schedule = core.scheduler.schedule

    def timed_schedule(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        # A request is decoding when it is scheduled one token and has computed its prompt.
        prefill = decode = 0
        for req_id, n in out.num_scheduled_tokens.items():
            req = core.scheduler.requests[req_id]
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                decode += 1
            else:
                prefill += n
        current.update(
            num_prefill_tokens=prefill, num_decode_tokens=decode, batch_size=len(out.num_scheduled_tokens)
        )
        return out

    executor = core.model_executor
    execute, sample = executor.execute_model, executor.sample_tokens

    def timed_execute(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = execute(*a, **k)
        if hasattr(out, "result"):  # non_block=True hands back a finished future in-process
            out = _Done(out.result())
        current["forward_s"] = current.get("forward_s", 0.0) + time.perf_counter() - t
        return out

    def timed_sample(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = sample(*a, **k)
        current["forward_s"] = current.get("forward_s", 0.0) + time.perf_counter() - t
        return out

    core.scheduler.schedule = timed_schedule
    executor.execute_model = timed_execute
    executor.sample_tokens = timed_sample
    step = core.step

    def timed_step() -> Any:
        current.clear()
        t, c = time.perf_counter(), time.thread_time()
        out = step()
        if current:
            # thread_time: this thread's CPU, the whole step's at one OpenMP thread (bind 0).
            cpu = time.thread_time() - c
            steps.append({"start": t, "duration": time.perf_counter() - t, "cpu_s": cpu, **current})
        return out

    core.step = timed_step
    core.step_fn = timed_step

    def prompts(ids: list[list[int]]) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": p} for p in ids]

    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(prompts(spec["warmup_prompts"]), warm, use_tqdm=False)
    params = SamplingParams(max_tokens=spec["w_max_tokens"], temperature=0, ignore_eos=True)
    runs = []
    for _ in range(spec["repeats"]):
        llm.reset_prefix_cache()
        steps.clear()
        t = time.perf_counter()
        outs = llm.generate(prompts(spec["w_prompts"]), params, use_tqdm=False)
        wall = time.perf_counter() - t
        runs.append(
            {
                "wall_s": wall,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "steps": list(steps),
            }
        )
    result = {
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "env": {
            k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")
        },
        "max_num_batched_tokens": core.scheduler.max_num_scheduled_tokens,
        "runs": runs,
    }
    Path(out_path).write_text(json.dumps(result, indent=1))


class _Done:
    """A future already resolved (the timing above waited for it)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value

    def done(self) -> bool:
        return True


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: _vllm_phases.py SPEC.json OUT.json")
    main(sys.argv[1], sys.argv[2])
