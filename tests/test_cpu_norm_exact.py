"""The fused RMSNorm, residual add + RMSNorm and SiLU-mul kernels give exactly the PyTorch ops'
bits (bf16 and fp16, model widths and an odd one, adversarial values, 1 and 2 threads), and the
guard in ``cpu_norm`` keeps PyTorch's op wherever a kernel does not."""

from __future__ import annotations

import logging

import pytest
import torch

from tailserve.executors.pytorch import cpu_kernels, cpu_norm
from tailserve.executors.pytorch.backend import rms_norm, silu_and_mul, torch_norm_ops

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels could not be built here")
DTYPES = (torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bitwise: -0 vs +0 would count, NaN payloads too


def _adversarial(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    top = 3e4 if dtype == torch.float16 else 1e17
    x = torch.randn(n, width, generator=g)
    if n >= 4:
        x *= torch.logspace(-5, 4, n)[:, None]
        x[0] = 0.0
        x[1, 3] = top  # one huge value beside small ones
        x[2] = torch.finfo(dtype).tiny / 8  # denormals of the dtype
        x[3, ::2] = -top / 7
    return x.to(dtype)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("width", [512, 768, 1000, 4096])
def test_rms_norm_and_add_rms_norm_are_bit_identical(dtype, width, threads) -> None:
    ops = cpu_kernels.load()
    w = (torch.randn(width, generator=torch.Generator().manual_seed(7)) * 0.3 + 1).to(dtype)
    for n, seed in ((1, 1), (13, 2), (200, 3)):
        x, r = _adversarial(n, width, dtype, seed), _adversarial(n, width, dtype, seed + 50)
        assert torch.equal(_bits(ops.rms_norm_exact(x, w, 1e-5)), _bits(rms_norm(x, w, 1e-5)))
        s, y = ops.add_rms_norm_exact(r, x, w, 1e-6)
        assert torch.equal(_bits(s), _bits(r + x))
        assert torch.equal(_bits(y), _bits(rms_norm(r + x, w, 1e-6)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("inter", [1536, 2304, 1000, 100])
def test_silu_and_mul_of_the_strided_halves_is_bit_identical(dtype, inter, threads) -> None:
    ops = cpu_kernels.load()
    step, exp_kind = cpu_norm.exp_plan()
    for n in (1, 3, 33, 65):  # odd counts cut torch's per-thread ranges mid-row at 2 threads
        g = torch.Generator().manual_seed(n + inter)
        gate_up = torch.randn(n, 2 * inter, generator=g) * 6
        gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 300.0, -300.0, 1e-30, -1e-30])
        gate_up = gate_up.to(dtype)
        assert torch.equal(
            _bits(ops.silu_and_mul_exact(gate_up, step, exp_kind)), _bits(silu_and_mul(gate_up))
        )


def test_exact_ops_uses_every_kernel_that_matches() -> None:
    ops = cpu_norm.exact_ops(cpu_kernels.load(), torch_norm_ops(1e-5), torch.bfloat16, 512, 1536, 1e-5)
    assert ops.fused == ("rms_norm", "add_rms_norm", "silu_and_mul")
    x = _adversarial(9, 512, torch.bfloat16, 4)
    assert torch.equal(
        ops.rms_norm(x, torch.ones(512, dtype=torch.bfloat16)),
        rms_norm(x, torch.ones(512, dtype=torch.bfloat16), 1e-5),
    )


class _OffByOneUlp:
    """The real kernels, except that rms_norm_exact moves one value a step and silu raises."""

    def __init__(self, real) -> None:
        self.real = real

    def rms_norm_exact(self, x, w, eps):
        y = self.real.rms_norm_exact(x, w, eps)
        y.view(torch.int16)[-1, -1] += 1
        return y

    def add_rms_norm_exact(self, *args):
        return self.real.add_rms_norm_exact(*args)

    def silu_and_mul_exact(self, *args):
        raise RuntimeError("silu_and_mul_exact: not on this CPU")


def test_the_guard_keeps_pytorchs_op_where_a_kernel_differs(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_norm, "_verdicts", {})
    reference = torch_norm_ops(1e-5)
    with caplog.at_level(logging.WARNING, logger="tailserve.executors.pytorch.cpu_norm"):
        ops = cpu_norm.exact_ops(_OffByOneUlp(cpu_kernels.load()), reference, torch.bfloat16, 768, 2304, 1e-5)
    assert ops.fused == ("add_rms_norm",)
    assert ops.rms_norm is reference.rms_norm and ops.silu_and_mul is reference.silu_and_mul
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "fused rms_norm" in messages[0] and "1 of" in messages[0] and "using PyTorch's" in messages[0]
    assert "fused silu_and_mul" in messages[1] and "not on this CPU" in messages[1]
    # Once per process and (op, dtype, width): a second model of that width logs nothing more.
    cpu_norm.exact_ops(_OffByOneUlp(cpu_kernels.load()), reference, torch.bfloat16, 768, 2304, 1e-5)
    assert len(caplog.records) == 2


def test_no_kernels_means_pytorchs_ops() -> None:
    reference = torch_norm_ops(1e-6)
    assert cpu_norm.exact_ops(None, reference, torch.bfloat16, 512, 1536, 1e-6) is reference
