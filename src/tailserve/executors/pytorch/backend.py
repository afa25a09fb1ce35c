"""The executor's device seam: the operations a forward pass needs from a device (linear layers,
norms, RoPE, storing K/V, paged attention), behind one interface.

``LlamaModel`` and ``paged_attention`` call a ``Backend`` and know no device. ``TorchBackend``
is PyTorch's ops alone and runs on any device: it is CUDA's path (``cuda_backend.CudaBackend``
adds only what differs there) and the CPU path with every kernel switched off. ``CpuBackend``
(``cpu_backend.py``) swaps in tailserve's fused kernels and prepacked weights wherever the CPU's
level (``cpu_isa``) runs them. ``backend_for`` picks one for a device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tailserve.executors.pytorch.cpu_norm import NormOps

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_norm_ops(eps: float) -> NormOps:
    """The PyTorch ops (transformers' numerics): float32 models' path and the fused kernels' reference."""

    def add_rms_norm(residual: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        x = residual + delta
        return x, rms_norm(x, weight, eps)

    return NormOps(lambda x, weight: rms_norm(x, weight, eps), add_rms_norm, silu_and_mul)


class TorchBackend:
    """PyTorch's ops on any device. Numerics are transformers': float32 greedy tokens equal
    ``LlamaForCausalLM``'s on the same weights."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # Whether a row of ``linear``'s output is the same whatever the other rows (prepacked
    # weights): then the last layer's tail may run on the sampled rows alone (model._rows_needed).
    def rows_independent(self, weight: Any) -> bool:
        return False

    def prepare_linear(self, weight: Tensor, dtype: torch.dtype) -> Any:
        """The form ``linear`` multiplies by, made once at load (a prepacked copy, or the tensor)."""
        return weight

    def norm_ops(self, eps: float, dtype: torch.dtype, hidden: int, intermediate: int) -> NormOps:
        return torch_norm_ops(eps)

    def rope_split(self, dtype: torch.dtype) -> Any | None:
        """A module whose ``rope_split(qkv, cos, sin, positions, h, kvh, d)`` applies RoPE while
        splitting the fused projection, or None (the model slices and rotates with PyTorch)."""
        return None

    def store_kv(self, k_slots: Tensor, v_slots: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        k_slots.index_copy_(0, slot_mapping, k)
        v_slots.index_copy_(0, slot_mapping, v)

    def decode_attention(self, q: Tensor, k_slots: Tensor, v_slots: Tensor, meta: Any) -> Tensor:
        """One query token per request over its context, gathered from the paged cache into
        [batch, max_context] (padding reads the zeroed spare block and is masked out) and one
        batched SDPA call (a fused flash/memory-efficient kernel on CUDA)."""
        keys, values = gather_decode_context(k_slots, v_slots, meta)
        res = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.decode_mask,
            enable_gqa=True,
        )
        return res.squeeze(2)

    def prefill_attention(self, q: Tensor, k_slots: Tensor, v_slots: Tensor, meta: Any) -> Tensor | None:
        """Every prefill chunk's attention in one call, [prefill tokens, heads, dim], or None:
        the caller runs one SDPA call per chunk (``attention.paged_attention``)."""
        return None

    def describe(
        self, dtype: torch.dtype, fused_norms: tuple[str, ...] = (), head_dim: int | None = None
    ) -> str:
        """One line for the run/serve header: which path each operation takes (``fused_norms``:
        the model's norm ops that run as fused kernels; ``head_dim``: the model's, where the
        kernel depends on it)."""
        return f"{self.device.type}: PyTorch ops (linear F.linear, attention SDPA, norms unfused)"


def gather_decode_context(k_slots: Tensor, v_slots: Tensor, meta: Any) -> tuple[Tensor, Tensor]:
    """Each decode's context as [batch, max_context, kv_heads, dim] K and V."""
    b, width = meta.decode_slots.shape
    num_kv_heads, head_dim = k_slots.shape[1], k_slots.shape[2]
    flat = meta.decode_slots.view(-1)
    # index_select is several times faster than advanced indexing for this gather on CPU.
    keys = k_slots.index_select(0, flat).view(b, width, num_kv_heads, head_dim)
    values = v_slots.index_select(0, flat).view(b, width, num_kv_heads, head_dim)
    return keys, values


def auto_dtype(device: torch.device) -> tuple[str, str | None]:
    """What ``dtype="auto"`` means on ``device``, and the one line that says why where it is
    not bfloat16. vLLM serves bf16 by default. On a CPU, bf16 needs a bf16 matmul: AMX's or AVX-512's
    (tailserve's AMX or dpbf16 kernel, or oneDNN), or at level avx2 tailserve's AVX2 kernel (bf16 weights, float32 FMAs:
    ~2x MKL's float32 ``F.linear`` at a decode batch of 64 and 4x at 1-8 rows on a Zen 3, half
    the bytes; docs/executor.md). Without one (a generic CPU, or the kernel not built) PyTorch's
    generic bf16 GEMM measured 5-9 GFLOP/s against float32's ~30, so there float32 is both
    faster and transformers-exact."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", None
        return "float16", "dtype auto -> float16: this GPU has no bfloat16"
    if device.type != "cpu":
        return "float32", None
    from tailserve.executors.pytorch import cpu_isa, cpu_kernels

    isa = cpu_isa.detect()
    if isa.at_least("avx512"):
        return "bfloat16", None
    if isa.level == "avx2":
        if cpu_kernels.linear_avx2_kernel() is not None:
            return "bfloat16", None
        why = cpu_kernels.failure() or "TAILSERVE_CPU_KERNEL=0 or TAILSERVE_LINEAR_KERNEL=torch"
        return "float32", (
            f"dtype auto -> float32: this CPU's level is avx2 and tailserve's AVX2 bf16 kernel is "
            f"unavailable ({why}); --dtype bfloat16 runs anyway, on PyTorch's slower generic bf16 path"
        )
    return "float32", (
        f"dtype auto -> float32: this CPU's level is {isa.level} (tailserve's bf16 matmuls need "
        "x86 AVX2 or AVX-512); "
        "--dtype bfloat16 runs anyway, on PyTorch's slower generic bf16 path"
    )


def backend_for(device: torch.device) -> TorchBackend:
    """The backend for ``device``: the CPU's kernels, CUDA's, or PyTorch's ops elsewhere."""
    if device.type == "cpu":
        from tailserve.executors.pytorch.cpu_backend import CpuBackend

        return CpuBackend(device)
    if device.type == "cuda":
        from tailserve.executors.pytorch.cuda_backend import CudaBackend

        return CudaBackend(device)
    return TorchBackend(device)
