"""Where the tiny model's bf16 decode step at batch 64 goes, phase by phase: the scheduler, the
executor's host work (rows, metadata, input tensors), the forward pass split into linear layers,
decode attention, the K/V store, RoPE, norms and SiLU-mul, the embedding and the rest of the
model's Python, the LM head, sampling, the stop checks and detokenization, and output
processing (``LLMEngine._collect``).

The same setup as ``decode_step_ab`` (64 requests of 256-token prompts prefilled, then
``--steps`` decode steps at batch 64); each phase's time is measured by wrapping its call with
``time.perf_counter`` (the wrappers' own cost, ~0.1-0.2 us a call, lands in the phase that calls
them). Medians over the steps, the first two dropped. Runs at this process's CPU level:

    python -m benchmarks.decode_step_split                            # native
    TAILSERVE_CPU_ISA=avx2 python -m benchmarks.decode_step_split     # forced AVX2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks._common import cpu_line, load_averages, save_results
from benchmarks._decode_batch import BATCH, fill
from tailserve.executors.pytorch import cpu_backend, cpu_isa, cpu_kernels, executor, model
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.llm import LLM


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (1: immune to a busy other core)"
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
    wrap(spent, cpu_kernels, "paged_decode_attention", "attention")
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

    fill(engine, args.steps)
    per_phase: dict[str, list[float]] = defaultdict(list)
    for s in range(args.steps + 2):
        spent.clear()
        spent["_stack"] = []  # type: ignore[assignment]
        t = time.perf_counter()
        outs = engine.step()
        step = time.perf_counter() - t
        assert len(outs) == BATCH, len(outs)
        if s < 2:
            continue
        per_phase["step"].append(step)
        phases = {k: v for k, v in spent.items() if k != "_stack"}
        per_phase["engine other"].append(step - sum(phases.values()))
        for k, v in phases.items():
            per_phase[k].append(v)
    load = load_averages()
    print(cpu_line())
    level = cpu_isa.detect().level
    print(f"level {level}, {args.threads} threads, torch {torch.__version__}, load average {' '.join(load)}")
    medians = {k: statistics.median(v) * 1e3 for k, v in per_phase.items()}
    rest = medians["step"] - medians.get("linear", 0.0) - medians.get("attention", 0.0)
    print(
        f"step {medians['step']:.3f} ms (median of {len(per_phase['step'])}, min "
        f"{min(per_phase['step']) * 1e3:.3f}); rest {rest:.3f} ms:"
    )
    for k, v in sorted(medians.items(), key=lambda kv: -kv[1]):
        if k != "step":
            print(f"  {k:22s} {v:7.3f} ms")
    save_results(
        {
            "level": level,
            "threads": args.threads,
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
