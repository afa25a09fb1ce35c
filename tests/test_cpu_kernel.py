"""The fused CPU decode-attention kernel agrees with the PyTorch path it replaces."""

from __future__ import annotations

import pytest
import torch

from tailserve.executors.pytorch import attention, cpu_isa, cpu_kernels


def _case(dtype, num_heads, num_kv_heads, lengths, head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    kv = attention.PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    k_slots, v_slots = kv.slots(0)
    k_slots[: num_blocks * block_size] = torch.randn(
        num_blocks * block_size, num_kv_heads, head_dim, generator=g
    ).to(dtype)
    v_slots[: num_blocks * block_size] = torch.randn(
        num_blocks * block_size, num_kv_heads, head_dim, generator=g
    ).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for n in lengths:
        need = -(-n // block_size)
        tables.append(perm[start : start + need])
        start += need
    meta = attention.build_metadata(
        tables,
        [1] * len(lengths),
        [n - 1 for n in lengths],
        len(lengths),
        block_size,
        kv.null_slot,
        torch.device("cpu"),
    )
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g).to(dtype)
    return q, k_slots, v_slots, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 4), (4, 4), (8, 1)])
def test_fused_kernel_matches_pytorch_path(monkeypatch, dtype, heads):
    if cpu_kernels.load() is None:
        pytest.skip(f"kernel could not be built here: {cpu_kernels.failure()}")
    q, k_slots, v_slots, meta = _case(dtype, *heads, lengths=[1, 17, 300, 64, 5])
    fused = cpu_kernels.paged_decode_attention(q, k_slots, v_slots, meta.decode_slots, meta.decode_lengths)
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "0")
    plain = attention._decode_attention(q, k_slots, v_slots, meta)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused.float(), plain.float(), rtol=tol, atol=tol)


def test_pytorch_path_matches_sdpa_reference(monkeypatch):
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "0")
    q, k_slots, v_slots, meta = _case(torch.float32, 8, 2, lengths=[3, 40, 129])
    got = attention._decode_attention(q, k_slots, v_slots, meta)
    keys = k_slots[meta.decode_slots].transpose(1, 2)
    values = v_slots[meta.decode_slots].transpose(1, 2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
    ).squeeze(2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "heads,head_dim", [((8, 4), 64), ((12, 4), 64), ((8, 8), 64), ((32, 8), 128), ((7, 1), 32)]
)
def test_bf16_decode_kernels_agree(monkeypatch, heads, head_dim):
    """The AVX-512 bf16 kernel or the AVX2 one (at those levels) and the portable one all match
    the PyTorch path, over lengths on both sides of its 16-key blocks and GQA groups of 1 to 7."""
    if cpu_kernels.load() is None:
        pytest.skip(f"kernel could not be built here: {cpu_kernels.failure()}")
    q, k_slots, v_slots, meta = _case(
        torch.bfloat16, *heads, lengths=[1, 15, 16, 17, 33, 300], head_dim=head_dim, seed=3
    )
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "0")
    plain = attention._decode_attention(q, k_slots, v_slots, meta).float()
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "1")
    for kernel in ("portable", "auto"):
        monkeypatch.setenv("TAILSERVE_DECODE_KERNEL", kernel)
        got = cpu_kernels.paged_decode_attention(q, k_slots, v_slots, meta.decode_slots, meta.decode_lengths)
        assert got.dtype == torch.bfloat16 and got.shape == q.shape
        # Both accumulate in float32; they differ from PyTorch's order by float32 rounding only,
        # so at most one bf16 step of the output.
        torch.testing.assert_close(got.float(), plain, rtol=1e-2, atol=1e-2, msg=kernel)


def test_decode_isa_names_the_kernel(monkeypatch):
    if cpu_kernels.load() is None:
        pytest.skip(f"kernel could not be built here: {cpu_kernels.failure()}")
    expected = {"amx_bf16": "avx512_bf16", "avx512_bf16": "avx512_bf16", "avx2": "avx2"}.get(
        cpu_isa.detect().level, "portable"
    )
    assert cpu_kernels.decode_isa() == expected
    monkeypatch.setenv("TAILSERVE_DECODE_KERNEL", "portable")
    assert cpu_kernels.decode_isa() == "portable"


@pytest.mark.parametrize(
    "heads,d", [((8, 4), 64), ((12, 4), 64), ((4, 4), 64), ((32, 8), 128), ((7, 1), 32), ((6, 2), 96)]
)
def test_prefill_kernel_matches_sdpa(monkeypatch, heads, d):
    """A batch of decodes and prefill chunks (fresh prompts, and chunks after cached context)
    through ``paged_attention``: the AVX-512 bf16 or AVX2 tiled prefill kernel where it
    runs, PyTorch's SDPA per chunk otherwise; both agree to bf16 rounding."""
    if cpu_kernels.load() is None:
        pytest.skip(f"kernel could not be built here: {cpu_kernels.failure()}")
    h, kvh = heads
    bs, num_blocks = 16, 96
    g = torch.Generator().manual_seed(5)
    # Two decodes, then chunks on both sides of the kernel's 8-row and 16-key tiles, fresh and
    # after cached context.
    new = [1, 1, 40, 16, 7, 100, 1, 3]
    ctx = [30, 70, 0, 33, 64, 0, 200, 17]
    tables, start = [], 0
    perm = torch.randperm(num_blocks, generator=g).tolist()
    for c, n in zip(ctx, new):
        need = -(-(c + n) // bs)
        tables.append(perm[start : start + need])
        start += need
    meta = attention.build_metadata(tables, new, ctx, 2, bs, num_blocks * bs, torch.device("cpu"))
    kv = attention.PagedKVCache(1, num_blocks, bs, kvh, d, torch.bfloat16, torch.device("cpu"))
    ks, vs = kv.slots(0)
    ks[: num_blocks * bs] = torch.randn(num_blocks * bs, kvh, d, generator=g).to(torch.bfloat16)
    vs[: num_blocks * bs] = torch.randn(num_blocks * bs, kvh, d, generator=g).to(torch.bfloat16)
    tokens = sum(new)
    q = torch.randn(tokens, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(tokens, kvh, d, generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, kvh, d, generator=g).to(torch.bfloat16)
    results = {}
    for kernel in ("portable", "auto"):
        monkeypatch.setenv("TAILSERVE_DECODE_KERNEL", kernel)
        meta.prefill_kernel = None
        results[kernel] = attention.paged_attention(q, k, v, ks.clone(), vs.clone(), meta).float()
    assert (meta.prefill_kernel is not None) == (cpu_kernels.decode_isa() in ("avx512_bf16", "avx2"))
    torch.testing.assert_close(results["auto"], results["portable"], rtol=1e-2, atol=1e-2)
