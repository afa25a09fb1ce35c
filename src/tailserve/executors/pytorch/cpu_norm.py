"""RMSNorm, residual add + RMSNorm and SiLU-mul for a bf16/fp16 model on CPU, fused where the
fused kernel (C++ in ``cpu_norm_source.py``) gives PyTorch's bits.

The kernels reproduce ATen's order of operations (the sum's cascade, Sleef's exp), which
depends on the torch build and the CPU. So before a model uses one, a self-test runs it and the
PyTorch ops on a few hundred to 2,048 random rows of the model's width, with
adversarial values (tiny, huge, zero, denormal); only if every bit matches is it used, once per
process and (op, dtype, width). Otherwise one line is logged and that op stays PyTorch's, so a
bf16 model's outputs are the unfused path's on any machine.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class NormOps:
    """The three steps of a layer around its matmuls, for one model (its eps bound in)."""

    rms_norm: Callable[[Tensor, Tensor], Tensor]  # (x, weight) -> normed
    # (residual, delta, weight) -> (residual + delta, its norm)
    add_rms_norm: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]  # gate_up [N, 2I] -> silu(gate) * up [N, I]
    fused: tuple[str, ...] = ()  # which of the three run as fused kernels


_verdicts: dict[tuple[str, torch.dtype, int, Any], bool] = {}


def exp_plan() -> tuple[int, int]:
    """(elements per step of ATen's vectorised silu loop, which exp its vector code calls: 2 =
    Sleef 16 lanes, 1 = Sleef 8 lanes, 0 = std::exp) for the kernels torch dispatches to here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return 64, 2
    if capability == "AVX2":
        return 32, 1
    return 32, 0


def _rows(n: int, width: int, dtype: torch.dtype, seed: int) -> Tensor:
    """Random rows over many magnitudes, with zero rows, lone outliers and denormals."""
    g = torch.Generator().manual_seed(seed)
    top = 1e4 if dtype == torch.float16 else 1e15
    scale = torch.logspace(-6, math.log10(top), n).roll(seed % n)[:, None]
    x = torch.randn(n, width, generator=g) * scale
    x[3::17] = 0.0
    x[5::23, width // 3] = top
    x[7::29, : width // 2] = torch.finfo(dtype).tiny / 4  # denormal in the model dtype
    return x.to(dtype)


Cases = Callable[[], list[tuple[Tensor, ...]]]  # the argument tuples a self-test runs


def _differs(fused: Callable[..., Any], ref: Callable[..., Any], cases: Cases) -> str | None:
    try:
        for args in cases():
            got, want = fused(*args), ref(*args)
            got = got if isinstance(got, tuple | list) else (got,)
            want = want if isinstance(want, tuple | list) else (want,)
            for a, b in zip(got, want, strict=True):
                if a.shape != b.shape or not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    n = int((a != b).sum()) if a.shape == b.shape else -1
                    return f"{n} of {b.numel()} values differ"
    except Exception as e:  # a kernel that refuses these inputs is one we do not use
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def _verified(
    name: str,
    dtype: torch.dtype,
    width: int,
    fused: Callable[..., Any],
    ref: Callable[..., Any],
    cases: Cases,
    variant: Any = (),
) -> bool:
    # ``variant``: which build and plan the kernel is (the CPU level, the exp plan), so a
    # verdict for one level's kernels is never reused for another's (TAILSERVE_CPU_ISA changes).
    key = (name, dtype, width, variant)
    if key not in _verdicts:
        with torch.inference_mode():
            why = _differs(fused, ref, cases)
        _verdicts[key] = why is None
        if why is not None:
            log.warning(
                "fused %s (%s, width %d) does not reproduce PyTorch's ops here (%s): using PyTorch's",
                name,
                dtype,
                width,
                why,
            )
    return _verdicts[key]


def exact_ops(
    module: Any, reference: NormOps, dtype: torch.dtype, hidden: int, intermediate: int, eps: float
) -> NormOps:
    """``reference`` with each op the fused kernel of ``module`` can replace bit for bit here.

    ``module``: the compiled CPU kernels (``cpu_kernels.load()``), or None (all PyTorch)."""
    if module is None:
        return reference
    step, exp_kind = exp_plan()

    @functools.cache  # built only if some verdict is not cached yet
    def norm_case() -> tuple[Tensor, Tensor, Tensor]:
        rows = max(256, min(2048, 2**21 // hidden))  # 2,048 rows for small widths, ~2M values for big
        w = (torch.randn(hidden, generator=torch.Generator().manual_seed(3)) * 0.5 + 1.0).to(dtype)
        return _rows(rows, hidden, dtype, 1), _rows(rows, hidden, dtype, 2), w

    @functools.cache
    def gate_ups() -> list[Tensor]:
        # Odd row counts put torch's per-thread cuts mid-row; gates reach +-100s (exp overflows).
        return [
            (_rows(n, 2 * intermediate, dtype, 4 + n) / (1e13 if dtype == torch.bfloat16 else 1e2)).to(dtype)
            for n in (1, 7, 33, max(65, min(257, 2**21 // (2 * intermediate))) | 1)
        ]

    def rms(x: Tensor, weight: Tensor) -> Tensor:
        return module.rms_norm_exact(x.contiguous(), weight, eps)

    def add_rms(residual: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        s, y = module.add_rms_norm_exact(residual.contiguous(), delta.contiguous(), weight, eps)
        return s, y

    def silu_mul(gate_up: Tensor) -> Tensor:
        return module.silu_and_mul_exact(gate_up.contiguous(), step, exp_kind)

    def rms_cases() -> list[tuple[Tensor, ...]]:
        x, _, w = norm_case()
        return [(x, w)]

    def add_cases() -> list[tuple[Tensor, ...]]:
        x, r, w = norm_case()
        return [(r, x, w)]

    def silu_cases() -> list[tuple[Tensor, ...]]:
        return [(g,) for g in gate_ups()]

    from tailserve.executors.pytorch import cpu_isa

    v = (cpu_isa.detect().level, step, exp_kind)  # ``module`` is that level's build (cpu_kernels)
    ok = {
        "rms_norm": _verified("rms_norm", dtype, hidden, rms, reference.rms_norm, rms_cases, v),
        "add_rms_norm": _verified(
            "add_rms_norm", dtype, hidden, add_rms, reference.add_rms_norm, add_cases, v
        ),
        "silu_and_mul": _verified(
            "silu_and_mul", dtype, intermediate, silu_mul, reference.silu_and_mul, silu_cases, v
        ),
    }
    return NormOps(
        rms_norm=rms if ok["rms_norm"] else reference.rms_norm,
        add_rms_norm=add_rms if ok["add_rms_norm"] else reference.add_rms_norm,
        silu_and_mul=silu_mul if ok["silu_and_mul"] else reference.silu_and_mul,
        fused=tuple(name for name, good in ok.items() if good),
    )
