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

import torch

from tailserve.executors.pytorch.backend import TorchBackend


class CudaBackend(TorchBackend):
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False")
        super().__init__(device)
        # float32 must stay float32: TF32 matmuls would change tokens against transformers.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def describe(self, dtype: torch.dtype, fused_norms: tuple[str, ...] = ()) -> str:
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
    if torch.backends.cuda.math_sdp_enabled():
        kinds.append("math")
    return "/".join(kinds) or "none enabled"
