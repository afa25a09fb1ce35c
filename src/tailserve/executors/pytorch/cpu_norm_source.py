"""The C++ of the exact RMSNorm, residual-add + RMSNorm and SiLU-mul kernels (built with
``cpu_kernel_source.SOURCE`` into one extension by ``cpu_kernels.py``; guarded by ``cpu_norm.py``).

Each kernel gives the same bits as the PyTorch ops it replaces, not merely close ones: a fused
RMSNorm that summed the squares in its own order moved rare bf16 values one step, and greedy
bf16 tokens then left ``transformers``' earlier (docs/executor.md). So the kernels reproduce
ATen's own arithmetic:

- The sum of squares in the order of ATen's CPU ``sum`` over a contiguous last dim
  (``SumKernel.cpp``: ``vectorized_inner_sum`` -> ``row_sum`` with 4 interleaved accumulators
  -> ``multi_row_sum``'s 4-level cascade, over vectors of 8 floats even on AVX512 machines;
  then the scalar tail, then the lanes in order), divided by the
  width (``mean`` is ``sum`` then ``div_``), ``+ eps``, ``1 / sqrt`` (``Vectorized::rsqrt``),
  the product rounded to the model dtype, then the weight product rounded once.
- SiLU as ATen's reduced-float kernel: ``x / (1 + exp(-x))`` in float32 with
  ``Sleef_expf16_u10`` (``Vectorized<float>::exp``, exported by libtorch) on the elements its
  vectorised loop covers and ``expf`` on the rest, which depend on where ``TensorIterator``
  cuts the rows into per-thread ranges (``silu_chunk``).

Everything here is compiled without ``-ffast-math`` or FMA contraction (the pragma below): the
extension's other kernels keep those flags.
"""

from __future__ import annotations

NORM_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // x86 only: aarch64 builds take the scalar paths
#endif
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off", "no-math-errno")

extern "C" {
#if defined(__AVX512F__)
__m512 Sleef_expf16_u10(__m512);
#endif
#if defined(__AVX2__)
__m256 Sleef_expf8_u10(__m256);
#endif
}

namespace tsnorm {

template <typename T> struct Cvt;
template <> struct Cvt<at::BFloat16> {
  static inline float to(at::BFloat16 x) {
    const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  // Round to nearest even, as c10::BFloat16 and ATen's vector conversion do.
  static inline at::BFloat16 from(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    at::BFloat16 out;
    out.x = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return out;
  }
};
template <> struct Cvt<at::Half> {
  static inline float to(at::Half x) { return static_cast<float>(x); }
  static inline at::Half from(float f) { return at::Half(f); }
};
template <typename T> static inline float rnd(float f) { return Cvt<T>::to(Cvt<T>::from(f)); }

static inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<unsigned long long>(x - 1));
}

// sum(s[0..C)) in ATen's order for a contiguous float32 row (see the module docstring).
template <int W>
static float aten_row_sum(const float* __restrict s, int64_t C) {
  const int64_t nvec = C / W, nrow = nvec / 4;
  float acc[4][4][W];  // [cascade level][interleaved accumulator][lane]
  std::memset(acc, 0, sizeof(acc));
  const int64_t power = std::max<int64_t>(4, ceil_log2(nrow) / 4);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  int64_t i = 0;
  while (i + step <= nrow) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc[0][k][l] += s[(i * 4 + k) * W + l];
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.0f; }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < nrow; ++i)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += s[(i * 4 + k) * W + l];
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = nrow * 4; v < nvec; ++v)  // row_sum's leftover vectors
    for (int l = 0; l < W; ++l) acc[0][0][l] += s[v * W + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.0f;
  for (int64_t c = nvec * W; c < C; ++c) total += s[c];
  for (int l = 0; l < W; ++l) total += acc[0][0][l];
  return total;
}

