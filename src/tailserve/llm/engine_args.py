"""The engine arguments of ``LLM``, ``LLMEngine.from_args``, ``tailserve serve`` and ``tailserve
run`` (vLLM's names where vLLM has the concept): each default once, read by the CLI too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXECUTORS = ("torch", "sim")
DTYPE_HELP = (
    "torch executor's weights and KV cache (default: %(default)s: bfloat16 on a GPU or a CPU with "
    "AVX-512, float32 on other CPUs, which have no bf16 matmul)"
)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    executor: str = "torch"  # "torch": the real executor; "sim": the cost model paced in real time
    policy: str = "vllm"
    policy_flags: dict[str, Any] = field(default_factory=dict)  # the policy's flags, engine names
    dtype: str = "auto"  # torch; auto: bfloat16 where the device has a bf16 matmul, else float32
    device: str = "cpu"  # torch
    seed: int = 0  # sampling
    hardware: str = "H100-SXM"  # sim: the GPU whose speed is simulated
    sim_model: str = "Llama-3-8B"  # sim: the model whose speed is simulated
    tensor_parallel_size: int = 1  # sim
    # sim: as simulate --calibration; torch: auto/none, or a `calibrate --executor torch` file
    # the slo policy predicts iteration times with
    calibration: str = "auto"
    max_model_len: int | None = None  # tokens; None: the model's context
    kv_cache_memory_gib: float | None = None  # torch: None is 2 GiB on CPU, vLLM's rule on CUDA
    threads: int | None = None  # torch on CPU: intra-op threads (None: the free cores)
    served_model_name: str | None = None
    check_integrity: bool = False  # check KV and request invariants after every iteration

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be 'torch' or 'sim', got {self.executor!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        # 0 is not "the model's context": the builders read a falsy length as unset, so a 0
        # would be served as the default instead of refused.
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 token, got {self.max_model_len}")
