"""The AVX2 path (level avx2: Haswell to Zen 3, and any x86-64 CPU forced there with
``TAILSERVE_CPU_ISA=avx2``): tailserve's linear kernel over bf16 weights widened to float32 and its
AVX2 decode attention, each against a float64/float32 reference; where each is used and where not;
and a bf16 model on that path against the float32 reference model."""

from __future__ import annotations

import pytest
import torch

from tailserve.executors.pytorch import attention, cpu_isa, cpu_kernels
from tailserve.executors.pytorch.backend import TorchBackend, auto_dtype
from tailserve.executors.pytorch.cpu_backend import AVX2_LINEAR, CpuBackend, PackedLinear, can_pack

BF16 = torch.bfloat16
CPU = torch.device("cpu")
NATIVE = cpu_isa.native()
# The level this process started at: below NATIVE when TAILSERVE_CPU_ISA forced it down
# (test_cpu_levels.py), which also caps PyTorch's own dispatch (ATEN_CPU_CAPABILITY,
# ONEDNN_MAX_CPU_ISA) for the whole process: levels above it cannot run their matmuls here.
STARTED = cpu_isa.detect().level
pytestmark = pytest.mark.skipif(
    "avx2" not in cpu_isa.LEVELS[: cpu_isa.LEVELS.index(NATIVE) + 1],
    reason=f"this CPU executes at most {NATIVE}",
)