// y = w * T(x * rsqrt(mean(x^2) + eps)) for one row already in float32 (xf); sq is scratch.
template <typename T, int W>
static void norm_row(const float* __restrict xf, const T* __restrict w, T* __restrict y,
                     float* __restrict sq, int64_t C, float eps) {
  for (int64_t c = 0; c < C; ++c) sq[c] = xf[c] * xf[c];
  const float mean = aten_row_sum<W>(sq, C) / static_cast<float>(C);
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t c = 0; c < C; ++c) y[c] = Cvt<T>::from(Cvt<T>::to(w[c]) * rnd<T>(xf[c] * r));
}

// Vectorized<float>::size() in the kernel ATen's sum runs. 8 on an AVX512 machine too: the sum
// kernel's note says its AVX512 build is slower than AVX2's, which is what runs (measured: a
// 16-lane order matches torch.sum on about half the rows, the 8-lane order on all of them).
constexpr int kSumLanes = 8;

static int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// residual (or nullptr) + x rounded to T into sum (when given), then the norm into y.
template <typename T, int W>
static void norm_rows(const T* residual, const T* x, const T* w, T* sum, T* y, int64_t N, int64_t C, float eps) {
  at::parallel_for(0, N, grain(C), [&](int64_t b, int64_t e) {
    std::vector<float> xf(C), sq(C);
    for (int64_t i = b; i < e; ++i) {
      const T* xi = x + i * C;
      if (residual != nullptr) {
        const T* ri = residual + i * C;
        T* si = sum + i * C;
        for (int64_t c = 0; c < C; ++c) {
          si[c] = Cvt<T>::from(Cvt<T>::to(ri[c]) + Cvt<T>::to(xi[c]));
          xf[c] = Cvt<T>::to(si[c]);
        }
      } else {
        for (int64_t c = 0; c < C; ++c) xf[c] = Cvt<T>::to(xi[c]);
      }
      norm_row<T, W>(xf.data(), w, y + i * C, sq.data(), C, eps);
    }
  });
}

static void check_norm(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), what, ": x must be a contiguous [N, C] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, what, ": bfloat16 or float16 only");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1), what, ": weight [C] in x's dtype");
}

// ---- SiLU ------------------------------------------------------------------------------------
// Which elements ATen's silu computes with the vector exp: TensorIterator runs [N, I] (the gate
// view, rows 2I apart) row by row, except that with more than one thread and at least
// GRAIN_SIZE elements at::parallel_for cuts the flat range into equal chunks, which may start
// mid-row; each row piece runs vectorized_loop, which takes 2 * Vectorized<T>::size() (=
// vec_step) elements per step and leaves the remainder to the scalar op. silu_chunk is that
// cut (numel: no cut); a row's pieces end at the multiples of it.
static int64_t silu_chunk(int64_t N, int64_t I) {
  constexpr int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE
  const int64_t numel = N * I, threads = at::get_num_threads();
  if (numel < kGrain || threads == 1 || at::in_parallel_region()) return std::max<int64_t>(numel, 1);
  const int64_t tasks = std::min<int64_t>(threads, (numel + kGrain - 1) / kGrain);
  return (numel + tasks - 1) / tasks;
}

// e[c] = exp(-g[c]) for c in [b, e) the way Vectorized<float>::exp does it (exp_kind 2: Sleef
// 16 lanes, 1: Sleef 8 lanes, 0: std::exp, as the DEFAULT capability's map does).
static void vector_exp_neg(const float* g, float* out, int64_t n, int64_t exp_kind) {
  int64_t c = 0;
#if defined(__AVX512F__)
  if (exp_kind == 2) {
    for (; c + 16 <= n; c += 16) {
      __m512 v = _mm512_xor_ps(_mm512_set1_ps(-0.0f), _mm512_loadu_ps(g + c));
      _mm512_storeu_ps(out + c, Sleef_expf16_u10(v));
    }
  }
#endif
#if defined(__AVX2__)
  if (exp_kind == 1) {
    for (; c + 8 <= n; c += 8) {
      __m256 v = _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(g + c));
      _mm256_storeu_ps(out + c, Sleef_expf8_u10(v));
    }
  }
#endif
  for (; c < n; ++c) out[c] = std::exp(-g[c]);
}

