"""The CPU backend: PyTorch's ops with tailserve's fused kernels and prepacked bf16 weights
wherever this CPU's level (``cpu_isa``) runs them.

Per level, for a bf16 model (docs/executor.md): linear layers through tailserve's AMX kernel
(amx_bf16), its dpbf16 kernel (avx512_bf16), oneDNN's prepacked matmul (avx512: oneDNN's bf16 reorder needs avx512bw/vl/dq),
tailserve's AVX2 kernel (avx2: bf16 weights widened to float32 in registers) or ``F.linear``
(generic); decode attention through the dpbf16 kernel, the AVX2 one or the portable one;
prefill attention through the AMX, dpbf16 or AVX2 tiled kernel or SDPA; RMSNorm/SiLU-mul fused
wherever the kernel reproduces PyTorch's bits on this machine. float32 models keep PyTorch's
linear, norms, RoPE and prefill SDPA on every level (the transformers-exact path); their decode
attention and K/V stores still take the kernels (the AVX2 one at avx2, float32 loops elsewhere).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tailserve.executors.pytorch import cpu_isa, cpu_kernels, cpu_malloc, cpu_norm
from tailserve.executors.pytorch.attention import prefill_kernel_inputs
from tailserve.executors.pytorch.backend import TorchBackend, gather_decode_context, torch_norm_ops

Tensor = torch.Tensor
_HALF = (torch.bfloat16, torch.float16)


class PackedLinear:
    """A bf16 weight packed once at load, as vLLM's CPU backend prepacks its GEMM weights, for
    the matmul this CPU's level has (``kind``):

    - ``dpbf16`` (avx512_bf16, an output count that is a multiple of 64; at amx_bf16 the shapes
      whose input count is not a multiple of 32): tailserve's own kernel
      (``cpu_kernels.linear_kernel``; [out / 64, in / 2, 64, 2], the pair layout
      ``_mm512_dpbf16_ps`` reads). Against oneDNN's prepacked matmul on the 2-core EPYC (the
      small model's four projections, 2 threads): 2.1x at 1 row, 1.6x at 8, 1.15x at 64 (a
      decode batch, its weights coming from memory as in a forward pass), even at 256-2,048
      (0.96-1.1x per projection; docs/executor.md). Its sums run in input order, pair by pair;
      oneDNN's order differs in the last bit of ~0.01-0.05% of outputs, so bf16 tokens can
      differ from a oneDNN run (``TAILSERVE_LINEAR_KERNEL=onednn`` selects oneDNN).
    - ``amx`` (amx_bf16, 64 | out and 32 | in): tailserve's AMX kernel (``linear_amx``) over the
      dpbf16 packing, 16 rows x 64 outputs per tile step. On a 2-core Xeon with AMX (the tiny
      model's step and a Llama-3.2-1B layer, 2 threads, ``benchmarks.engine_kernels``): 1.0-1.3x
      dpbf16's speed at 1 row, 1.8-1.9x at 4, 5.8-6.6x at 64, 7.8-8.9x at 256; against oneDNN's
      prepacked matmul (AMX too there) 1.1-1.7x at 1 row, even at 64, 0.86-1.03x at 1,024. A row's result
      does not depend on the batch; a pair's two products are added in another order than
      dpbf16's, so bf16 tokens can differ from an avx512_bf16 run.
    - ``onednn`` (avx512, or a dpbf16 CPU's other shapes): reordered once for oneDNN
      (``torch.ops.mkldnn``), the same bits as ``F.linear`` and 2-2.8x its speed at 1-7 rows,
      1.2x at 64, ~5% at 512-2,048: ``F.linear`` reorders the weight inside every call.
    - ``avx2`` (avx2: Haswell to Zen 3, no bf16 instruction): tailserve's AVX2 kernel
      (``cpu_kernels.linear_avx2_kernel``; [ceil(out / 16), in, 8, 2], 16 outputs per 32-byte
      row), bf16 weights widened to float32 in registers and summed with FMAs in input order.
      oneDNN's bf16 reorder raises on such a CPU and PyTorch's generic bf16 GEMM ran at 5-9
      GFLOP/s; this one at ~170-180 (64 rows, 2 threads, ~2x MKL's float32 ``F.linear``).

    Either way a row's result does not depend on the other rows. Below avx2 nothing is packed
    (``can_pack``)."""

    __slots__ = ("in_features", "kernel", "kind", "numel", "out_features", "packed")

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.numel = weight.numel()
        n, k = self.out_features, self.in_features
        self.kernel = cpu_kernels.linear_avx2_kernel()
        if self.kernel is not None:
            self.kind = "avx2"
            self.packed = pack_avx2(weight)
            return
        self.kernel = cpu_kernels.linear_amx_kernel()
        if self.kernel is not None and n % 64 == 0 and k % 32 == 0:
            self.kind = "amx"
            self.packed = pack_dpbf16(weight)
            return
        self.kernel = cpu_kernels.linear_kernel()
        if self.kernel is not None and n % 64 == 0 and k % 2 == 0:
            self.kind = "dpbf16"
            self.packed = pack_dpbf16(weight)
        else:
            self.kernel, self.kind = None, "onednn"
            # The batch-size hint picks the blocking; any number of rows works, and the speed
            # barely depends on the hint (measured 1-2,048 rows).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.kind == "avx2":
            y = self.kernel.linear_avx2(rows, self.packed, self.out_features, bias)
        elif self.kind == "amx":
            y = self.kernel.linear_amx(rows, self.packed, bias)
        else:
            y = self.kernel.linear_bf16(rows, self.packed, bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


def pack_dpbf16(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [out / 64, in / 2, 64, 2], the dpbf16 and AMX kernels' layout: per pair
    of input dims the 64 outputs' two weights side by side (an AMX B tile's rows)."""
    n, k = weight.shape
    return weight.reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_avx2(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [ceil(out / 16), in, 8, 2], ``linear_avx2``'s layout: per panel of 16
    outputs and input dim, 8 words whose low halves are outputs 0-7 and high halves 8-15 (a
    shift and a mask widen them to two float32 vectors). Outputs past ``out`` are zero."""
    n, k = weight.shape
    panels = -(-n // 16)
    padded = weight.new_zeros(panels * 16, k)
    padded[:n] = weight
    return padded.view(panels, 2, 8, k).permute(0, 3, 2, 1).contiguous()


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights in ``dtype`` on ``device`` are prepacked here: bf16 on a CPU at level
    avx512 or above with oneDNN, or at level avx2 with tailserve's AVX2 kernel built
    (``TAILSERVE_PACK_WEIGHTS=0`` says no)."""
    # fp16 GEMMs in oneDNN want avx512_fp16/AMX: not measured.
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if os.environ.get("TAILSERVE_PACK_WEIGHTS", "1") == "0":
        return False
    if cpu_isa.detect().level == "avx2":
        return cpu_kernels.linear_avx2_kernel() is not None
    return (
        cpu_isa.detect().at_least("avx512")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


AVX2_LINEAR = "bf16->fp32 FMA kernel (AVX2)"  # the header's name for the avx2 path


def linear_path(dtype: torch.dtype, device: torch.device) -> str:
    """What a linear layer of a ``dtype`` model runs here, in words (the header's)."""
    if not can_pack(dtype, device):
        return "F.linear (BLAS)" if dtype == torch.float32 else "F.linear (PyTorch's generic bf16 GEMM)"
    if cpu_kernels.linear_avx2_kernel() is not None:
        return AVX2_LINEAR
    if cpu_kernels.linear_amx_kernel() is not None:
        return "AMX kernel"
    return "dpbf16 kernel" if cpu_kernels.linear_kernel() is not None else "oneDNN prepacked"


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.isa = cpu_isa.detect()  # raises CpuIsaError for a bad TAILSERVE_CPU_ISA
        self.malloc = cpu_malloc.tune()  # raises CpuMallocError for a bad TAILSERVE_MALLOC
        self.kernels = cpu_kernels.load()  # this level's build, or None (fallback logged once)

    def rows_independent(self, weight: Any) -> bool:
        return isinstance(weight, PackedLinear)

    def prepare_linear(self, weight: Tensor, dtype: torch.dtype) -> Any:
        return PackedLinear(weight) if can_pack(dtype, self.device) else weight

    def norm_ops(self, eps: float, dtype: torch.dtype, hidden: int, intermediate: int) -> cpu_norm.NormOps:
        reference = torch_norm_ops(eps)
        if self.kernels is None or dtype not in _HALF:
            return reference
        return cpu_norm.exact_ops(self.kernels, reference, dtype, hidden, intermediate, eps)

    def rope_split(self, dtype: torch.dtype) -> Any | None:
        # float32: the compiler contracts the kernel's multiply-adds (last-bit differences), and
        # float32 is the path that must equal transformers, so it stays on PyTorch's RoPE.
        return self.kernels if dtype in _HALF else None

    def store_kv(self, k_slots: Tensor, v_slots: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        if self.kernels is None or not cpu_kernels.store_kv(
            k_slots, v_slots, k, v, slot_mapping, self.kernels
        ):
            super().store_kv(k_slots, v_slots, k, v, slot_mapping)

    def decode_attention(self, q: Tensor, k_slots: Tensor, v_slots: Tensor, meta: Any) -> Tensor:
        if self.kernels is not None:
            return cpu_kernels.paged_decode_attention(
                q, k_slots, v_slots, meta.decode_slots, meta.decode_lengths, self.kernels
            )
        # PyTorch's CPU SDPA is tuned for long queries (~2-3x slower here): two batched float32
        # matmuls instead, float32 so scores are not rounded to bf16 before the softmax. One
        # copy each does the layout change and the upcast.
        keys, values = gather_decode_context(k_slots, v_slots, meta)
        b, width, num_kv_heads, head_dim = keys.shape
        group = q.shape[1] // num_kv_heads
        k32 = torch.empty(b, num_kv_heads, head_dim, width)
        k32.copy_(keys.permute(0, 2, 3, 1))
        v32 = torch.empty(b, num_kv_heads, width, head_dim)
        v32.copy_(values.transpose(1, 2))
        query = q.view(b, num_kv_heads, group, head_dim).float()
        scores = torch.matmul(query, k32) * head_dim**-0.5  # [b, kv_heads, group, width]
        scores.masked_fill_(~meta.decode_mask.view(b, 1, 1, width), float("-inf"))
        out = torch.matmul(scores.softmax(-1), v32)  # [b, kv_heads, group, dim]
        return out.view(b, num_kv_heads * group, head_dim).to(q.dtype)

    def prefill_attention(self, q: Tensor, k_slots: Tensor, v_slots: Tensor, meta: Any) -> Tensor | None:
        # bf16 at level amx_bf16 (AMX tiles), avx512_bf16 or avx2: every prefill chunk in one kernel call, reading its
        # K/V from the cache (stored before) with a float32 softmax. PyTorch's CPU SDPA runs these
        # short causal chunks at ~35 GFLOP/s of one core (benchmarks/engine_attention.py (since
        # removed; at daf5455)).
        if self.kernels is None or not cpu_kernels.prefill_attention_applies(q, k_slots, self.kernels):
            return None
        pk = prefill_kernel_inputs(meta)
        return cpu_kernels.paged_prefill_attention(
            q, k_slots, v_slots, pk.slots, pk.starts, pk.news, pk.contexts, self.kernels
        )

    def describe(
        self, dtype: torch.dtype, fused_norms: tuple[str, ...] = (), head_dim: int | None = None
    ) -> str:
        if self.kernels is None:
            why = "TAILSERVE_CPU_KERNEL=0" if not cpu_kernels.enabled() else cpu_kernels.failure()
            attention, norms = f"PyTorch (no kernels: {why})", "PyTorch"
        else:
            decode = cpu_kernels.decode_kernel_for(dtype, self.kernels)
            prefill = cpu_kernels.prefill_kernel_name(dtype, self.kernels, head_dim)
            attention = f"decode {decode} kernel, prefill {prefill}"
            norms = f"fused {'/'.join(fused_norms)}" if fused_norms else "PyTorch"
        return (
            f"cpu path {self.isa.label()}: linear {linear_path(dtype, self.device)}, "
            f"attention {attention}, norms {norms}"
        )
