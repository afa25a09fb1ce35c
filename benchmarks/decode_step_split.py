"""Where the tiny model's bf16 decode step at batch 64 goes, phase by phase: the scheduler, the
executor's host work (rows, metadata, input tensors), the forward pass split into linear layers,
decode attention, the K/V store, RoPE, norms and SiLU-mul, the embedding and the rest of the
model's Python, the LM head, sampling, the stop checks and detokenization, and output
processing (``LLMEngine._collect``). ``--prefill``: W's prefill step instead (8 fresh 256-token prompts,
2,048 tokens in one step, as ``engine_cpu``'s W batches them), its attention the prefill kernel's.

The same setup as ``decode_step_ab`` (64 requests of 256-token prompts prefilled, then
``--steps`` decode steps at batch 64); each phase's time is measured by wrapping its call with
``time.perf_counter`` (the wrappers' own cost, ~0.1-0.2 us a call, lands in the phase that calls
them). Medians over the steps, the first two dropped (``--prefill``: each step's 8 requests are
new, and finish in it; the first two steps are the cold ones, whose activations' pages are
touched for the first time, which ``engine_cpu``'s roofline reads as W's prefill batch). Runs at
this process's CPU level:

    python -m benchmarks.decode_step_split                            # native
    python -m benchmarks.decode_step_split --prefill                  # W's prefill step
    TAILSERVE_CPU_ISA=avx2 python -m benchmarks.decode_step_split     # forced AVX2
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks._common import cpu_line, load_averages, save_results
from benchmarks._decode_batch import BATCH, fill, prompts
from tailserve.executors.pytorch import cpu_backend, cpu_isa, cpu_kernels, executor, model
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.llm import LLM, SamplingParams

PREFILL_BATCH = 8


def wrap(spent: dict[str, float], owner: Any, name: str, phase: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its time to ``spent[phase]``; time spent in a
    wrapped call inside another wrapped call counts only to the inner phase."""
    inner = getattr(owner, name)
    stack: list[float] = spent.setdefault("_stack", [])  # type: ignore[assignment]

    def timed(*a: Any, **k: Any) -> Any:
        stack.append(0.0)
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            took = time.perf_counter() - t
            nested = stack.pop()
            spent[phase] += took - nested
            if stack:
                stack[-1] += took

    setattr(owner, name, timed)


def prefill_prompts(steps: int) -> list[list[list[int]]]:
    """W's prefill batch for each step: 8 prompts of 256 seeded token ids (2,048 tokens, the
    vLLM default budget ``engine_cpu`` runs W under)."""
    ids = prompts(steps * PREFILL_BATCH)
    return [ids[i : i + PREFILL_BATCH] for i in range(0, len(ids), PREFILL_BATCH)]


