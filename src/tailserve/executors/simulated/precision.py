"""Number formats of weights, activations and the KV cache: bytes per element and the tensor-core
rate a GEMM in that format runs at.

A format's ``bytes`` include its scales: FP8 with one scale per tensor or output channel
(negligible), block-scaled FP8 one FP32 scale per 128 x 128 block,
MXFP4 one 8-bit scale per 32 values (OCP microscaling; gpt-oss's experts), NVFP4 one FP8 scale per
16 values, INT4 weight-only (AWQ/GPTQ) one 16-bit scale per group of 128.

``compute`` is the tensor-core format the GEMM runs in where the GPU has it: FP8 weights with FP8
activations (W8A8) run at the FP8 rate, NVFP4/MXFP4 at the FP4 rate on Blackwell. Where the GPU
lacks that format the engines fall back to weight-only kernels (vLLM's Marlin: FP8 on A100, MXFP4
on Hopper): the weights keep their small bytes and the math runs at the bf16 rate
(``Hardware.peak_for``). INT4 weight-only always computes in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    bytes: float  # per element, scales included
    compute: str  # the tensor-core format a GEMM with these weights runs at, when available


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 4.0, "fp32"),
        Precision("bf16", 2.0, "bf16"),
        Precision("fp16", 2.0, "bf16"),  # the same tensor-core rate as bf16 on every GPU here
        Precision("fp8", 1.0, "fp8"),
        # 128 x 128 weight blocks and 1 x 128 activation groups, each with an FP32 scale
        # (DeepSeek-V3/R1, Qwen3-FP8 checkpoints; DeepGEMM / CUTLASS block-scaled kernels)
        Precision("fp8_block", 1.0 + 4 / (128 * 128), "fp8"),
        Precision("int8", 1.0, "int8"),
        Precision("int4", 0.5 + 2 / 128, "bf16"),
        Precision("mxfp4", 0.5 + 1 / 32, "fp4"),
        Precision("nvfp4", 0.5 + 1 / 16, "fp4"),
    )
}

_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "fp4": "nvfp4",
    "w4a16": "int4",
    "awq": "int4",
    "gptq": "int4",
}


def get_precision(name: str) -> Precision:
    """A format by name (``bf16``, ``fp8``, ``nvfp4``, ..., or a torch/HF spelling such as
    ``bfloat16``); ValueError naming the known ones otherwise."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PRECISIONS:
        known = ", ".join(PRECISIONS)
        raise ValueError(f"unknown number format {name!r}; known: {known}")
    return PRECISIONS[key]
