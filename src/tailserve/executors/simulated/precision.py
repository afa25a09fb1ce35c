"""Number formats of weights, activations and the KV cache: bytes per element and the tensor-core
rate a GEMM in that format runs at.

A format's ``bytes`` include its scales: FP8 with one scale per tensor or output channel
(negligible; ``fp8`` with activation scales computed at run time, ``fp8_static`` with the
checkpoint's calibrated ones), block-scaled FP8 one FP32 scale per 128 x 128 block,
MXFP4 one 8-bit scale per 32 values (OCP microscaling; gpt-oss's experts), NVFP4 one FP8 scale per
16 values, INT4 weight-only (AWQ/GPTQ) one 16-bit scale per group of 128.

``compute`` is the tensor-core format the GEMM runs in where the GPU has it: FP8 weights with FP8
activations (W8A8) run at the FP8 rate, NVFP4/MXFP4 at the FP4 rate on Blackwell. Where the GPU
lacks that format the engines fall back to weight-only kernels (vLLM's Marlin: FP8 on A100, MXFP4
on Hopper): the weights keep their small bytes and the math runs at the bf16 rate
(``Hardware.peak_for``). INT4 weight-only always computes in bf16.

``gemm`` names the format whose dense-GEMM figures (``GemmCurve`` factors and curves, the MLA
block's terms) price it: a format that differs from another only in its fused-MoE kernel shares
that format's. Static per-tensor FP8 runs the dense GEMM kernel dynamic per-tensor FP8 runs: vLLM
0.32 picks the FP8 linear kernel by the scales' group shape alone, per tensor either way —
FlashInfer's ``bmm_fp8`` on sm100, CUTLASS ``scaled_mm`` on sm90
(vllm/model_executor/kernels/linear/__init__.py:443-452, scaled_mm/flashinfer.py:50-65@v0.32.0);
its experts run another kernel (``hardware.MoeKernel.format_curves``: FlashInfer's CUTLASS on
Hopper, FlashInfer's TRT-LLM on Blackwell, which take static activation scales only).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    bytes: float  # per element, scales included
    compute: str  # the tensor-core format a GEMM with these weights runs at, when available
    gemm: str = ""  # the format whose dense-GEMM figures price it ("": its own name)

    @property
    def gemm_format(self) -> str:
        return self.gemm or self.name


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 4.0, "fp32"),
        Precision("bf16", 2.0, "bf16"),
        Precision("fp16", 2.0, "bf16"),  # the same tensor-core rate as bf16 on every GPU here
        # FP8 per tensor, activation scales computed at run time (vLLM's --quantization
        # fp8_per_tensor, online: weights quantized at load; the `fp8` method with
        # activation_scheme dynamic)
        Precision("fp8", 1.0, "fp8"),
        # FP8 per tensor with the checkpoint's static activation scales (ModelOpt FP8,
        # compressed-tensors static, the `fp8` method with activation_scheme static)
        Precision("fp8_static", 1.0, "fp8", gemm="fp8"),
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
    "fp8_per_tensor": "fp8",  # vLLM 0.32's online method (model_loader/weight_utils.py:351-358)
    # vLLM's and SGLang's --quantization names of a ModelOpt checkpoint's formats
    # (modelopt.py:438-439@v0.32.0: ModelOptFp8Config.get_name; SGLang's modelopt_fp8)
    "modelopt": "fp8_static",
    "modelopt_fp8": "fp8_static",
    "modelopt_fp4": "nvfp4",
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


def gemm_format(name: str) -> str:
    """The format whose dense-GEMM figures price ``name``'s GEMMs (``Precision.gemm``)."""
    return get_precision(name).gemm_format
