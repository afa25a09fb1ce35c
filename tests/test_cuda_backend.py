"""CudaBackend's own code paths, checked on the CPU where they do not need a GPU: its decode
attention with the KV heads repeated (half precision) against TorchBackend's GQA call, and its
SDPA kernel settings (cuDNN's per-shape plans off). tests/test_torch_executor.py's `gpu` test runs
the whole executor on a GPU."""

from __future__ import annotations

import pytest
import torch

from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata
from tailserve.executors.pytorch.backend import TorchBackend
from tailserve.executors.pytorch.cuda_backend import CudaBackend, _sdpa_kernels


def _cuda_backend_on_cpu() -> CudaBackend:
    backend = object.__new__(CudaBackend)  # __init__ asks for a GPU; the decode math needs none
    TorchBackend.__init__(backend, torch.device("cpu"))
    return backend


def _decode_case(dtype: torch.dtype, heads: int, kv_heads: int):
    gen = torch.Generator().manual_seed(7)
    block, dim = 16, 32
    contexts = [5, 40, 17, 64]
    kv = PagedKVCache(1, 32, block, kv_heads, dim, dtype, torch.device("cpu"))
    k_slots, v_slots = kv.slots(0)
    k_slots[: kv.null_slot].copy_(torch.randn(k_slots[: kv.null_slot].shape, generator=gen).to(dtype))
    v_slots[: kv.null_slot].copy_(torch.randn(v_slots[: kv.null_slot].shape, generator=gen).to(dtype))
    tables = [list(range(i * 6, i * 6 + 6)) for i in range(len(contexts))]
    meta = build_metadata(tables, [1] * len(contexts), contexts, len(contexts), block, kv.null_slot,
                          torch.device("cpu"))  # fmt: skip
    q = torch.randn(len(contexts), heads, dim, generator=gen).to(dtype)
    return q, k_slots, v_slots, meta


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 8), (6, 3)])
def test_half_precision_decode_repeats_kv_heads_and_matches_the_gqa_call(heads, kv_heads):
    q, k_slots, v_slots, meta = _decode_case(torch.bfloat16, heads, kv_heads)
    got = _cuda_backend_on_cpu().decode_attention(q, k_slots, v_slots, meta)
    want = TorchBackend(torch.device("cpu")).decode_attention(q, k_slots, v_slots, meta)
    assert got.shape == want.shape == (4, heads, 32)
    # the same attention: only bf16 rounding between the two kernels' sums
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # and not a trivially equal output: requests with different contexts differ
    assert not torch.allclose(got[0].float(), got[1].float(), atol=1e-2)


def test_float32_decode_is_torch_backends_call_exactly():
    q, k_slots, v_slots, meta = _decode_case(torch.float32, 8, 2)
    got = _cuda_backend_on_cpu().decode_attention(q, k_slots, v_slots, meta)
    want = TorchBackend(torch.device("cpu")).decode_attention(q, k_slots, v_slots, meta)
    assert torch.equal(got, want)


def test_sdpa_kernel_list_names_what_is_enabled():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert "cuDNN" in _sdpa_kernels()
        torch.backends.cuda.enable_cudnn_sdp(False)
        assert "cuDNN" not in _sdpa_kernels()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backend_turns_cudnn_sdpa_off():
    CudaBackend(torch.device("cuda"))
    assert not torch.backends.cuda.cudnn_sdp_enabled()
