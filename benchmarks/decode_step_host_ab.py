"""The tiny model's bf16 decode step at batch 64, this tree's executor against another
revision's, the Python around the forward pass and the C++ kernels both, alternating step by
step in one process, with the step's split as ``decode_step_ab`` prints it (linear layers,
decode attention, the rest).

``decode_step_ab`` swaps only the C++ kernels (``cpu_kernel_source.py``); this also swaps the
host code of ``executor.py`` (rows, input tensors, the LM head's logits), ``attention.py``
(``build_metadata``) and ``tokenizer.py`` (``Tokenizer.decode``, ``IncrementalDetokenizer.push``):
the old revision's files are loaded from git (``--old``) as modules of their own and the old
side's steps run their ``TorchExecutor.execute``, ``build_metadata`` and ``push`` on the same
engine, model and weights. Everything else is this tree's on both sides (the model's forward,
the sampler: an old executor hands it float32 logits, which it reads as before; the scheduler,
the stop checks). Steps run old, new, new, old, ... so that a busy moment or a growing context
costs both alike; medians of each side's steps, the first two dropped. Any CPU level (the kernels
are built with this level's flags).

    python -m benchmarks.decode_step_host_ab --old HEAD~1
    TAILSERVE_CPU_ISA=avx2 python -m benchmarks.decode_step_host_ab --old HEAD~1
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from benchmarks._common import cpu_line, load_averages, save_results
from benchmarks._decode_batch import alternate, fill, kernel_switch, time_linear_and_attention
from benchmarks._decode_batch import medians as side_medians
from benchmarks.decode_step_ab import build, old_source
from tailserve.executors.pytorch import cpu_isa, cpu_kernels, tokenizer
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.llm import LLM

PACKAGE = "src/tailserve/executors/pytorch"


def old_module(rev: str, name: str, into: Path) -> types.ModuleType:
    """``PACKAGE/name.py`` at ``rev`` as a module of its own (its imports resolve in this tree)."""
    repo = Path(__file__).resolve().parent.parent
    text = subprocess.run(
        ["git", "show", f"{rev}:{PACKAGE}/{name}.py"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout
    path = into / f"old_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"ab_old_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="git revision whose executor host code is 'old'")
    parser.add_argument("--steps", type=int, default=64, help="decode steps, both sides together")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (1: immune to a busy other core)"
    )
    parser.add_argument("--out", help="JSON results (default benchmarks/out/decode_step_host_ab.json)")
    args = parser.parse_args(argv)
    level = cpu_isa.detect().level
    here = Path(cpu_kernels.__file__).with_name("cpu_kernel_source.py")
    with tempfile.TemporaryDirectory() as tmp:
        old_attention = old_module(args.old, "attention", Path(tmp))
        old_executor = old_module(args.old, "executor", Path(tmp))
        old_tokenizer = old_module(args.old, "tokenizer", Path(tmp))
        mods = {"old": build(old_source(args.old, Path(tmp)), "old"), "new": build(here, "new")}
    old_executor.build_metadata = old_attention.build_metadata
    llm = LLM(default_model_dir("tiny"), dtype="bfloat16", threads=args.threads)
    print(llm.engine.description, flush=True)
    engine = llm.engine
    executor = engine.stop_checker.inner
    sides = {
        "old": types.MethodType(old_executor.TorchExecutor.execute, executor),
        "new": types.MethodType(type(executor).execute, executor),
    }
    # The old execute calls self._execute: the old one on the old side.
    internals = {
        "old": types.MethodType(old_executor.TorchExecutor._execute, executor),
        "new": types.MethodType(type(executor)._execute, executor),
    }

    # The detokenizer's push (two decodes a token per request) and Tokenizer.decode, per side.
    detok_class = tokenizer.IncrementalDetokenizer
    pushes = {"old": old_tokenizer.IncrementalDetokenizer.push, "new": detok_class.push}
    decodes = {"old": old_tokenizer.Tokenizer.decode, "new": tokenizer.Tokenizer.decode}

    spent = time_linear_and_attention()
    # The C++ kernels per side too, as decode_step_ab swaps them (this level's flags for both).
    _, use_kernels = kernel_switch(level, mods)

    def use(tag: str) -> None:
        executor.execute, executor._execute = sides[tag], internals[tag]
        detok_class.push, tokenizer.Tokenizer.decode = pushes[tag], decodes[tag]
        use_kernels(tag)

    fill(engine, args.steps)
    times = alternate(engine, args.steps, use, spent)
    load = load_averages()
    print(cpu_line(), flush=True)
    print(f"level {level}, {args.threads} threads; load average {' '.join(load)}; old = {args.old}")
    medians = side_medians(times)
    ratio = medians["new"]["step"] / medians["old"]["step"]
    print(
        f"new / old step: {ratio:.3f}; rest old - new: {medians['old']['rest'] - medians['new']['rest']:.2f} ms"
    )
    results = {"old": args.old, "level": level, "threads": args.threads, "cpu": cpu_line()}
    results["load_average"] = load
    save_results(
        {**results, "median_ms": medians, "new_over_old_step": ratio}, args.out, "decode_step_host_ab.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
