"""The fused elementwise CPU kernels (RoPE with the q/k/v split, greedy argmax with its NaN check, the K/V store) agree with the PyTorch ops they replace, and a bf16 model gives the
same logits, bit for bit, through the fused path (RoPE, RMSNorm, SiLU-mul kernels) and PyTorch's."""

from __future__ import annotations

import pytest
import torch

from tailserve.executors.pytorch import cpu_kernels
from tailserve.executors.pytorch.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels could not be built here")
BF16 = torch.bfloat16


def _randn(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def test_rope_split_equals_rotary_embedding_bf16() -> None:
    ops = cpu_kernels.load()
    heads, kv_heads, dim, n = 8, 2, 64, 29
    rope = RotaryEmbedding(dim, 4096, 500000.0, None, BF16, torch.device("cpu"))
    qkv = _randn(n, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(3))
    q, k, v = ops.rope_split(qkv, rope.cos, rope.sin, positions, heads, kv_heads, dim)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    assert torch.equal(q, rope.apply(qkv[:, : heads * dim].view(n, heads, dim), cos, sin))
    assert torch.equal(
        k, rope.apply(qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim), cos, sin)
    )
    assert torch.equal(v, qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim))


def test_argmax_rows_keeps_the_first_maximum() -> None:
    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(4))
    logits[2, 7] = logits[2, 500] = 50.0  # a tie: the first index wins, as torch.argmax
    logits[5] = float("-inf")
    logits[5, 999] = 0.0
    logits[6] = float("-inf")  # every token banned: index 0, as torch.argmax
    assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_rows_nan_reports_a_nan_logit() -> None:
    logits = torch.randn(5, 700, generator=torch.Generator().manual_seed(6))
    tokens, has_nan = cpu_kernels.argmax_rows_nan(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and has_nan is False
    logits[3, 699] = float("nan")  # the last column: the check must read every value
    assert cpu_kernels.argmax_rows_nan(logits)[1] is True
    logits[3, 699] = float("inf")  # infinite is not NaN
    assert cpu_kernels.argmax_rows_nan(logits)[1] is False


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_store_kv_equals_index_copy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    cache = [torch.randn(64, 4, 32, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in cache]
    k, v = (torch.randn(5, 4, 32, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([9, 0, 63, 17, 18])
    assert cpu_kernels.store_kv(cache[0], cache[1], k, v, slots)
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    assert torch.equal(cache[0], want[0]) and torch.equal(cache[1], want[1])
    with pytest.raises(RuntimeError, match="slot 64 outside the cache's 64"):
        cpu_kernels.store_kv(cache[0], cache[1], k[:1], v[:1], torch.tensor([64]))


def test_bf16_model_logits_agree_with_the_pytorch_path(tmp_path, monkeypatch) -> None:
    from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata
    from tailserve.executors.pytorch.init_model import init_model
    from tailserve.executors.pytorch.loader import load_config, load_state_dict
    from tailserve.executors.pytorch.model import LlamaModel

    model_dir = tmp_path / "m"
    init_model(model_dir, "tiny", dtype="bfloat16")
    config = load_config(model_dir)
    cpu = torch.device("cpu")
    state = load_state_dict(model_dir, config, BF16, cpu)
    fused = LlamaModel(config, state, BF16, cpu)
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "0")
    plain = LlamaModel(config, state, BF16, cpu)
    assert fused.fused is not None and plain.fused is None
    assert fused.norm_ops.fused == ("rms_norm", "add_rms_norm", "silu_and_mul") and plain.norm_ops.fused == ()
    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    results = []
    for model in (fused, plain):
        kv = PagedKVCache(
            config.num_hidden_layers, 8, 16, config.num_key_value_heads, config.head_dim, BF16, cpu
        )
        meta = build_metadata([[0, 1, 2]], [40], [0], 0, 16, kv.null_slot, cpu)
        with torch.inference_mode():
            results.append(model.compute_logits(model.forward(ids, torch.arange(40), meta, kv)))
    assert torch.equal(results[0], results[1])  # the fused kernels give the PyTorch ops' bits