template <typename T>
static void silu_mul_rows(const T* x, T* y, int64_t N, int64_t I, int64_t vec_step, int64_t exp_kind) {
  const int64_t chunk = silu_chunk(N, I);
  at::parallel_for(0, N, grain(2 * I), [&](int64_t b, int64_t e) {
    std::vector<float> g(I), ex(I);
    for (int64_t r = b; r < e; ++r) {
      const T* gate = x + r * 2 * I;
      const T* up = gate + I;
      T* o = y + r * I;
      for (int64_t c = 0; c < I; ++c) g[c] = Cvt<T>::to(gate[c]);
      for (int64_t a = r * I, row_end = a + I; a < row_end;) {  // each piece: vector part, then scalar
        const int64_t piece_end = std::min(row_end, (a / chunk + 1) * chunk);
        const int64_t c0 = a - r * I, vec = (piece_end - a) / vec_step * vec_step;
        vector_exp_neg(g.data() + c0, ex.data() + c0, vec, exp_kind);
        for (int64_t c = c0 + vec; c < piece_end - r * I; ++c) ex[c] = std::exp(-g[c]);
        a = piece_end;
      }
      for (int64_t c = 0; c < I; ++c) {
        const float s = rnd<T>(g[c] / (1.0f + ex[c]));
        o[c] = Cvt<T>::from(s * Cvt<T>::to(up[c]));
      }
    }
  });
}

}  // namespace tsnorm

// Exactly ``model.rms_norm(x, w, eps)`` for bf16/fp16 x [N, C].
torch::Tensor rms_norm_exact(torch::Tensor x, torch::Tensor w, double eps) {
  tsnorm::check_norm(x, w, "rms_norm_exact");
  auto y = torch::empty_like(x);
  const int64_t N = x.size(0), C = x.size(1);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "rms_norm_exact", [&] {
    tsnorm::norm_rows<scalar_t, tsnorm::kSumLanes>(nullptr, x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), nullptr,
                                    y.data_ptr<scalar_t>(), N, C, static_cast<float>(eps));
  });
  return y;
}

// [residual + x, rms_norm(residual + x)]: vLLM's fused_add_rms_norm, with PyTorch's roundings.
std::vector<torch::Tensor> add_rms_norm_exact(torch::Tensor residual, torch::Tensor x, torch::Tensor w, double eps) {
  tsnorm::check_norm(x, w, "add_rms_norm_exact");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm_exact: residual must match x");
  auto sum = torch::empty_like(x);
  auto y = torch::empty_like(x);
  const int64_t N = x.size(0), C = x.size(1);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "add_rms_norm_exact", [&] {
    tsnorm::norm_rows<scalar_t, tsnorm::kSumLanes>(residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                    sum.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), N, C, static_cast<float>(eps));
  });
  return {sum, y};
}

// gate_up [N, 2I] (gate | up) -> silu(gate) * up [N, I], as F.silu then the product in T.
torch::Tensor silu_and_mul_exact(torch::Tensor x, int64_t vec_step, int64_t exp_kind) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul_exact: x must be a contiguous [N, 2I] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "silu_and_mul_exact: bfloat16 or float16 only");
  TORCH_CHECK(vec_step > 0 && exp_kind >= 0 && exp_kind <= 2, "silu_and_mul_exact: bad vec_step or exp_kind");
#if !defined(__AVX512F__)
  TORCH_CHECK(exp_kind != 2, "silu_and_mul_exact: built without AVX-512");
#endif
#if !defined(__AVX2__)
  TORCH_CHECK(exp_kind != 1, "silu_and_mul_exact: built without AVX2");
#endif
  const int64_t N = x.size(0), I = x.size(1) / 2;
  auto y = torch::empty({N, I}, x.options());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "silu_and_mul_exact", [&] {
    tsnorm::silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), N, I, vec_step, exp_kind);
  });
  return y;
}

#pragma GCC pop_options
"""

NORM_FUNCTIONS = ["rms_norm_exact", "add_rms_norm_exact", "silu_and_mul_exact"]
