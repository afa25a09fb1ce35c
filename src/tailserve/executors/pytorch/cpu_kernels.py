"""tailserve's CPU kernels (C++ in ``cpu_kernel_source.py``), compiled on first use.

- Decode attention: plain PyTorch has to gather every decode's context out of the paged cache
  into a padded tensor, convert it and run small batched matmuls — ~10x the bytes and kernel
  launches the arithmetic needs (see docs/executor.md). The kernel reads each request's K/V
  rows straight from their slots with a float32 softmax, as vLLM's CPU paged-attention kernel;
  one form per level (``decode_isa``: dpbf16, AVX2 or portable float32 loops).
- Linear layers over bf16 weights packed once at load: the AMX kernel (amx_bf16,
  ``linear_amx_kernel``), the dpbf16 kernel over the same packing (avx512_bf16, and amx_bf16's
  shapes AMX does not fit) and the AVX2 one (bf16 widened to float32 in registers, FMA sums;
  ``linear_avx2_kernel``).
- RoPE fused with the q/k/v split for bf16/fp16 models, and the greedy argmax.
- RMSNorm (with the residual add) and SiLU-mul for bf16/fp16 models, bit for bit ATen's
  (``cpu_norm_source.py``; ``cpu_norm.py`` checks each against PyTorch's ops before use).

They are built once with ``torch.utils.cpp_extension`` (g++ and ninja) into tailserve's cache
(``kernels/`` under ``$TAILSERVE_CACHE`` or ``~/.cache/tailserve``), keyed by source, flags,
torch version and CPU, and say so in one line while they build; where that is impossible, or
with ``TAILSERVE_CPU_KERNEL=0``, the executor uses the PyTorch path, and tests check both agree.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from tailserve.cache import cache_root
from tailserve.executors.pytorch import cpu_isa
from tailserve.executors.pytorch.cpu_kernel_source import FUNCTIONS, SOURCE
from tailserve.executors.pytorch.cpu_norm_source import NORM_FUNCTIONS, NORM_SOURCE

log = logging.getLogger(__name__)

_SOURCE = SOURCE + NORM_SOURCE

_lock = threading.Lock()
_modules: dict[str, Any] = {}  # by CPU level (cpu_isa): each level is its own build
_failures: dict[str, str] = {}
_amx_failure: list[str] = []  # why the amx_bf16 build failed where avx512_bf16's stands in


def amx_failure() -> str | None:
    """Why this process's amx_bf16 kernels are avx512_bf16's (a compiler without AMX), or None."""
    return _amx_failure[-1] if _amx_failure else None


def enabled() -> bool:
    return os.environ.get("TAILSERVE_CPU_KERNEL", "1") != "0"


_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]  # + the level's -march (cpu_isa.CpuIsa.compile_flags)


def _cflags(isa: cpu_isa.CpuIsa) -> list[str]:
    return [*_CFLAGS, *isa.compile_flags]


def build_name(isa: cpu_isa.CpuIsa | None = None) -> str:
    """The extension's name, keyed by what the binary depends on: the source and flags (the
    CPU level's ``-march`` among them), the torch it links against and the architecture. Two
    virtual environments with different torch builds therefore keep two builds instead of
    rebuilding each other's, and each forced level keeps its own."""
    isa = cpu_isa.detect() if isa is None else isa
    key = "\0".join((_SOURCE, *_cflags(isa), torch.__version__, platform.machine(), isa.level))
    return f"tailserve_cpu_attention_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_dir(isa: cpu_isa.CpuIsa | None = None) -> Path:
    return cache_root() / "kernels" / build_name(isa)


def failure(level: str | None = None) -> str | None:
    """Why the kernels of ``level`` (default: this process's) could not be built, or None."""
    return _failures.get(cpu_isa.detect().level if level is None else level)


def load() -> Any | None:
    """The compiled module for this process's CPU level (``cpu_isa.detect()``), or None (with
    the reason logged once) if it cannot be built. At amx_bf16 a compiler without AMX support
    (GCC before 11) gets the avx512_bf16 build instead, said in one line: every kernel but the
    AMX ones (linear, prefill attention); ``amx_failure`` keeps why."""
    if not enabled():
        return None
    isa = cpu_isa.detect()
    level = isa.level
    if level in _modules or level in _failures:
        return _modules.get(level)
    with _lock:
        if level not in _modules and level not in _failures:
            try:
                _modules[level] = _build(isa)
            except Exception as e:  # no compiler, no ninja, read-only cache: fall back
                _failures[level] = _reason(e)
                if level == "amx_bf16":
                    lower = cpu_isa.CpuIsa(isa.native, "avx512_bf16", isa.machine)
                    log.warning(
                        "CPU kernels for amx_bf16 unavailable (%s); building avx512_bf16's (no AMX kernels)",
                        _failures[level],
                    )
                    try:
                        _modules[level] = _build(lower)
                        _amx_failure.append(_failures.pop(level))
                        return _modules[level]
                    except Exception as e2:
                        _failures[level] = _reason(e2)
                log.warning("CPU kernels unavailable, using the PyTorch path (%s)", _failures[level])
    return _modules.get(level)


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def _build(isa: cpu_isa.CpuIsa) -> Any:
    from torch.utils.cpp_extension import load_inline

    name, directory = build_name(isa), build_dir(isa)
    if not (directory / f"{name}.so").is_file():
        # The first real run would otherwise sit silent for a minute.
        print(
            f"tailserve: building the fused CPU kernels for {isa.level}, ~1 min, once (into {directory})",
            file=sys.stderr,
            flush=True,
        )
    directory.mkdir(parents=True, exist_ok=True)
    return load_inline(
        name=name,
        cpp_sources=_SOURCE,
        functions=FUNCTIONS + NORM_FUNCTIONS,
        extra_cflags=_cflags(isa),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )


def decode_isa(module: Any | None = None) -> str | None:
    """The decode-attention kernel bf16 caches get: ``avx512_bf16`` (dot products with
    ``_mm512_dpbf16_ps``, built at levels avx512_bf16 and amx_bf16), ``avx2`` (AVX2 FMAs over rows widened
    to float32, at level avx2, float32 caches too), ``portable`` (float32 loops, every other
    level, and what ``TAILSERVE_DECODE_KERNEL=portable`` asks for), or None without the kernels.
    ``module``: a build of ``load()`` (default: this process's level)."""
    module = load() if module is None else module
    if module is None:
        return None
    if os.environ.get("TAILSERVE_DECODE_KERNEL", "auto") == "portable":
        return "portable"
    if module.decode_kernel_isa() == "avx512_bf16":
        return "avx512_bf16"
    if cpu_isa.detect().level == "avx2" and module.avx2_built():
        return "avx2"
    return "portable"


def decode_kernel_for(dtype: torch.dtype, module: Any | None = None) -> str | None:
    """The decode-attention kernel a cache of ``dtype`` gets (``decode_isa`` names bf16's): the
    dpbf16 kernel takes bf16 only, the AVX2 one bf16 and float32, the portable one the rest."""
    isa = decode_isa(module)
    if isa is None or dtype == torch.bfloat16:
        return isa
    return "avx2" if isa == "avx2" and dtype == torch.float32 else "portable"


def paged_decode_attention(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    module: Any | None = None,
) -> torch.Tensor | None:
    """[B, H, D] attention output in q's dtype, or None when the kernel is unavailable."""
    module = load() if module is None else module
    if module is None:
        return None
    return module.paged_decode_attention(
        q, k_slots, v_slots, slots, lengths, q.shape[-1] ** -0.5, decode_kernel_for(k_slots.dtype, module)
    )


def _own_linear() -> bool:
    """Whether tailserve's linear kernels may run: not with ``TAILSERVE_LINEAR_KERNEL=onednn`` (or
    ``torch``), which keeps PyTorch's matmul (oneDNN prepacked where the level packs, else
    ``F.linear``), nor with the kernels off."""
    return os.environ.get("TAILSERVE_LINEAR_KERNEL", "auto") not in ("onednn", "torch") and enabled()


def linear_kernel() -> Any | None:
    """The module whose ``linear_bf16`` runs tailserve's bf16 linear layers (``cpu_backend.PackedLinear``),
    or None: without the kernels (or with ``TAILSERVE_CPU_KERNEL=0``), on a CPU without
    avx512_bf16 (or at a lower ``TAILSERVE_CPU_ISA``), or when ``TAILSERVE_LINEAR_KERNEL=onednn``
    asks for oneDNN's prepacked matmul."""
    if not _own_linear():
        return None
    module = load()
    if module is None or module.decode_kernel_isa() != "avx512_bf16":
        return None
    return module


def linear_amx_kernel() -> Any | None:
    """The module whose ``linear_amx`` runs bf16 linear layers through AMX tiles (level
    amx_bf16: Sapphire Rapids and later, the OS granting the tile state), over the dpbf16
    packing; or None: at any lower level (``TAILSERVE_CPU_ISA=avx512_bf16`` runs the dpbf16
    kernel there), without the kernels, or with ``TAILSERVE_LINEAR_KERNEL=onednn``/``torch``."""
    if not _own_linear() or cpu_isa.detect().level != "amx_bf16":
        return None
    module = load()
    if module is None or not module.amx_built():
        return None
    return module


def linear_avx2_kernel() -> Any | None:
    """The module whose ``linear_avx2`` runs bf16 linear layers at level avx2 (bf16 weights
    widened to float32 in registers, FMA sums; ``cpu_backend.PackedLinear``), or None: at any
    other level (AVX-512 CPUs have their own paths; ``TAILSERVE_CPU_ISA=avx2`` runs this one
    there), without the kernels, or with ``TAILSERVE_LINEAR_KERNEL=torch`` (PyTorch's generic
    bf16 ``F.linear``)."""
    if not _own_linear() or cpu_isa.detect().level != "avx2":
        return None
    module = load()
    if module is None or not module.avx2_built():
        return None
    return module