def add_prefill_batch(engine: Any, step: int, prompts: list[list[int]]) -> None:
    """Requests that finish in the step that prefills them (one token each, greedy)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{step}-{i}", ids, params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=40, help="steps timed (decode, or prefill with --prefill)"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (1: immune to a busy other core)"
    )
    parser.add_argument(
        "--prefill", action="store_true", help="W's prefill step (8 x 256 fresh tokens), not the decode step"
    )
    parser.add_argument("--out", help="JSON results (default benchmarks/out/decode_step_split.json)")
    args = parser.parse_args(argv)
    llm = LLM(default_model_dir("tiny"), dtype="bfloat16", threads=args.threads)
    print(llm.engine.description, flush=True)
    engine = llm.engine
    spent: dict[str, float] = defaultdict(float)
    m = getattr(engine.stop_checker.inner, "model", None)
    if not isinstance(m, model.LlamaModel):
        print("the engine's executor is not the PyTorch one")
        return 1
    wrap(spent, engine.scheduler, "schedule", "schedule")
    wrap(spent, engine.scheduler, "add_block_ids", "schedule")
    wrap(spent, engine.scheduler, "update", "scheduler update")
    wrap(spent, engine.engine, "finish_step", "scheduler update")
    wrap(spent, engine.stop_checker, "execute", "stop checks + detok")
    wrap(spent, engine.stop_checker.inner, "execute", "executor host")
    wrap(spent, executor, "build_metadata", "metadata")
    wrap(spent, m, "forward", "model other")
    wrap(spent, cpu_backend.PackedLinear, "__call__", "linear")
    wrap(
        spent,
        cpu_kernels,
        "paged_prefill_attention" if args.prefill else "paged_decode_attention",
        "attention",
    )
    wrap(spent, m.backend, "store_kv", "kv store")
    if m.fused is not None:
        wrap(spent, m.fused, "rope_split", "rope")
    holder = type("TimedNormOps", (), {})()  # NormOps is frozen: a plain object in its place
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul"):
        setattr(holder, name, getattr(m.norm_ops, name))
        wrap(spent, holder, name, "norms + silu")
    m.norm_ops = holder
    # The LM head's call outside its matmul (the executor calls ``logits`` since r45, which
    # has no float32 copy; before, ``compute_logits``).
    wrap(spent, m, "logits" if hasattr(m, "logits") else "compute_logits", "lm head")
    wrap(spent, engine.stop_checker.inner.sampler, "sample", "sampling")
    wrap(spent, engine, "_collect", "output processing")

    batches = prefill_prompts(args.steps + 2) if args.prefill else []
    if not args.prefill:
        fill(engine, args.steps)
    per_phase: dict[str, list[float]] = defaultdict(list)
    first: list[float] = []
    step_faults: list[int] = []  # minor page faults in each timed step (the process's)
    step_kernel: list[float] = []  # the process's CPU seconds in the kernel (faults are there)
    for s in range(args.steps + 2):
        if args.prefill:
            add_prefill_batch(engine, s, batches[s])
        spent.clear()
        spent["_stack"] = []  # type: ignore[assignment]
        before = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        outs = engine.step()
        step = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults = after.ru_minflt - before.ru_minflt
        kernel_s = after.ru_stime - before.ru_stime
        assert len(outs) == (len(batches[s]) if args.prefill else BATCH), len(outs)
        if s < 2:
            first.append(step)
            continue
        per_phase["step"].append(step)
        step_faults.append(faults)
        step_kernel.append(kernel_s)
        phases = {k: v for k, v in spent.items() if k != "_stack"}
        per_phase["engine other"].append(step - sum(phases.values()))
        for k, v in phases.items():
            per_phase[k].append(v)
    load = load_averages()
    print(cpu_line())
    level = cpu_isa.detect().level
    print(f"level {level}, {args.threads} threads, torch {torch.__version__}, load average {' '.join(load)}")
    print(f"malloc: {getattr(m.backend, 'malloc', '?')}")
    medians = {k: statistics.median(v) * 1e3 for k, v in per_phase.items()}
    print(
        f"page faults a step: median {statistics.median(step_faults):,.0f}, max {max(step_faults):,}; "
        f"kernel CPU a step: median {statistics.median(step_kernel) * 1e3:.1f} ms, "
        f"max {max(step_kernel) * 1e3:.1f}"
    )
    rest = medians["step"] - medians.get("linear", 0.0) - medians.get("attention", 0.0)
    print(
        f"{'prefill' if args.prefill else 'decode'} step {medians['step']:.3f} ms (median of "
        f"{len(per_phase['step'])}, min {min(per_phase['step']) * 1e3:.3f}; the two dropped: "
        f"{', '.join(f'{x * 1e3:.1f}' for x in first)}); rest {rest:.3f} ms:"
    )
    for k, v in sorted(medians.items(), key=lambda kv: -kv[1]):
        if k != "step":
            print(f"  {k:22s} {v:7.3f} ms")
    save_results(
        {
            "level": level,
            "step": "prefill" if args.prefill else "decode",
            "threads": args.threads,
            "malloc": getattr(m.backend, "malloc", None),
            "dropped_ms": [x * 1e3 for x in first],
            "step_ms": [x * 1e3 for x in per_phase["step"]],
            "page_faults": step_faults,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            "kernel_cpu_s": step_kernel,
            "cpu": cpu_line(),
            "load_average": load,
            "median_ms": medians,
        },
        args.out,
        "decode_step_split.json",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