@pytest.fixture(autouse=True)
def at_avx2(monkeypatch):
    """Every test runs at level avx2: this CPU's own on an AVX2 machine, forced on an AVX-512 one."""
    monkeypatch.setenv("TAILSERVE_CPU_ISA", "avx2")
    for name in (
        "TAILSERVE_LINEAR_KERNEL",
        "TAILSERVE_DECODE_KERNEL",
        "TAILSERVE_PACK_WEIGHTS",
        "TAILSERVE_CPU_KERNEL",
    ):
        monkeypatch.delenv(name, raising=False)
    if cpu_kernels.linear_avx2_kernel() is None:
        pytest.skip(f"the kernels could not be built here: {cpu_kernels.failure()}")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def _check_linear(packed: PackedLinear, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The kernel's output is the exact product rounded once to bf16, up to float32 summation:
    |got - exact| <= 2^-8 |exact| (one rounding to bf16's 8 significant bits) + (K + 2) 2^-23
    sum|x w| (twice the standard bound on K float32 FMAs and the bias add, in any order), the
    exact product taken in float64."""
    got = packed(x, bias)
    assert got.dtype == BF16 and got.shape == (x.shape[0], w.shape[0])
    exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
    magnitude = torch.nn.functional.linear(x.double().abs(), w.double().abs())
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = 2.0**-8 * exact.abs() + (w.shape[1] + 2) * 2.0**-23 * magnitude
    excess = (got.double() - exact).abs() - bound
    assert excess.numel() == 0 or excess.max().item() <= 0, (
        f"rows {x.shape[0]}, shape {tuple(w.shape)}: over by {excess.max().item()}"
    )


@pytest.mark.parametrize("shape", [(16, 5), (33, 17), (1, 1), (70, 9), (100, 77), (48, 3), (250, 130)])
def test_linear_matches_the_exact_product_at_odd_shapes(shape):
    """Output counts that are not whole 16-output panels, any input count, 0-70 rows (every row
    tiling: 1 and 2 rows take 4 and 2 panels per tile, 3-6 rows one tile, more rows tiles of
    near-equal size), with and without a bias."""
    n, k = shape
    w = _randn(n, k, seed=n * 1000 + k)
    bias = _randn(n, seed=7)
    packed = PackedLinear(w)
    assert packed.kind == "avx2"
    for rows in range(0, 71):
        x = _randn(rows, k, seed=rows)
        for b in (None, bias):
            _check_linear(packed, w, x, b)


@pytest.mark.parametrize("shape", [(1024, 512), (512, 1536), (3072, 512), (2048, 2048)])
def test_linear_matches_the_exact_product_at_model_shapes(shape):
    """The tiny model's projections and a ~1B model's attention matrix, at decode and prefill
    row counts (and 3-D input, as the model passes it)."""
    n, k = shape
    w = _randn(n, k, seed=11, scale=0.05)
    packed = PackedLinear(w)
    for rows in (1, 2, 3, 7, 8, 64, 65, 200):
        _check_linear(packed, w, _randn(rows, k, seed=rows), None)
    x = _randn(2, 5, k, seed=3)
    assert torch.equal(packed(x), packed(x.view(10, k)).view(2, 5, n))


def test_linear_rows_do_not_depend_on_the_batch():
    """A row's output has the same bits whatever the other rows and their number, whichever
    tile shape it lands in (what lets the last layer run on the sampled rows alone)."""
    w = _randn(4608, 768, seed=13, scale=0.05)
    packed = PackedLinear(w)
    x = _randn(300, 768, seed=14)
    full = packed(x)
    for rows in ([0], [299], [1, 2], [3, 150, 7], [4, 5, 6, 7, 8], list(range(0, 300, 13)), list(range(70))):
        assert torch.equal(packed(x[rows]), full[rows])


def test_decode_kernel_matches_the_pytorch_path():
    """The AVX2 decode attention, bf16 and float32 caches, GQA groups of 1 to 8, head dims it
    has instances for, over lengths on both sides of its 8- and 16-key steps; float32 softmax
    and sums in both, so they differ by float32 rounding only (bf16: at most one output step)."""
    import test_cpu_kernel

    for dtype, tol in ((BF16, 1e-2), (torch.float32, 2e-5)):
        for heads, head_dim in [((8, 4), 64), ((12, 4), 64), ((8, 8), 64), ((32, 8), 128), ((7, 1), 32),
                                ((6, 2), 96), ((16, 2), 256), ((40, 8), 128), ((10, 2), 64)]:  # fmt: skip
            lengths = [1, 7, 8, 9, 15, 16, 17, 33, 100]
            q, k_slots, v_slots, meta = test_cpu_kernel._case(
                dtype, *heads, lengths=lengths, head_dim=head_dim, seed=3
            )
            got = cpu_kernels.paged_decode_attention(
                q, k_slots, v_slots, meta.decode_slots, meta.decode_lengths
            )
            assert got.dtype == dtype and got.shape == q.shape
            keys, values = k_slots[meta.decode_slots].float(), v_slots[meta.decode_slots].float()
            want = torch.nn.functional.scaled_dot_product_attention(
                q.float().unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=meta.decode_mask, enable_gqa=True,
            ).squeeze(2)  # fmt: skip
            torch.testing.assert_close(
                got.float(), want, rtol=tol, atol=tol, msg=f"{dtype} {heads} {head_dim}"
            )


@pytest.mark.parametrize(
    "heads,d",
    [((8, 4), 64), ((12, 4), 64), ((4, 4), 64), ((32, 8), 128), ((7, 1), 32), ((6, 2), 96), ((8, 2), 256)],
)
def test_prefill_kernel_matches_a_float32_reference(heads, d):
    """Prefill chunks (fresh, and after cached context; lengths on both sides of the kernel's
    6-row and 16-key tiles) through the AVX2 prefill kernel, against attention computed in
    float32 on the same bf16 values: the kernel's P and sums are float32, so the only
    difference is its one rounding to bf16 and float32 summation order."""
    h, kvh = heads
    bs, num_blocks = 16, 96
    g = torch.Generator().manual_seed(5)
    new = [1, 1, 40, 16, 7, 100, 1, 3, 17]
    ctx = [30, 70, 0, 33, 64, 0, 200, 17, 5]
    tables, start = [], 0
    perm = torch.randperm(num_blocks, generator=g).tolist()
    for c, n in zip(ctx, new):
        need = -(-(c + n) // bs)
        tables.append(perm[start : start + need])
        start += need
    meta = attention.build_metadata(tables, new, ctx, 2, bs, num_blocks * bs, CPU)
    kv = attention.PagedKVCache(1, num_blocks, bs, kvh, d, BF16, CPU)
    ks, vs = kv.slots(0)
    ks[: num_blocks * bs] = torch.randn(num_blocks * bs, kvh, d, generator=g).to(BF16)
    vs[: num_blocks * bs] = torch.randn(num_blocks * bs, kvh, d, generator=g).to(BF16)
    tokens = sum(new)
    q = torch.randn(tokens, h, d, generator=g).to(BF16)
    k = torch.randn(tokens, kvh, d, generator=g).to(BF16)
    v = torch.randn(tokens, kvh, d, generator=g).to(BF16)
    got = attention.paged_attention(q, k, v, ks, vs, meta)
    assert meta.prefill_kernel is not None and got.dtype == BF16  # the kernel ran, not SDPA
    row = 2  # the two decodes come first
    for c, n, table in zip(ctx[2:], new[2:], tables[2:]):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(c + n)])
        keys = ks[slots].float().repeat_interleave(h // kvh, dim=1).transpose(0, 1)  # [h, c + n, d]
        values = vs[slots].float().repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        query = q[row : row + n].float().transpose(0, 1)  # [h, n, d]
        scores = query @ keys.transpose(1, 2) * d**-0.5
        causal = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
        want = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ values).transpose(0, 1)
        torch.testing.assert_close(got[row : row + n].float(), want, rtol=2**-7, atol=1e-3)
        row += n


def test_the_avx2_path_is_used_at_level_avx2_only(monkeypatch):
    w = _randn(64, 32, seed=1)
    assert can_pack(BF16, CPU) and PackedLinear(w).kind == "avx2"
    assert cpu_kernels.decode_isa() == "avx2"
    assert cpu_kernels.decode_kernel_for(torch.float32) == "avx2"
    assert cpu_kernels.decode_kernel_for(torch.float16) == "portable"
    assert auto_dtype(CPU) == ("bfloat16", None)
    line = CpuBackend(CPU).describe(BF16)
    assert f"linear {AVX2_LINEAR}" in line and "decode avx2 kernel, prefill avx2 kernel" in line, line
    assert "linear F.linear (BLAS)" in CpuBackend(CPU).describe(torch.float32)  # float32 stays MKL
    # Switches: PyTorch's bf16 F.linear (and so float32 for dtype auto), the portable attention.
    monkeypatch.setenv("TAILSERVE_LINEAR_KERNEL", "torch")
    assert not can_pack(BF16, CPU) and cpu_kernels.linear_avx2_kernel() is None
    dtype, why = auto_dtype(CPU)
    assert dtype == "float32" and "AVX2 bf16 kernel is unavailable" in why
    monkeypatch.delenv("TAILSERVE_LINEAR_KERNEL")
    monkeypatch.setenv("TAILSERVE_DECODE_KERNEL", "portable")
    assert cpu_kernels.decode_isa() == "portable"
    monkeypatch.delenv("TAILSERVE_DECODE_KERNEL")
    monkeypatch.setenv("TAILSERVE_PACK_WEIGHTS", "0")
    assert not can_pack(BF16, CPU)


@pytest.mark.parametrize("level", ["generic", "avx512", "avx512_bf16", "amx_bf16"])
def test_other_levels_keep_their_own_paths(monkeypatch, level):
    """Below avx2 (forced) nothing is packed and float32 is auto; at the AVX-512 levels (where
    the CPU has them) their own matmuls and decode kernels run, not the AVX2 ones."""
    if level not in cpu_isa.LEVELS[: cpu_isa.LEVELS.index(NATIVE) + 1]:
        pytest.skip(f"this CPU executes at most {NATIVE}, not {level}")
    if cpu_isa.LEVELS.index(level) > cpu_isa.LEVELS.index(STARTED):
        pytest.skip(f"this process runs PyTorch's dispatch at {STARTED} (forced), below {level}")
    monkeypatch.setenv("TAILSERVE_CPU_ISA", level)
    assert cpu_kernels.linear_avx2_kernel() is None
    assert cpu_kernels.decode_isa() in ("portable", "avx512_bf16", None)
    if level == "generic":
        assert not can_pack(BF16, CPU) and auto_dtype(CPU)[0] == "float32"
    elif can_pack(BF16, CPU):
        kind = PackedLinear(_randn(64, 32, seed=1)).kind
        assert kind == "amx" if level == "amx_bf16" else kind in ("dpbf16", "onednn")


def test_bf16_model_on_the_avx2_path_is_as_close_to_float32_as_pytorchs_bf16(tmp_path):
    """A bf16 model (the tiny preset's shapes, 2 layers) through the AVX2 kernels against the
    float32 reference (the same bf16 weights computed in float32, PyTorch's ops: transformers'
    numerics), next to PyTorch's own bf16 path (``TorchBackend``: F.linear, SDPA) against the same
    reference. Both round activations to bf16 after every op and accumulate in float32 inside
    them, so neither is exact; the AVX2 path must be no further from float32 than PyTorch's bf16
    is (with 25% slack for where the roundings happen to fall), over a prefill of 40 tokens and
    a decode step of 3 requests (the decode kernel), and pick the same greedy token wherever the
    float32 reference's top two logits are more than 0.05 apart."""
    from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata
    from tailserve.executors.pytorch.init_model import init_model
    from tailserve.executors.pytorch.loader import load_config, load_state_dict
    from tailserve.executors.pytorch.model import LlamaModel

    d = tmp_path / "tiny2"
    init_model(d, "tiny", dtype="bfloat16", num_hidden_layers=2)
    config = load_config(d)
    models = {
        "avx2": LlamaModel(config, load_state_dict(d, config, BF16, CPU), BF16, CPU),
        "torch_bf16": LlamaModel(config, load_state_dict(d, config, BF16, CPU), BF16, CPU, TorchBackend(CPU)),
        "float32": LlamaModel(
            config, load_state_dict(d, config, torch.float32, CPU), torch.float32, CPU, TorchBackend(CPU)
        ),
    }
    assert models["avx2"].packed and isinstance(models["avx2"].layers[0].qkv, PackedLinear)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g) for n in (40, 17, 60)]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    logits = {}
    for name, model in models.items():
        kv = PagedKVCache(
            config.num_hidden_layers, 16, 16, config.num_key_value_heads, config.head_dim, model.dtype, CPU
        )
        outs = []
        with torch.inference_mode():
            for i, p in enumerate(prompts):  # prefill each prompt but its last token
                n = len(p) - 1
                meta = build_metadata([tables[i]], [n], [0], 0, 16, kv.null_slot, CPU)
                out = model.forward(p[:n], torch.arange(n), meta, kv, out_rows=torch.tensor([n - 1]))
                outs.append(model.compute_logits(out))
            # One decode step for all three (the decode attention kernel on the CPU backend).
            lens = [len(p) - 1 for p in prompts]
            meta = build_metadata(tables, [1, 1, 1], lens, 3, 16, kv.null_slot, CPU)
            ids = torch.stack([p[-1] for p in prompts])
            outs.append(model.compute_logits(model.forward(ids, torch.tensor(lens), meta, kv)))
        logits[name] = torch.cat(outs)
    ref = logits["float32"]
    err = {name: (logits[name] - ref).abs().max().item() for name in ("avx2", "torch_bf16")}
    assert err["avx2"] <= 1.25 * err["torch_bf16"], err
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    assert torch.equal(logits["avx2"].argmax(-1)[clear], ref.argmax(-1)[clear])
