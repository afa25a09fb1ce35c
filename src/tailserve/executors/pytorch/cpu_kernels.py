"""A fused paged-attention kernel for one-token queries on CPU, compiled on first use.

Plain PyTorch has to gather every decode's context out of the paged cache into a padded tensor,
convert it and run small batched matmuls — ~10x the bytes and kernel launches the arithmetic
needs (see docs/executor.md). This kernel reads each request's K/V rows straight from their
slots, one (request, KV head) pair per task, with a float32 online softmax — what vLLM's CPU
paged-attention kernel does, in ~60 lines. It is built once with ``torch.utils.cpp_extension``
(g++ and ninja) into tailserve's cache (``kernels/`` under ``$TAILSERVE_CACHE`` or
``~/.cache/tailserve``), keyed by source, flags, torch version and CPU, and says so in one line
while it builds; where that is impossible, or with
``TAILSERVE_CPU_KERNEL=0``, the executor uses the PyTorch path, and tests check both agree.
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

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>
#include <vector>

#include <cstring>

// Row of D values as float32. bf16 is the top half of a float32: a shift the compiler vectorises
// (c10::BFloat16's own conversion goes through a union it does not).
template <typename T>
static inline void load_row(const T* __restrict src, float* __restrict dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}
template <>
inline void load_row<at::BFloat16>(const at::BFloat16* __restrict src, float* __restrict dst, int64_t D) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(raw[d]) << 16;
}

// q: [B, H, D] float32; k, v: [S, KV, D] (float32, bfloat16 or float16); slots: [B, L] int64,
// lengths: [B] int64 (each >= 1). Returns [B, H, D] float32. HD (the head size) is a template
// parameter so every inner loop has a fixed trip count and vectorises.
template <typename T, int HD>
static void decode_impl(const float* q, const T* k, const T* v, const int64_t* slots,
                        const int64_t* lengths, float* out, int64_t B, int64_t H, int64_t KV,
                        int64_t L, float scale) {
  const int64_t G = H / KV;
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> accv(G * HD);
    alignas(64) float row[HD];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, h = task % KV, n = lengths[b];
      const float* __restrict qh = q + (b * H + h * G) * HD;
      const int64_t* __restrict sl = slots + b * L;
      scores.resize(G * n);
      float* __restrict sc = scores.data();
      for (int64_t l = 0; l < n; ++l) {
        load_row<T>(k + (sl[l] * KV + h) * HD, row, HD);
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict qg = qh + g * HD;
          float s = 0.0f;
          for (int d = 0; d < HD; ++d) s += qg[d] * row[d];
          sc[g * n + l] = s * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* __restrict sg = sc + g * n;
        float mx = sg[0];
        for (int64_t l = 1; l < n; ++l) mx = sg[l] > mx ? sg[l] : mx;
        float sum = 0.0f;
        for (int64_t l = 0; l < n; ++l) { sg[l] = std::exp(sg[l] - mx); sum += sg[l]; }
        const float inv = 1.0f / sum;
        for (int64_t l = 0; l < n; ++l) sg[l] *= inv;
      }
      float* __restrict acc = accv.data();
      std::fill(acc, acc + G * HD, 0.0f);
      for (int64_t l = 0; l < n; ++l) {
        load_row<T>(v + (sl[l] * KV + h) * HD, row, HD);
        for (int64_t g = 0; g < G; ++g) {
          const float w = sc[g * n + l];
          float* __restrict ag = acc + g * HD;
          for (int d = 0; d < HD; ++d) ag[d] += w * row[d];
        }
      }
      std::memcpy(out + (b * H + h * G) * HD, acc, sizeof(float) * G * HD);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                     torch::Tensor slots, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-D");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous");
  auto qf = q.to(torch::kFloat).contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  auto ln = lengths.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), L = sl.size(1);
  TORCH_CHECK(H % KV == 0, "heads must be a multiple of KV heads");
  auto out = torch::empty({B, H, D}, qf.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto hd) {
      decode_impl<scalar_t, decltype(hd)::value>(
          qf.data_ptr<float>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), sl.data_ptr<int64_t>(),
          ln.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KV, L, static_cast<float>(scale));
    };
    switch (D) {
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      case 16: run(std::integral_constant<int, 16>{}); break;
      case 32: run(std::integral_constant<int, 32>{}); break;
      case 80: run(std::integral_constant<int, 80>{}); break;
      case 96: run(std::integral_constant<int, 96>{}); break;
      case 256: run(std::integral_constant<int, 256>{}); break;
      default: TORCH_CHECK(false, "head_dim ", D, " is not supported by the fused kernel");
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


def enabled() -> bool:
    return os.environ.get("TAILSERVE_CPU_KERNEL", "1") != "0"


_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def build_name() -> str:
    """The extension's name, keyed by what the binary depends on: the source and flags, the
    torch it links against and the CPU architecture. Two virtual environments with different
    torch builds therefore keep two builds instead of rebuilding each other's."""
    key = "\0".join((_SOURCE, *_CFLAGS, torch.__version__, platform.machine()))
    return f"tailserve_cpu_attention_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_dir() -> Path:
    return cache_root() / "kernels" / build_name()


def load() -> Any | None:
    """The compiled module, or None (with the reason logged once) if it cannot be built."""
    global _module, _failed
    if _module is not None or _failed is not None or not enabled():
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load_inline

                name, directory = build_name(), build_dir()
                if not (directory / f"{name}.so").is_file():
                    # The first real run would otherwise sit silent for a minute.
                    print(
                        f"tailserve: building the fused CPU attention kernel, ~1 min, once (into {directory})",
                        file=sys.stderr,
                        flush=True,
                    )
                directory.mkdir(parents=True, exist_ok=True)
                _module = load_inline(
                    name=name,
                    cpp_sources=_SOURCE,
                    functions=["paged_decode_attention"],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    verbose=False,
                )
            except Exception as e:  # no compiler, no ninja, read-only cache: fall back
                _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                log.warning("CPU attention kernel unavailable, using the PyTorch path (%s)", _failed)
    return _module


def paged_decode_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor | None:
    """[B, H, D] attention output in q's dtype, or None when the kernel is unavailable."""
    module = load()
    if module is None:
        return None
    out = module.paged_decode_attention(q, k_slots, v_slots, slots, lengths, q.shape[-1] ** -0.5)
    return out.to(q.dtype)