_PREFILL_HEAD_DIMS = (32, 64, 96, 128, 256)  # what the C++ instantiates


def prefill_attention_applies(q: torch.Tensor, k_slots: torch.Tensor, module: Any | None = None) -> bool:
    """Whether ``paged_prefill_attention`` runs for these tensors (checked before its inputs are built)."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or k_slots.dtype != torch.bfloat16:
        return False
    if q.shape[-1] not in _PREFILL_HEAD_DIMS or q.shape[1] % k_slots.shape[1] != 0:
        return False
    return decode_isa(module) in ("avx512_bf16", "avx2")


def prefill_kernel_name(dtype: torch.dtype, module: Any | None = None, head_dim: int | None = None) -> str:
    """The header's name for what a ``dtype`` model's prefill chunks run: ``AMX kernel``,
    ``dpbf16 kernel``, ``avx2 kernel`` (bf16 at those levels) or ``SDPA`` (PyTorch's, per chunk).
    ``head_dim``: the model's (the AMX kernel takes 64, 128 and 256; unknown: assumed one)."""
    isa = decode_isa(module) if dtype == torch.bfloat16 else None
    if isa == "avx512_bf16" and (module or load()).prefill_amx_applies(head_dim or 64):
        return "AMX kernel"
    return {"avx512_bf16": "dpbf16 kernel", "avx2": "avx2 kernel"}.get(isa or "", "SDPA")


def paged_prefill_attention(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    news: torch.Tensor,
    contexts: torch.Tensor,
    module: Any | None = None,
) -> torch.Tensor | None:
    """Prefill chunks' attention through the tiled kernel of this level (AVX-512 bf16, or AVX2
    with float32 FMAs): chunk c's ``news[c]`` query rows start at row ``starts[c]`` of ``q`` and
    attend causally over ``slots[c]`` (its ``contexts[c]`` cached tokens, then its new ones, K/V
    already stored). [B, H, D] bf16, or None where the kernel does not apply (not bf16 on CPU,
    neither level, a head_dim it has no instance for), and the caller runs SDPA."""
    module = load() if module is None else module
    if not prefill_attention_applies(q, k_slots, module):
        return None
    return module.paged_prefill_attention(
        q, k_slots, v_slots, slots, starts, news, contexts, q.shape[-1] ** -0.5
    )


def fused_ops(dtype: torch.dtype, device: torch.device) -> Any | None:
    """The module whose ``rope_split`` replaces PyTorch's RoPE for a model in ``dtype`` on
    ``device``, or None.

    Only for bfloat16 and float16 on CPU, where it rounds to the model dtype where the PyTorch
    ops do (bit-identical); in float32 the compiler contracts its multiply-adds, so a result may
    differ in the last bit. float32 is the reference path that must equal
    ``transformers`` token for token, and stays on PyTorch's ops."""
    if not enabled() or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return load()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of logits [rows, vocab], float32 or the model's bf16/fp16: on CPU the fused
    kernel (~8x torch.argmax on one core here), same first-maximum rule; torch.argmax elsewhere.
    NaN rows are the caller's to clean (``argmax_rows_nan``)."""
    module = _argmax_module(logits)
    return _torch_logits(logits).argmax(dim=-1) if module is None else module.argmax_rows(logits)[0]


def argmax_rows_nan(logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``argmax_rows`` and whether any logit is NaN, from one pass over the logits where the
    kernel runs (a separate ``torch.isnan(logits).any()`` took ~0.4 ms for 64 x 12,288)."""
    module = _argmax_module(logits)
    if module is None:
        logits = _torch_logits(logits)
        return logits.argmax(dim=-1), bool(torch.isnan(logits).any())
    tokens, has_nan = module.argmax_rows(logits)
    return tokens, bool(has_nan)


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _argmax_module(logits: torch.Tensor) -> Any | None:
    cpu = logits.device.type == "cpu" and logits.dtype in _ARGMAX_DTYPES
    return load() if cpu and enabled() else None


def _torch_logits(logits: torch.Tensor) -> torch.Tensor:
    """What torch's argmax reads: on CPU reduced-precision logits widened first (the widening is
    exact, and PyTorch's bf16 argmax took ~1 ms for 64 x 8,192, its float32 one ~0.2-0.4)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        return logits.float()
    return logits


def store_kv(
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    module: Any | None = None,
) -> bool:
    """Write the new tokens' K and V rows to their slots of a CPU cache, as
    ``k_slots.index_copy_(0, slot_mapping, k)`` and the same for V do (an exact copy, any
    dtype); False where the kernels are not loaded, and the caller uses ``index_copy_``."""
    if k_slots.device.type != "cpu" or not enabled():
        return False
    module = load() if module is None else module
    if module is None:
        return False
    module.store_kv(k_slots, v_slots, k, v, slot_mapping)
    return True
