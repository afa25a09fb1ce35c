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


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
def test_argmax_rows_first_maximum_at_every_block_edge(dtype: torch.dtype) -> None:
    """The search tests 64 values at a time, then that block one by one: the first maximum on
    either side of a block edge, several in one block, in a later block and in the tail, and
    signed zeros (equal as floats), as torch.argmax over the float32 copy picks them."""
    vocab = 64 * 5 + 17
    logits = torch.full((12, vocab), -1.0)
    for row, cols in enumerate(([63, 64], [64, 63 + 64], [0, 64], [127, 128, 300], [5, 9, 40],
                                [320], [vocab - 1], [255, vocab - 1], [191], [64 * 5], [])):  # fmt: skip
        logits[row, cols] = 3.0
    logits[11, :] = 0.0
    logits[11, :70] = -0.0  # -0.0 == 0.0: the first zero, whatever its sign
    logits = logits.to(dtype)
    want = logits.float().argmax(dim=-1)
    assert want[3] == 127 and want[11] == 0
    assert torch.equal(cpu_kernels.argmax_rows(logits), want)
    many = torch.randint(-3, 4, (64, 8192), generator=torch.Generator().manual_seed(9)).to(dtype)
    assert torch.equal(cpu_kernels.argmax_rows(many), many.float().argmax(dim=-1))  # ties everywhere


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_argmax_rows_in_the_model_dtype_equals_the_float32_copy(dtype: torch.dtype) -> None:
    """The sampler's greedy argmax reads the LM head's bf16/fp16 logits: the same tokens and NaN
    verdict as over their float32 widening, ties and all-banned rows included."""
    logits = (torch.randn(7, 1001, generator=torch.Generator().manual_seed(8)) * 4).to(dtype)
    logits[1, 3] = logits[1, 900] = 60.0  # a tie in the model dtype
    logits[2] = float("-inf")
    logits[4, 1000] = 80.0  # the last column
    tokens, has_nan = cpu_kernels.argmax_rows_nan(logits)
    want, want_nan = cpu_kernels.argmax_rows_nan(logits.float())
    assert torch.equal(tokens, want) and has_nan is want_nan is False
    assert torch.equal(tokens, logits.float().argmax(dim=-1))
    logits[5, 1000] = float("nan")
    assert cpu_kernels.argmax_rows_nan(logits)[1] is True


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
    # oneDNN's matmul in both: tailserve's linear kernel sums in another order
    # (test_linear_kernel_*), and this compares the norm and RoPE kernels with PyTorch's ops.
    monkeypatch.setenv("TAILSERVE_LINEAR_KERNEL", "onednn")
    if cpu_kernels.decode_isa() in ("avx2", "avx512_bf16"):
        # The tiled prefill kernels (dpbf16, AVX2) sum and round P in their own order (checked
        # to bf16 rounding against SDPA in test_cpu_kernel.py, the AVX2 one against a float32
        # reference in test_cpu_avx2.py): SDPA in both here, as the linear layers.
        monkeypatch.setattr(cpu_kernels, "prefill_attention_applies", lambda *args, **kwargs: False)
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


def _linear_kernel_or_skip():
    if cpu_kernels.linear_kernel() is None:
        pytest.skip("no AVX-512 bf16 linear kernel here")


@pytest.mark.parametrize("shape", [(1280, 768), (768, 2304), (64, 10), (192, 6)])
def test_linear_kernel_matches_float32_to_bf16_rounding(shape) -> None:
    """tailserve's bf16 linear layer (PackedLinear over ``linear_bf16``) is the float32 product
    rounded once to bf16, up to float32 summation order, with and without a bias, at every row
    count on both sides of its 6-row tiles and 96/48-row blocks (0 rows included)."""
    from tailserve.executors.pytorch.cpu_backend import PackedLinear

    _linear_kernel_or_skip()
    n, k = shape
    w = _randn(n, k, seed=11)
    packed = PackedLinear(w)
    assert packed.kernel is not None
    bias = _randn(n, seed=12)
    for rows in (0, 1, 5, 6, 7, 64, 97, 200):
        x = _randn(rows, k, seed=rows)
        for b in (None, bias):
            got = packed(x, b)
            want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            assert got.dtype == BF16 and got.shape == (rows, n)
            # one bf16 rounding of the output, and float32 sums in another order: <= 2 bf16 steps
            torch.testing.assert_close(got.float(), want, rtol=2 * 2**-8, atol=1e-3)


def test_linear_kernel_rows_do_not_depend_on_the_batch() -> None:
    """A row's output is the same bits whatever the other rows and their number (what lets the
    last layer run on the sampled rows alone), and close to oneDNN's prepacked matmul."""
    from tailserve.executors.pytorch.cpu_backend import PackedLinear

    _linear_kernel_or_skip()
    w = _randn(4608, 768, scale=0.05, seed=13)
    packed = PackedLinear(w)
    x = _randn(300, 768, seed=14)
    full = packed(x)
    for rows in ([0], [299], [3, 150, 7], list(range(0, 300, 13))):
        assert torch.equal(packed(x[rows]), full[rows])
    assert torch.equal(packed(x.view(3, 100, 768)), full.view(3, 100, 4608))
    onednn = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(w, 64), None, "none", [], ""
    )
    torch.testing.assert_close(full.float(), onednn.float(), rtol=2 * 2**-8, atol=1e-3)


def test_linear_kernel_follows_the_switches(monkeypatch) -> None:
    from tailserve.executors.pytorch.cpu_backend import PackedLinear

    _linear_kernel_or_skip()
    w = _randn(128, 64, seed=15)
    assert PackedLinear(w).kernel is not None
    assert PackedLinear(_randn(100, 64, seed=16)).kernel is None  # 100 outputs: not whole panels
    monkeypatch.setenv("TAILSERVE_LINEAR_KERNEL", "onednn")
    assert PackedLinear(w).kernel is None
    monkeypatch.delenv("TAILSERVE_LINEAR_KERNEL")
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "0")
    assert PackedLinear(w).kernel is None
