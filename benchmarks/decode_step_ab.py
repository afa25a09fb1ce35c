"""The tiny model's bf16 decode step at batch 64, this tree's C++ kernels against another
revision's, alternating step by step in one process, with the step's split: linear layers
(``PackedLinear`` calls), decode attention, and everything else (norms, RoPE, the K/V store,
sampling, scheduling and host time).

64 requests of 256-token prompts are prefilled (8 per step, as W does), then ``--steps`` decode
steps at batch 64 run (contexts 257 to ~330: W's mean is 288), the kernels switched between
steps in the order old, new, new, old, ... so that a busy moment or a growing context costs
both alike. Both builds come from the same flags (this CPU level's ``-march``); only the C++
source differs (``cpu_kernel_source.py`` at ``--old``). Medians of each side's steps, the first
two steps dropped.

    TAILSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python -m benchmarks.decode_step_ab --old HEAD~1

(``ATEN_CPU_CAPABILITY=avx2`` makes PyTorch's own kernels dispatch as on an AVX2 CPU, as the
CLI does for a forced level; without it the bit-exact SiLU kernel declines on an AVX-512 machine
and PyTorch's SiLU runs.)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import cpu_line, load_averages, save_results
from benchmarks._decode_batch import alternate, fill, kernel_switch, time_linear_and_attention
from benchmarks._decode_batch import medians as side_medians
from tailserve.cache import cache_root
from tailserve.executors.pytorch import cpu_isa, cpu_kernels
from tailserve.executors.pytorch.cpu_norm_source import NORM_FUNCTIONS, NORM_SOURCE
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.llm import LLM

SOURCE_PATH = "src/tailserve/executors/pytorch/cpu_kernel_source.py"


def build(source_file: Path, tag: str) -> Any:
    """The kernels of one ``cpu_kernel_source.py`` (with this tree's norm kernels), built with
    the flags ``cpu_kernels`` uses at this level, into tailserve's cache."""
    spec = importlib.util.spec_from_file_location(f"ab_source_{tag}", source_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from torch.utils.cpp_extension import load_inline

    isa = cpu_isa.detect()
    source = module.SOURCE + NORM_SOURCE
    flags = cpu_kernels._cflags(isa)
    key = "\0".join((source, *flags, torch.__version__, isa.level))
    name = f"tailserve_ab_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    directory = cache_root() / "kernels" / name
    directory.mkdir(parents=True, exist_ok=True)
    return load_inline(
        name=name, cpp_sources=source, functions=module.FUNCTIONS + NORM_FUNCTIONS,
        extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(directory),
    )  # fmt: skip


def old_source(rev: str, into: Path) -> Path:
    repo = Path(__file__).resolve().parent.parent
    text = subprocess.run(
        ["git", "show", f"{rev}:{SOURCE_PATH}"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout
    path = into / "old_source.py"
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="git revision whose kernels are 'old'")
    parser.add_argument("--steps", type=int, default=64, help="decode steps, both sides together")
    parser.add_argument("--out", help="JSON results (default benchmarks/out/decode_step_ab.json)")
    args = parser.parse_args(argv)
    level = cpu_isa.detect().level
    here = Path(cpu_kernels.__file__).with_name("cpu_kernel_source.py")
    with tempfile.TemporaryDirectory() as tmp:
        mods = {"old": build(old_source(args.old, Path(tmp)), "old"), "new": build(here, "new")}
    llm = LLM(default_model_dir("tiny"), dtype="bfloat16", threads=2)
    print(llm.engine.description, flush=True)
    engine = llm.engine

    spent = time_linear_and_attention()
    packed, use = kernel_switch(level, mods)
    if not packed or any(p.kind != "avx2" for p in packed):
        print("the model's linear layers are not on the AVX2 kernel here (TAILSERVE_CPU_ISA=avx2?)")
        return 1

    # The sampler's argmax stays on this tree's build: before r45 the kernel took float32 logits
    # only, and the executor now hands it the LM head's bf16 ones.
    argmax_module = cpu_kernels._argmax_module
    cpu_kernels._argmax_module = lambda logits: None if argmax_module(logits) is None else mods["new"]

    fill(engine, args.steps)
    times = alternate(engine, args.steps, use, spent)
    load = load_averages()
    print(cpu_line(), flush=True)
    print(f"load average {' '.join(load)}; old = {args.old}")
    medians = side_medians(times)
    ratio = medians["new"]["step"] / medians["old"]["step"]
    print(f"new / old step: {ratio:.3f}")
    results = {"old": args.old, "level": level, "cpu": cpu_line(), "load_average": load}
    save_results(
        {**results, "median_ms": medians, "new_over_old_step": ratio}, args.out, "decode_step_ab.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
