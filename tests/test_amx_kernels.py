"""The AMX kernels (level amx_bf16): bf16 linear layers through tiles (``linear_amx`` over the
dpbf16 packing) compute what a float64 matmul rounded to bf16 does, each row independent of the
others; prefill attention through tiles agrees with the dpbf16 kernel to bf16 rounding; the lower
level on the same machine still runs the dpbf16 kernels."""

from __future__ import annotations

import pytest
import torch
from benchmarks.engine_kernels import prefill_case

from tailserve.executors.pytorch import cpu_isa, cpu_kernels
from tailserve.executors.pytorch.cpu_backend import PackedLinear, linear_path

BF16, CPU = torch.bfloat16, torch.device("cpu")
pytestmark = pytest.mark.skipif(
    cpu_isa.native() != "amx_bf16",
    reason=f"this CPU's level is {cpu_isa.native()}, not amx_bf16 (AMX, granted by the OS)",
)


@pytest.fixture()
def amx(monkeypatch):
    for key in ("TAILSERVE_CPU_ISA", "TAILSERVE_LINEAR_KERNEL"):
        monkeypatch.delenv(key, raising=False)
    if cpu_kernels.linear_amx_kernel() is None:
        if cpu_kernels.load() is not None and cpu_kernels.amx_failure():
            pytest.skip(f"the compiler built no AMX kernels: {cpu_kernels.amx_failure()}")
        pytest.fail(f"level amx_bf16 but no AMX kernel: {cpu_kernels.failure()}")
    return cpu_kernels.linear_amx_kernel()


def _case(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
    return w, torch.randn(n, generator=g).to(BF16), torch.randn(rows, k, generator=g).to(BF16)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 100])
@pytest.mark.parametrize("shape", [(1536, 512), (512, 1536), (64, 32)])
def test_amx_matches_a_float64_matmul_rounded_once(amx, rows, shape):
    w, b, x = _case(rows, *shape, seed=rows)
    packed = PackedLinear(w)
    assert packed.kind == "amx"
    for bias in (None, b):
        got = packed(x, bias)
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        assert got.dtype == BF16 and got.shape == (rows, shape[0])
        # float32 sums of bf16 products, rounded once: within one bf16 step of the exact value.
        step = want.abs().clamp_min(2**-10) * 2**-7
        assert ((got.double() - want).abs() <= step).all()


def test_a_rows_result_does_not_depend_on_the_other_rows(amx):
    """What lets the model run its last layer on the sampled rows alone (``rows_independent``),
    and keeps a request's tokens the same whatever its batch: bit for bit, alone or in 16s."""
    w, b, x = _case(37, 1024, 768, seed=3)
    packed = PackedLinear(w)
    whole = packed(x, b)
    assert torch.equal(torch.cat([packed(x[i : i + 1], b) for i in range(37)]), whole)
    assert torch.equal(packed(x[20:], b), whole[20:])  # rows moved to other tiles


def test_shapes_the_tiles_do_not_fit_take_the_dpbf16_kernel(amx):
    """AMX reads 32 input dims a step; 48 do not divide, and the dpbf16 kernel takes them."""
    w, b, x = _case(9, 128, 48, seed=4)
    packed = PackedLinear(w)
    assert packed.kind == "dpbf16"
    torch.testing.assert_close(packed(x, b), torch.nn.functional.linear(x, w, b), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        amx.linear_amx(x, packed.packed, None)


def test_the_lower_level_on_this_machine_runs_the_dpbf16_kernel(amx, monkeypatch):
    """``TAILSERVE_CPU_ISA=avx512_bf16``: what a Zen 4 or Cooper Lake runs, here."""
    w, b, x = _case(20, 512, 512, seed=5)
    assert linear_path(BF16, CPU) == "AMX kernel"
    amx_out = PackedLinear(w)(x, b)
    monkeypatch.setenv("TAILSERVE_CPU_ISA", "avx512_bf16")
    packed = PackedLinear(w)
    assert packed.kind == "dpbf16" and linear_path(BF16, CPU) == "dpbf16 kernel"
    assert cpu_kernels.linear_amx_kernel() is None
    # Same sums in another order: equal to within a bf16 step, not bit for bit.
    torch.testing.assert_close(packed(x, b), amx_out, rtol=1e-2, atol=1e-2)


def test_onednn_can_still_be_asked_for(amx, monkeypatch):
    monkeypatch.setenv("TAILSERVE_LINEAR_KERNEL", "onednn")
    assert PackedLinear(_case(1, 128, 64, seed=6)[0]).kind == "onednn"
    assert linear_path(BF16, CPU) == "oneDNN prepacked"


@pytest.mark.parametrize(
    "heads,kv_heads,d", [(8, 4, 64), (12, 4, 64), (32, 8, 128), (4, 4, 256), (6, 2, 96), (7, 1, 32)]
)
def test_amx_prefill_attention_agrees_with_the_dpbf16_kernel(amx, monkeypatch, heads, kv_heads, d):
    """Chunks on both sides of the 16-row and 16/32-key tiles (a context plus chunk of exactly
    64 keys among them), fresh and after cached context, GQA groups of 1-7 rows per KV head: the
    tiles' sums agree with the dpbf16 kernel's to bf16 rounding, element by element and on
    average; the head dims AMX does not take (32, 96) run the dpbf16 kernel, bit for bit."""
    new, ctx = [1, 40, 16, 7, 100, 33, 3, 32], [30, 0, 33, 64, 0, 200, 17, 32]
    case = prefill_case(d + heads, heads, kv_heads, d, new, ctx, spare_blocks=3)
    assert amx.prefill_amx_applies(d) == (d % 64 == 0)
    got = amx.paged_prefill_attention(*case)
    monkeypatch.setenv("TAILSERVE_CPU_ISA", "avx512_bf16")
    dpbf16 = cpu_kernels.load()
    assert dpbf16 is not amx and not dpbf16.prefill_amx_applies(d)
    want = dpbf16.paged_prefill_attention(*case)
    if d % 64:
        assert torch.equal(got, want)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-9)
    differ = (got != want).float().mean().item()
    assert 0 < differ < 0.05, differ  # the tiles ran (another order inside a pair), close to it


def test_the_header_names_the_amx_prefill_kernel(amx):
    assert cpu_kernels.prefill_kernel_name(BF16) == "AMX kernel"
    assert cpu_kernels.prefill_kernel_name(BF16, head_dim=128) == "AMX kernel"
    assert cpu_kernels.prefill_kernel_name(BF16, head_dim=96) == "dpbf16 kernel"  # as it runs
    assert cpu_kernels.prefill_kernel_name(torch.float32) == "SDPA"
