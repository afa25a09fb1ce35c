"""The CUDA backend: the paged KV cache on the GPU, attention through PyTorch's SDPA.

Decodes gather their context from the paged cache into one padded batch and run one SDPA call
(flash or memory-efficient kernel, picked by PyTorch); each prefill chunk runs its own causal
SDPA call (``attention.paged_attention``). K/V stores are one ``index_copy_`` per tensor.
Everything else is ``TorchBackend``'s: plain ``F.linear`` (cuBLAS) and transformers' RMSNorm,
so float32 greedy tokens equal transformers' on the same GPU (TF32 stays off for matmuls, as
PyTorch's default and transformers' leave it). What a serving-grade CUDA path adds — a paged
attention kernel that reads blocks in place (FlashInfer, FlashAttention's paged KV), CUDA
graphs for decode steps — slots in here by overriding ``decode_attention`` and
``prefill_attention``; ``model.py`` does not change.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tailserve.executors.pytorch.backend import TorchBackend, gather_decode_context


class CudaBackend(TorchBackend):
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False")
        super().__init__(device)
        # float32 must stay float32: TF32 matmuls would change tokens against transformers.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # cuDNN's SDPA builds an execution plan for every new shape: serving makes one per call
        # (a decode's context grows a token per step, each prefill chunk has its own length).
        # On an H200 with PyTorch 2.11 the real executor's SDPA calls took 18 ms each on the
        # host, and a W run of the 16.8M-parameter model made 479 tok/s against 1,205 on a
        # 2-core CPU (scripts/gpu_check.py --profile; 36-46 ms per new shape in
        # scripts/gpu_sdpa.py). Flash / memory-efficient / math remain. Like the TF32 flags
        # above, the setting is PyTorch's, process-wide; the run header lists what is left.
        torch.backends.cuda.enable_cudnn_sdp(False)

    def decode_attention(self, q: Tensor, k_slots: Tensor, v_slots: Tensor, meta: Any) -> Tensor:
        """In bf16/fp16 the gathered context's KV heads are repeated to the query heads first:
        PyTorch's flash and memory-efficient kernels refuse a call with both a mask and
        ``enable_gqa`` (only math, or cuDNN's per-shape plans, take it). On an H200 at a
        Llama-3-8B shard's shapes (32 / 8 heads, batch 64) the math kernel took 3.2 ms per call
        over 1,000 tokens of context; repeated and on the memory-efficient kernel, 3.2 ms over
        2,000 (the math kernel there: 7.9 ms) (scripts/gpu_sdpa.py). A paged kernel that reads
        the blocks in place (FlashInfer) would skip the gather and the repeat both. float32 stays on ``TorchBackend``'s call: the math kernel,
        whose tokens equal transformers' (scripts/gpu_check.py)."""
        if q.dtype == torch.float32 or q.shape[1] == k_slots.shape[1]:
            return super().decode_attention(q, k_slots, v_slots, meta)
        keys, values = gather_decode_context(k_slots, v_slots, meta)
        group = q.shape[1] // k_slots.shape[1]
        res = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.transpose(1, 2).repeat_interleave(group, dim=1),
            values.transpose(1, 2).repeat_interleave(group, dim=1),
            attn_mask=meta.decode_mask,
        )
        return res.squeeze(2)

    def describe(
        self, dtype: torch.dtype, fused_norms: tuple[str, ...] = (), head_dim: int | None = None
    ) -> str:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        sdpa = _sdpa_kernels()
        return f"cuda path {name}: linear F.linear (cuBLAS), attention SDPA ({sdpa}), norms PyTorch"


def _sdpa_kernels() -> str:
    """The SDPA kernels PyTorch may pick here, in its order of preference."""
    kinds = []
    if torch.backends.cuda.flash_sdp_enabled():
        kinds.append("flash")
    if torch.backends.cuda.mem_efficient_sdp_enabled():
        kinds.append("memory-efficient")
    if torch.backends.cuda.cudnn_sdp_enabled():
        kinds.append("cuDNN")
    if torch.backends.cuda.math_sdp_enabled():
        kinds.append("math")
    return "/".join(kinds) or "none enabled"
