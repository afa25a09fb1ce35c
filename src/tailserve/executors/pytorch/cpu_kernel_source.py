"""The C++ of tailserve's CPU kernels (built by ``cpu_kernels.py``), kept apart from the Python
that builds and calls them.

- ``paged_decode_attention``: one-token queries over paged K/V, float32 softmax. Where the
  compiler targets avx512_bf16 and the cache is bf16 (``decode_bf16_impl``): one task per
  request, 16 keys' whole slot rows at a time, the scores with ``_mm512_dpbf16_ps``; at level
  avx2 the same shape with AVX2 FMAs, bf16 or float32 caches (``decode_avx2_impl``); elsewhere
  float32 loops, one task per (request, KV head) (``decode_impl``).
- ``linear_bf16``: the bf16 linear layers, over weights packed once for ``_mm512_dpbf16_ps``
  (the avx512_bf16 and amx_bf16 builds; ``cpu_backend.PackedLinear``); ``linear_amx``: the same
  packing through AMX tiles (level amx_bf16: Sapphire Rapids and later).
- ``linear_avx2`` and the AVX2 decode attention (``decode_avx2_impl``): for CPUs with AVX2 and FMA
  but no AVX-512 (level avx2): bf16 weights and K/V widened to float32 in registers, FMA sums.
- ``store_kv``: the new tokens' K and V rows into their cache slots (two ``index_copy_`` calls
  took ~65 us each for a decode batch of 64 rows).
- ``decode_slots``: a decode batch's slots and mask from its block tables in one pass
  (``attention.build_metadata``).
- ``paged_prefill_attention``: the prefill chunks' tokens, tiled as a GEMM kernel is (8 query
  rows x 16 keys per step over keys packed once per chunk and KV head), float32 softmax, P
  rounded to bf16 for P.V as PyTorch's CPU flash attention does (``prefill_bf16_impl``;
  avx512_bf16); at level avx2 6 query rows x 16 keys of float32 FMAs over keys widened once,
  float32 P (``prefill_avx2_impl``); at level amx_bf16 (head_dim 64, 128, 256) the same packing
  through AMX tiles, 16 query rows x 16 keys a score tile (``prefill_amx_impl``).
- ``rope_split`` (q, k, v out of the fused qkv projection, RoPE applied to q and k) and
  ``argmax_rows`` (greedy tokens, and whether any logit is NaN, in one pass). Each rounds to the model dtype exactly where the PyTorch ops
  it replaces round (``cpu_kernels.py`` says where results can differ in the last bit), so
  bf16 outputs match the unfused path.
"""

from __future__ import annotations

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

// Element conversions. bf16 is the top half of a float32: a shift the compiler vectorises
// (c10::BFloat16's own conversion goes through a union it does not); the way back rounds to
// nearest even, as c10 does.
template <typename T> static inline float to_f(T x) { return static_cast<float>(x); }
template <> inline float to_f<at::BFloat16>(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T> static inline T from_f(float f) { return static_cast<T>(f); }
template <> inline at::BFloat16 from_f<at::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  at::BFloat16 out;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out.x = 0x7fc0;
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    out.x = static_cast<uint16_t>(u >> 16);
  }
  return out;
}
// A value as the model dtype would hold it (the rounding a PyTorch op in that dtype applies).
// Float32 softmax of one row of scores in place (max-subtracted), shared by both decode kernels.
static inline void softmax_inplace(float* __restrict sg, int64_t n) {
  float mx = sg[0];
  for (int64_t l = 1; l < n; ++l) mx = sg[l] > mx ? sg[l] : mx;
  float sum = 0.0f;
  for (int64_t l = 0; l < n; ++l) { sg[l] = std::exp(sg[l] - mx); sum += sg[l]; }
  const float inv = 1.0f / sum;
  for (int64_t l = 0; l < n; ++l) sg[l] *= inv;
}

template <typename T> static inline float round_to(float f) { return to_f<T>(from_f<T>(f)); }

template <typename T>
static inline void load_row(const T* __restrict src, float* __restrict dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = to_f<T>(src[d]);
}

// ---- decode attention ------------------------------------------------------------------------
// q: [B, H, D] float32; k, v: [S, KV, D]; slots: [B, L] int64; lengths: [B] (each >= 1).
// One task per (request, KV head): its G query heads share each K/V row it loads.
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
      for (int64_t g = 0; g < G; ++g) softmax_inplace(sc + g * n, n);
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

// ---- decode attention, AVX-512 bf16 --------------------------------------------------------
// bf16 K/V and q where the CPU has avx512_bf16 (_mm512_dpbf16_ps: 32 bf16 products summed in
// pairs into 16 float32 lanes). One task per request, 16 keys at a time: the 16 keys' slot rows
// (every KV head, KV * HD * 2 contiguous bytes each; a block's 16 slots are adjacent) come in
// once, then each KV head in turn takes its row of each from L1, the G query heads of its GQA
// group sharing every row it loads. Scores are taken 16 keys at a time, and the 16 partial-sum
// vectors of a block are reduced together (sum16) instead of one horizontal sum per score.
// Softmax and the V accumulation stay float32 (V rows widened exactly from bf16); the output is
// rounded once to bf16. Every score and sum is formed in the same order as by the earlier one
// task per (request, KV head) kernel, so the output is the same, bit for bit.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TAILSERVE_HAVE_DPBF16 1

// r[i] = sum of v[i]'s 16 lanes, for 16 vectors at once (45 shuffles and adds, not 16 x 8).
static inline __m512 sum16(__m512* v) {
  __m512 w[8], x[4];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    __m512d c = _mm512_castps_pd(w[2 * k]), d = _mm512_castps_pd(w[2 * k + 1]);
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// Prefetching for the decode kernel's K and V passes: while one block of 16 keys is computed,
// the next 16 keys' whole slot rows are pulled into L2, and the last block of a pass pulls the
// first block of the next (K -> V of the request, V -> K of the task's next request), so no
// pass starts on a cold block. At 2 threads (batch 64, context 288, a cache per layer, 12
// layers): 20.0 GB/s of K/V, against 17.6 for the earlier per-(request, KV head) tasks with
// their own prefetching, 18.9 without the cross-pass prefetch, 14.2 with none (the hardware
// prefetcher alone), 12.2 into L1 (it evicts the block in use), 18.7 two blocks ahead; a loop
// that only loads the same rows reaches 23-25 GB/s.
static inline void prefetch_block(const at::BFloat16* cache, const int64_t* sl, int64_t from, int64_t n,
                                  int64_t row_elems) {
  for (int64_t i = from; i < from + 16 && i < n; ++i) {  // one block of 16 keys
    const char* p = reinterpret_cast<const char*>(cache + sl[i] * row_elems);
    for (int64_t c = 0; c < row_elems * 2; c += 64) _mm_prefetch(p + c, _MM_HINT_T1);
  }
}
static inline __m512 widen_bf16(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

template <int HD, int G>
static void decode_bf16_impl(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                             const int64_t* slots, const int64_t* lengths,
                             at::BFloat16* out, int64_t B, int64_t H, int64_t KV, int64_t L, float scale) {
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int NQ = HD / 32;  // bf16 vectors per row
  constexpr int NF = HD / 16;  // float32 vectors per row
  const int64_t row_elems = KV * HD;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> accbuf;
    alignas(64) __m512 part[G][16];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lengths[b];
      const int64_t* __restrict sl = slots + b * L;
      const int64_t stride = ((n + 15) / 16) * 16;  // keys rounded up to whole blocks of 16
      scores.resize(H * stride);
      float* __restrict sc = scores.data();
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t l0 = 0; l0 < n; l0 += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, n - l0));
        if (l0 + 16 < n) prefetch_block(k, sl, l0 + 16, n, row_elems);
        else prefetch_block(v, sl, 0, n, row_elems);
        for (int64_t h = 0; h < KV; ++h) {
          __m512bh qv[G][NQ];
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < NQ; ++j)
              qv[g][j] = (__m512bh)_mm512_loadu_si512(q + (b * H + h * G + g) * HD + 32 * j);
          for (int i = 0; i < m; ++i) {
            const at::BFloat16* row = k + sl[l0 + i] * row_elems + h * HD;
            __m512bh kr[NQ];
            for (int j = 0; j < NQ; ++j) kr[j] = (__m512bh)_mm512_loadu_si512(row + 32 * j);
            for (int g = 0; g < G; ++g) {
              __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kr[0]);
              for (int j = 1; j < NQ; ++j) a = _mm512_dpbf16_ps(a, qv[g][j], kr[j]);
              part[g][i] = a;
            }
          }
          for (int g = 0; g < G; ++g) {
            for (int i = m; i < 16; ++i) part[g][i] = _mm512_setzero_ps();
            _mm512_storeu_ps(sc + (h * G + g) * stride + l0, _mm512_mul_ps(sum16(part[g]), vscale));
          }
        }
      }
      for (int64_t r = 0; r < H; ++r) softmax_inplace(sc + r * stride, n);
      accbuf.assign(H * HD, 0.0f);
      float* __restrict ab = accbuf.data();
      for (int64_t l0 = 0; l0 < n; l0 += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, n - l0));
        if (l0 + 16 < n) prefetch_block(v, sl, l0 + 16, n, row_elems);
        else if (b + 1 < end) prefetch_block(k, slots + (b + 1) * L, 0, lengths[b + 1], row_elems);
        for (int64_t h = 0; h < KV; ++h) {
          __m512 acc[G][NF];  // this head group's sums, kept in ab between blocks
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < NF; ++j) acc[g][j] = _mm512_loadu_ps(ab + (h * G + g) * HD + 16 * j);
          for (int i = 0; i < m; ++i) {
            const at::BFloat16* row = v + sl[l0 + i] * row_elems + h * HD;
            __m512 vr[NF];
            for (int j = 0; j < NF; ++j) vr[j] = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j)));
            for (int g = 0; g < G; ++g) {
              const __m512 w = _mm512_set1_ps(sc[(h * G + g) * stride + l0 + i]);
              for (int j = 0; j < NF; ++j) acc[g][j] = _mm512_fmadd_ps(w, vr[j], acc[g][j]);
            }
          }
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < NF; ++j) _mm512_storeu_ps(ab + (h * G + g) * HD + 16 * j, acc[g][j]);
        }
      }
      at::BFloat16* o = out + b * H * HD;
      for (int64_t i = 0; i < H * HD; ++i) o[i] = from_f<at::BFloat16>(ab[i]);
    }
  });
}

// The bf16 kernel for this head_dim and group size, or false (the caller uses decode_impl).
static bool decode_bf16(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                        const int64_t* slots, const int64_t* lengths, at::BFloat16* out,
                        int64_t B, int64_t H, int64_t KV, int64_t D, int64_t L, float scale) {
  const int64_t G = H / KV;
#define TS_CASE(HDV, GV) \
  if (D == HDV && G == GV) { decode_bf16_impl<HDV, GV>(q, k, v, slots, lengths, out, B, H, KV, L, scale); return true; }
#define TS_GROUPS(HDV) TS_CASE(HDV, 1) TS_CASE(HDV, 2) TS_CASE(HDV, 3) TS_CASE(HDV, 4) TS_CASE(HDV, 5) \
  TS_CASE(HDV, 6) TS_CASE(HDV, 7) TS_CASE(HDV, 8)
  TS_GROUPS(64) TS_GROUPS(128) TS_GROUPS(32) TS_GROUPS(96) TS_GROUPS(256)
#undef TS_GROUPS
#undef TS_CASE
  return false;
}

// ---- prefill attention, AVX-512 bf16, tiled ------------------------------------------------
// The tokens of prefill chunks, each attending causally to its chunk's cached context and to
// the chunk's own earlier tokens. One task per (chunk, KV head): the task packs its keys once
// into dpbf16's pair layout (16 keys x 2 dims per vector) and its values in pairs of keys,
// then takes its query rows (every token x the G heads of the group) 8 at a time: scores 8
// rows x 16 keys per inner step (a broadcast q pair times a packed K vector, 32 products per
// instruction, as a GEMM kernel does), the causal mask, a float32 softmax per row, then P.V
// with P rounded to bf16 and float32 sums — as PyTorch's own CPU flash attention does for bf16
// (its second GEMM reads ``qk_reduced``), which transformers runs. The per-row decode kernel
// above does one query row against one key row per dot product and reduces 16 lanes per
// score; on prefill chunks this kernel takes 2-3x less CPU (benchmarks/engine_attention.py).
// A task's keys and values for the tiled prefill kernels (dpbf16 and AMX): keys in blocks of 16
// as [HD / 2 pairs][16 keys] (dpbf16's pair layout; an AMX B tile), values in pairs of keys as
// [pairs][HD] words (key 2i's dim in the low half, 2i + 1's in the high). The buffers are
// zeroed by the caller past nk.
template <int HD>
static inline void pack_kv(const at::BFloat16* k, const at::BFloat16* v, const int64_t* __restrict sl,
                           int64_t nk, int64_t KV, int64_t h, uint32_t* kpack, uint32_t* vpack) {
  constexpr int NP = HD / 2;
  for (int64_t j = 0; j < nk; ++j) {
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(k + (sl[j] * KV + h) * HD);
    uint32_t* dst = kpack + (j / 16) * NP * 16 + (j % 16);
    for (int p = 0; p < NP; ++p) dst[p * 16] = kw[p];
    const uint16_t* vr = reinterpret_cast<const uint16_t*>(v + (sl[j] * KV + h) * HD);
    uint16_t* vd = reinterpret_cast<uint16_t*>(vpack + (j / 2) * HD) + (j % 2);
    for (int d = 0; d < HD; ++d) vd[2 * d] = vr[d];
  }
}

template <int HD>
static void prefill_bf16_impl(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                              const int64_t* slots, const int64_t* starts, const int64_t* news,
                              const int64_t* ctxs, at::BFloat16* out, int64_t R, int64_t H, int64_t KV,
                              int64_t L, float scale) {
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int NP = HD / 2;   // bf16 pairs (32-bit words) per row
  constexpr int NF = HD / 16;  // float32 vectors per row
  constexpr int QR = 8;        // query rows per score tile
  constexpr int VR = NF >= 16 ? 1 : (16 / NF < QR ? 16 / NF : QR);  // rows per P.V pass
  const int64_t G = H / KV;
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kpack;
    std::vector<uint32_t> vpack;
    std::vector<float> sc;
    std::vector<uint16_t> pb;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / KV, h = task % KV;
      const int64_t n_new = news[c], ctx = ctxs[c], nk = ctx + n_new, first = starts[c];
      if (n_new == 0) continue;
      const int64_t* __restrict sl = slots + c * L;
      const int64_t nblk = (nk + 15) / 16, stride = nblk * 16;
      kpack.assign(nblk * NP * 16, 0u);
      const int64_t npair = (nk + 1) / 2;
      vpack.assign(npair * HD, 0u);
      pack_kv<HD>(k, v, sl, nk, KV, h, kpack.data(), vpack.data());
      sc.resize(QR * stride);
      pb.resize(QR * stride);
      const int64_t nrows = n_new * G;  // row r: token r / G, head h * G + r % G
      for (int64_t r0 = 0; r0 < nrows; r0 += QR) {
        const int m = static_cast<int>(std::min<int64_t>(QR, nrows - r0));
        const uint32_t* qw[QR];
        int64_t len[QR];
        int64_t maxlen = 0;
        for (int i = 0; i < QR; ++i) {
          const int64_t r = r0 + std::min(i, m - 1);
          const int64_t t = r / G, g = r % G;
          qw[i] = reinterpret_cast<const uint32_t*>(q + ((first + t) * H + h * G + g) * HD);
          len[i] = ctx + t + 1;
          maxlen = std::max(maxlen, len[i]);
        }
        const int64_t kb_end = (maxlen + 15) / 16;
        for (int64_t kb = 0; kb < kb_end; ++kb) {
          __m512 acc[QR];
          for (int i = 0; i < QR; ++i) acc[i] = _mm512_setzero_ps();
          const uint32_t* kp = kpack.data() + kb * NP * 16;
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(kp + p * 16);
#pragma GCC unroll 8
            for (int i = 0; i < QR; ++i)
              acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[i][p])), kv);
          }
          for (int i = 0; i < QR; ++i) _mm512_storeu_ps(sc.data() + i * stride + kb * 16, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
        }
        const int64_t pend = (maxlen + 1) / 2 * 2;
        for (int i = 0; i < m; ++i) {
          float* row = sc.data() + i * stride;
          softmax_inplace(row, len[i]);
          uint16_t* prow = pb.data() + i * stride;
          for (int64_t j = 0; j < len[i]; ++j) prow[j] = from_f<at::BFloat16>(row[j]).x;
          for (int64_t j = len[i]; j < pend; ++j) prow[j] = 0;
        }
        for (int i0 = 0; i0 < m; i0 += VR) {
          const int mv = std::min(VR, m - i0);
          const uint32_t* pr[VR];
          for (int i = 0; i < VR; ++i) pr[i] = reinterpret_cast<const uint32_t*>(pb.data() + (i0 + std::min(i, mv - 1)) * stride);
          __m512 acc[VR][NF];
#pragma GCC unroll 16
          for (int i = 0; i < VR; ++i)
#pragma GCC unroll 16
            for (int f = 0; f < NF; ++f) acc[i][f] = _mm512_setzero_ps();
          const uint32_t* vd = vpack.data();
          for (int64_t jp = 0; jp < pend / 2; ++jp, vd += HD) {
            __m512bh vr[NF];
#pragma GCC unroll 16
            for (int f = 0; f < NF; ++f) vr[f] = (__m512bh)_mm512_loadu_si512(vd + 16 * f);
#pragma GCC unroll 16
            for (int i = 0; i < VR; ++i) {
              const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[i][jp]));
#pragma GCC unroll 16
              for (int f = 0; f < NF; ++f) acc[i][f] = _mm512_dpbf16_ps(acc[i][f], w, vr[f]);
            }
          }
          // Stored through a fixed-size buffer: a runtime row index into ``acc`` would keep the
          // accumulators in memory (GCC spilled them every key).
          alignas(64) float tmp[VR][HD];
#pragma GCC unroll 16
          for (int i = 0; i < VR; ++i)
#pragma GCC unroll 16
            for (int f = 0; f < NF; ++f) _mm512_store_ps(tmp[i] + 16 * f, acc[i][f]);
          for (int i = 0; i < mv; ++i) {
            const int64_t r = r0 + i0 + i, t = r / G, g = r % G;
            at::BFloat16* o = out + ((first + t) * H + h * G + g) * HD;
            for (int d = 0; d < HD; ++d) o[d] = from_f<at::BFloat16>(tmp[i][d]);
          }
        }
      }
    }
  });
}

static bool prefill_bf16(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                         const int64_t* slots, const int64_t* starts, const int64_t* news, const int64_t* ctxs,
                         at::BFloat16* out, int64_t R, int64_t H, int64_t KV, int64_t D, int64_t L, float scale) {
#define TS_CASE(HDV) \
  if (D == HDV) { prefill_bf16_impl<HDV>(q, k, v, slots, starts, news, ctxs, out, R, H, KV, L, scale); return true; }
  TS_CASE(64) TS_CASE(128) TS_CASE(32) TS_CASE(96) TS_CASE(256)
#undef TS_CASE
  return false;
}
#endif

// ---- bf16 linear layers ----------------------------------------------------------------------
// y[M, N] = x[M, K] W^T (+ bias) for a bf16 weight packed once at load as [N / 64][K / 2][64][2]
// (``PackedLinear``): per pair of input dims, the 64 outputs' two weights side by side, the
// layout ``_mm512_dpbf16_ps`` reads (16 outputs x 2 dims a vector). A tile is MR rows x 64
// outputs in 4 x MR float32 accumulators; each pair of dims costs 4 weight loads, MR broadcast
// x pairs and 4 x MR dpbf16. Every output is its row's dims summed in order, pair by pair, so a
// row's result does not depend on the other rows or their number (the last layer can run on
// the sampled rows alone). On the 2-core EPYC, against oneDNN's prepacked bf16 matmul: 2.1x at
// 1 row, 1.15x at 64 (weights from memory, as in a decode step), even at 256-2,048 rows.
#ifdef TAILSERVE_HAVE_DPBF16
template <int MR>
static inline void linear_tile(const uint16_t* __restrict x, int64_t K, const uint32_t* __restrict w,
                               const float* __restrict bias, uint16_t* __restrict y, int64_t N) {
  const int64_t K2 = K / 2;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * K);
  for (int64_t p = 0; p < K2; ++p) {
    const uint32_t* wp = w + p * 64;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 16);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wp + 48);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) {
      __m512 v = acc[r][j];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      // Round to nearest even as c10::BFloat16 does (NaN stays NaN).
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_bf16: x must be bf16 [rows, in]");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 64 && w.size(3) == 2 && w.is_contiguous() &&
              w.scalar_type() == at::kBFloat16, "linear_bf16: w must be packed bf16 [out / 64, in / 2, 64, 2]");
  const int64_t M = x.size(0), K = x.size(1), NP = w.size(0), N = NP * 64;
  TORCH_CHECK(K == 2 * w.size(1), "linear_bf16: x has ", K, " features, the weight ", 2 * w.size(1));
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16: bias of ", bias->numel(), " for ", N, " outputs");
    bf = bias->to(torch::kFloat).contiguous();
  }
#ifdef TAILSERVE_HAVE_DPBF16
  if (M == 0) return y;
  constexpr int MR = 6;
  // A task is one block of MB rows x one panel of 64 outputs, numbered panel-major: a thread's
  // static share is a run of whole panels, each read from memory once and kept in L2 while the
  // row blocks pass (x is re-read per panel, from L3), and every thread gets the same number of
  // rows. (Row-major numbering re-reads each panel per row block and, at 512 rows, gave one
  // thread 288 rows and the other 224: gate_up ran 1.14x oneDNN's time.)
  const int64_t MB = K <= 1024 ? 96 : 48;
  const int64_t nmb = (M + MB - 1) / MB;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, NP * nmb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t np = task / nmb, mb = task % nmb;
      const int64_t m0 = mb * MB, m1 = std::min(M, m0 + MB);
      const uint32_t* wt = wp + np * (K / 2) * 64;
      const float* bt = bp ? bp + np * 64 : nullptr;
      int64_t m = m0;
      for (; m + MR <= m1; m += MR) linear_tile<MR>(xp + m * K, K, wt, bt, yp + m * N + np * 64, N);
      switch (m1 - m) {
        case 1: linear_tile<1>(xp + m * K, K, wt, bt, yp + m * N + np * 64, N); break;
        case 2: linear_tile<2>(xp + m * K, K, wt, bt, yp + m * N + np * 64, N); break;
        case 3: linear_tile<3>(xp + m * K, K, wt, bt, yp + m * N + np * 64, N); break;
        case 4: linear_tile<4>(xp + m * K, K, wt, bt, yp + m * N + np * 64, N); break;
        case 5: linear_tile<5>(xp + m * K, K, wt, bt, yp + m * N + np * 64, N); break;
        default: break;
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_bf16: built without avx512_bf16");
  return y;
#endif
}

// ---- bf16 linear layers on AMX ----------------------------------------------------------------
// The same packed weight as ``linear_bf16`` ([N / 64][K / 2][64][2]) through AMX tiles where the
// CPU has amx_bf16 (Sapphire Rapids and later; level amx_bf16): a B tile is 16 pairs of input
// dims x 16 outputs, 64 bytes a row, and the packing already holds it, a row every 256 bytes (one
// pair of dims for the panel's 64 outputs), so nothing is repacked. A step is one A tile (16 rows
// of x x 32 dims), four B tiles and four TDPBF16PS into four C tiles (16 rows x 64 outputs).
// Rows past the last full 16 come from a padded copy. Each output is its x row's dims summed 32
// a step in input order into one float32 tile row, whatever the other rows hold, so a row's
// result does not depend on the other rows or their number (``rows_independent``); TDPBF16PS
// adds a pair's two products in another order than VDPBF16PS, so it can differ from
// ``linear_bf16`` in the last bit. On the 2-core Xeon with AMX (engine_kernels, a Llama-3.2-1B
// layer's four projections, 2 threads): 4.1 / 7.1 / 20 ms at 1 / 64 / 256 rows, against dpbf16's
// 5.2 / 47 / 182 and oneDNN's AMX matmul's 4.6 / 7.0 / 17 (docs/benchmarks.md).
#if defined(TAILSERVE_HAVE_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TAILSERVE_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out the tile state only to a process that asks (5.16+); cpu_isa asks first and
// stays at avx512_bf16 where the answer is no, so this is the kernel's own safety net.
static bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (16 rows x 16 float32); 4: A (16 rows x 32 bf16); 5, 6: B (16 pairs x 16 outputs).
// The configuration is per thread: each parallel chunk loads it and releases it.
static inline void amx_configure() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// The four C tiles (16 rows x 64 outputs) both AMX kernels accumulate into, the A tile in tile
// 4: zeroed, one step against a 64-output row of B tiles (``b``, a row every ``stride`` bytes),
// and stored as [16][64] float32.
static inline void amx_zero4() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

static inline void amx_dp4(const uint32_t* b, int64_t stride) {
  _tile_loadd(5, b, stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, b + 16, stride);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, b + 32, stride);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(6, b + 48, stride);
  _tile_dpbf16ps(3, 4, 6);
}

static inline void amx_store4(float (*c)[64]) {
  _tile_stored(0, &c[0][0], 256);
  _tile_stored(1, &c[0][16], 256);
  _tile_stored(2, &c[0][32], 256);
  _tile_stored(3, &c[0][48], 256);
}

// 16 rows of x (K elements apart) x one panel of 64 outputs; ``rows`` of them stored.
static inline void linear_amx_block(const uint16_t* __restrict x, int64_t K,
                                    const uint32_t* __restrict w, const float* __restrict bias,
                                    uint16_t* __restrict y, int64_t N, int64_t rows) {
  amx_zero4();
  const int64_t stride = K * 2;
  for (int64_t s = 0; s < K / 32; ++s) {
    _tile_loadd(4, x + s * 32, stride);
    const uint32_t* wb = w + s * 16 * 64;
    // The panel streams from memory: ask for the step after next (4 KB) while this one runs
    // (tile loads get less from the hardware prefetcher; a scratch A/B at 1-16 rows was faster).
    if (s + 2 < K / 32) {
      const char* ahead = reinterpret_cast<const char*>(wb + 2 * 16 * 64);
      for (int l = 0; l < 4096; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
    }
    amx_dp4(wb, 256);
  }
  alignas(64) float c[16][64];
  amx_store4(c);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j) {
      __m512 v = _mm512_load_ps(&c[r][16 * j]);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
    }
}
// ---- prefill attention on AMX -------------------------------------------------------------------
// ``prefill_bf16_impl``'s tasks and packing through tiles (level amx_bf16, head_dim a multiple of
// 64): the keys packed per block of 16 as [HD / 2][16] pairs are B tiles as they stand (16 pairs
// of dims x 16 keys), the values packed in pairs of keys [pairs][HD] are B tiles of 16 key pairs x
// 16 dims (a row every HD * 4 bytes). Per block of 16 query rows (copied into one buffer: a GQA
// group's rows are not evenly spaced in q): S = Q K^T one 16 x 16 tile per 16 keys (HD / 32
// TDPBF16PS), scaled, float32 softmax per row, P rounded to bf16 as the dpbf16 kernel does, then
// P V in 64-dim chunks, four C tiles each, 32 keys a step. Causal masking is the softmax's length,
// as there. The same sums in another order inside each pair: outputs can differ from the dpbf16
// kernel's in the last bit.
template <int HD>
static void prefill_amx_impl(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                             const int64_t* slots, const int64_t* starts, const int64_t* news,
                             const int64_t* ctxs, at::BFloat16* out, int64_t R, int64_t H, int64_t KV,
                             int64_t L, float scale) {
  static_assert(HD % 64 == 0, "head_dim must be a multiple of 64");
  constexpr int NP = HD / 2;  // bf16 pairs (32-bit words) per row
  constexpr int QR = 16;      // query rows per tile
  const int64_t G = H / KV;
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    std::vector<uint32_t> kpack;
    std::vector<uint32_t> vpack;
    std::vector<float> sc;
    std::vector<uint16_t> pb;
    alignas(64) uint16_t qbuf[QR * HD];
    alignas(64) float tmp[QR][64];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / KV, h = task % KV;
      const int64_t n_new = news[c], ctx = ctxs[c], nk = ctx + n_new, first = starts[c];
      if (n_new == 0) continue;
      const int64_t* __restrict sl = slots + c * L;
      const int64_t nblk = (nk + 15) / 16;
      const int64_t kstep = (nk + 31) / 32;    // P V steps of 32 keys
      const int64_t pstride = kstep * 32;      // P and S row length, keys
      kpack.assign(nblk * NP * 16, 0u);
      vpack.assign(kstep * 16 * HD, 0u);       // zero pairs past nk: P's zeros times zeros
      pack_kv<HD>(k, v, sl, nk, KV, h, kpack.data(), vpack.data());
      sc.resize(QR * pstride);
      pb.resize(QR * pstride);
      const int64_t nrows = n_new * G;  // row r: token r / G, head h * G + r % G
      for (int64_t r0 = 0; r0 < nrows; r0 += QR) {
        const int m = static_cast<int>(std::min<int64_t>(QR, nrows - r0));
        int64_t len[QR];
        int64_t maxlen = 0;
        for (int i = 0; i < QR; ++i) {
          if (i < m) {
            const int64_t r = r0 + i, t = r / G, g = r % G;
            std::memcpy(qbuf + i * HD, q + ((first + t) * H + h * G + g) * HD, HD * 2);
            len[i] = ctx + t + 1;
            maxlen = std::max(maxlen, len[i]);
          } else {
            std::memset(qbuf + i * HD, 0, HD * 2);
            len[i] = 0;
          }
        }
        const int64_t kb_end = (maxlen + 15) / 16;
        for (int64_t kb = 0; kb < kb_end; ++kb) {
          _tile_zero(0);
          const uint32_t* kp = kpack.data() + kb * NP * 16;
          for (int dc = 0; dc < HD / 32; ++dc) {
            _tile_loadd(4, qbuf + dc * 32, HD * 2);
            _tile_loadd(5, kp + dc * 16 * 16, 64);
            _tile_dpbf16ps(0, 4, 5);
          }
          _tile_stored(0, sc.data() + kb * 16, pstride * 4);
        }
        const int64_t pend = (maxlen + 31) / 32 * 32;
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int i = 0; i < QR; ++i) {
          uint16_t* prow = pb.data() + i * pstride;
          int64_t j = 0;
          if (i < m) {
            float* row = sc.data() + i * pstride;
            for (int64_t j0 = 0; j0 < kb_end * 16; j0 += 16)
              _mm512_storeu_ps(row + j0, _mm512_mul_ps(_mm512_loadu_ps(row + j0), vscale));
            softmax_inplace(row, len[i]);
            for (; j < len[i]; ++j) prow[j] = from_f<at::BFloat16>(row[j]).x;
          }
          for (; j < pend; ++j) prow[j] = 0;
        }
        for (int dc = 0; dc < HD / 64; ++dc) {
          amx_zero4();
          for (int64_t ks = 0; ks < pend / 32; ++ks) {
            _tile_loadd(4, pb.data() + ks * 32, pstride * 2);
            const uint32_t* vb = vpack.data() + ks * 16 * HD + dc * 64;
            amx_dp4(vb, HD * 4);
          }
          amx_store4(tmp);
          for (int i = 0; i < m; ++i) {
            const int64_t r = r0 + i, t = r / G, g = r % G;
            at::BFloat16* o = out + ((first + t) * H + h * G + g) * HD + dc * 64;
            for (int d = 0; d < 64; ++d) o[d] = from_f<at::BFloat16>(tmp[i][d]);
          }
        }
      }
    }
    _tile_release();
  });
}

bool prefill_amx_applies(int64_t D);  // defined with the module's queries below

static bool prefill_amx(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                        const int64_t* slots, const int64_t* starts, const int64_t* news, const int64_t* ctxs,
                        at::BFloat16* out, int64_t R, int64_t H, int64_t KV, int64_t D, int64_t L, float scale) {
  if (!prefill_amx_applies(D)) return false;
#define TS_CASE(HDV) \
  if (D == HDV) { prefill_amx_impl<HDV>(q, k, v, slots, starts, news, ctxs, out, R, H, KV, L, scale); return true; }
  TS_CASE(64) TS_CASE(128) TS_CASE(256)
#undef TS_CASE
  return false;
}
#endif

torch::Tensor linear_amx(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_amx: x must be bf16 [rows, in]");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 64 && w.size(3) == 2 && w.is_contiguous() &&
              w.scalar_type() == at::kBFloat16, "linear_amx: w must be packed bf16 [out / 64, in / 2, 64, 2]");
  const int64_t M = x.size(0), K = x.size(1), NP = w.size(0), N = NP * 64;
  TORCH_CHECK(K == 2 * w.size(1), "linear_amx: x has ", K, " features, the weight ", 2 * w.size(1));
  TORCH_CHECK(K % 32 == 0, "linear_amx: ", K, " input features, not a multiple of 32");
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_amx: bias of ", bias->numel(), " for ", N, " outputs");
    bf = bias->to(torch::kFloat).contiguous();
  }
#ifdef TAILSERVE_HAVE_AMX
  TORCH_CHECK(amx_permitted(), "linear_amx: the OS did not grant the AMX tile state (arch_prctl)");
  if (M == 0) return y;
  const int64_t full = M / 16 * 16, tail = M - full, nmb16 = (M + 15) / 16;
  // The last partial block of rows, padded to 16 (the tile reads 16 rows; the padding rows'
  // outputs are never stored).
  torch::Tensor pad;
  if (tail) {
    pad = torch::zeros({16, K}, x.options());
    pad.narrow(0, 0, tail).copy_(xc.narrow(0, full, tail));
  }
  // Tasks as in ``linear_bf16``: panel-major, a panel read from memory once per task and kept
  // in L2 while its blocks of up to MB rows pass.
  constexpr int64_t MB = 64 / 16;  // 16-row blocks per task
  const int64_t nmb = (nmb16 + MB - 1) / MB;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* pp = tail ? reinterpret_cast<const uint16_t*>(pad.data_ptr()) : nullptr;
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, NP * nmb, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t np = task / nmb, mb = task % nmb;
      const uint32_t* wt = wp + np * (K / 2) * 64;
      const float* bt = bp ? bp + np * 64 : nullptr;
      for (int64_t b = mb * MB; b < std::min(nmb16, (mb + 1) * MB); ++b) {
        const int64_t m = b * 16;
        if (m < full)
          linear_amx_block(xp + m * K, K, wt, bt, yp + m * N + np * 64, N, 16);
        else
          linear_amx_block(pp, K, wt, bt, yp + m * N + np * 64, N, tail);
      }
    }
    _tile_release();
  });
  return y;
#else
  TORCH_CHECK(false, "linear_amx: built without AMX (level amx_bf16)");
  return y;
#endif
}

// ---- bf16 linear layers on AVX2 + FMA -------------------------------------------------------
// y[M, N] = x[M, K] W^T (+ bias) for CPUs without a bf16 dot-product instruction (Haswell to
// Zen 3): the weight stays bf16 in memory (half float32's bytes; a decode step streams every
// weight once) and is widened to float32 in registers, where bf16 -> float32 is exact and costs
// a shift or a mask. Packed once at load (``PackedLinear``) as [ceil(N / 16)][K][8][2]: a panel
// of 16 outputs, per input dim one 32-byte row whose 32-bit word j holds output j in its low
// half and output j + 8 in its high half, so one load gives two float32 vectors of 8 outputs:
// ``w << 16`` (outputs 0-7) and ``w & 0xffff0000`` (outputs 8-15). x is widened once per call
// into tiles of up to 6 rows, [tile][K][6] float32, so a tile's rows are 6 adjacent broadcasts.
// A tile is MR rows x NPAN panels in 2 * MR * NPAN float32 accumulators (at most 12 of the 16
// ymm registers): per input dim, NPAN weight loads, MR broadcasts, 2 * MR * NPAN FMAs. Each
// output is its row's dims summed in input order, whatever the tile shape, so a row's result
// does not depend on the other rows or their number (the last layer can run on the sampled rows
// alone), and it is rounded once to bf16. On the 2-core EPYC (Zen 3, 2 threads): ~170-180
// GFLOP/s at 64 rows, 90-94% of its measured FMA peak and ~2x MKL's float32 F.linear; at 1 row
// the weights stream at ~90% of the read bandwidth (docs/executor.md).
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TAILSERVE_HAVE_AVX2 1

static inline __m256 bf16_low(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 bf16_high(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 8 float32 -> 8 bf16, rounded to nearest even as c10::BFloat16 does (NaN stays a NaN).
static inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  // NaN tested on the bits: -ffast-math lets the compiler fold a float unordered compare away.
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // packus works per 128-bit lane: values 0-3 land in qword 0, 4-7 in qword 2.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

// The weights a tile will need next are prefetched 2 KiB (64 input dims) ahead of the loads: at
// 1-8 rows the loop is short enough per byte that the hardware prefetcher alone left 20-40% of
// the read bandwidth unused (one thread, tiny model's matrices from memory).
constexpr int64_t kLinearPrefetchWords = 512;

// Not inlined: inside the task loop GCC kept the output rounding's constants in ymm registers
// across the k loop and spilled an accumulator to the stack (a store and reload each input dim).
template <int MR, int NPAN>
__attribute__((noinline)) static void linear_avx2_tile(const float* __restrict xt, const uint32_t* __restrict w, int64_t K,
                                    const float* __restrict bias, uint16_t* __restrict y, int64_t ldy,
                                    int64_t nvalid) {
  __m256 acc[MR][2 * NPAN];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPAN; ++j) acc[r][j] = _mm256_setzero_ps();
  const uint32_t* wq[NPAN];
  for (int p = 0; p < NPAN; ++p) wq[p] = w + p * K * 8;
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[2 * NPAN];
#pragma GCC unroll 4
    for (int p = 0; p < NPAN; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(wq[p] + 8 * k + kLinearPrefetchWords), _MM_HINT_T0);
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq[p] + 8 * k));
      wv[2 * p] = bf16_low(a);
      wv[2 * p + 1] = bf16_high(a);
    }
    const float* xk = xt + 6 * k;
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xk + r);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NPAN; ++j) acc[r][j] = _mm256_fmadd_ps(xb, wv[j], acc[r][j]);
    }
  }
  // Through a fixed-size buffer: indexing ``acc`` with the runtime panel below made GCC keep
  // every accumulator in memory, stored each input dim (a third of the FMA rate).
  alignas(32) float res[MR][16 * NPAN];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPAN; ++j) _mm256_store_ps(res[r] + 8 * j, acc[r][j]);
  for (int r = 0; r < MR; ++r)
    for (int64_t n0 = 0; n0 < 16 * NPAN && n0 < nvalid; n0 += 8) {
      __m256 v = _mm256_load_ps(res[r] + n0);
      if (bias) {
        alignas(32) float b8[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        std::memcpy(b8, bias + n0, sizeof(float) * std::min<int64_t>(8, nvalid - n0));
        v = _mm256_add_ps(v, _mm256_load_ps(b8));
      }
      uint16_t* out = y + r * ldy + n0;
      if (nvalid - n0 >= 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), to_bf16x8(v));
      } else {  // the last panel of an output count that is not a multiple of 16
        alignas(16) uint16_t tmp[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_bf16x8(v));
        std::memcpy(out, tmp, sizeof(uint16_t) * (nvalid - n0));
      }
    }
}

// r[j] = lane j of r[0..7] (an 8 x 8 transpose).
static inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0x44);
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0xEE);
    }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// ``rows`` (<= 6) bf16 rows of x, K apart, widened into one tile of the [K][6] float32 layout.
// 8 input dims at a time: the rows' 8 values widened, transposed, and each dim's 6 stored
// together (an 8-float store whose 2 extra lanes the next dim's store overwrites). The
// one-value-at-a-time loop it replaces held ~5% of the linear layers' perf samples at 64 rows
// (Zen 4 at level avx2); with this, one thread's linear layers took 1.4% less CPU time.
static void pack_rows(const uint16_t* x, int64_t K, int rows, float* dst) {
  int64_t k0 = 0;
  for (; k0 + 8 <= K; k0 += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = i < rows ? bf16_low(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i * K + k0))))
                      : _mm256_setzero_ps();
    transpose8(r);
    for (int j = 0; j < 8; ++j) {
      float* d = dst + 6 * (k0 + j);
      if (k0 + j + 1 < K) {
        _mm256_storeu_ps(d, r[j]);
      } else {  // the tile's last dim: nothing after it to overwrite
        _mm_storeu_ps(d, _mm256_castps256_ps128(r[j]));
        _mm_storel_pi(reinterpret_cast<__m64*>(d + 4), _mm256_extractf128_ps(r[j], 1));
      }
    }
  }
  for (; k0 < K; ++k0)
    for (int i = 0; i < rows; ++i) {
      const uint32_t bits = static_cast<uint32_t>(x[i * K + k0]) << 16;
      std::memcpy(dst + 6 * k0 + i, &bits, sizeof(float));
    }
}

// Tile t of T covers rows [row_tile_start(t), row_tile_start(t + 1)): M rows cut into ceil(M / 6)
// near-equal tiles (8 rows -> 4 + 4, not 6 + 2), because a tile of r rows keeps 2r FMA chains
// and below 8 of them the FMA latency, not its rate, bounds the loop.
static inline int64_t row_tile_start(int64_t t, int64_t M, int64_t T) {
  return t * (M / T) + std::min(t, M % T);
}

// Tasks 0..n-1 handed out to this call's threads in order, a run of ``chunk`` at a time (at least
// 8 runs per thread): fn(task, next), next being the task the same thread takes after this one
// (or n), so it can prefetch that task's data. With the fixed halves at::parallel_for gives, a
// thread the OS stops for a time slice (another process on its core) holds the call until it has
// done its whole half; taken in short runs, the other thread does the remaining tasks meanwhile.
// Which thread does a task does not change its result.
template <typename F>
static void parallel_tasks(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(1, n / (8 * std::max<int64_t>(threads, 1)));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t first = next.fetch_add(chunk, std::memory_order_relaxed);
    while (first < n) {
      const int64_t after = next.fetch_add(chunk, std::memory_order_relaxed);
      const int64_t last = std::min(n, first + chunk);
      for (int64_t task = first; task < last; ++task) fn(task, task + 1 < last ? task + 1 : std::min(after, n));
      first = after;
    }
  });
}

#endif

torch::Tensor linear_avx2(torch::Tensor x, torch::Tensor w, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_avx2: x must be bf16 [rows, in]");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 8 && w.size(3) == 2 && w.is_contiguous() &&
              w.scalar_type() == at::kBFloat16, "linear_avx2: w must be packed bf16 [ceil(out / 16), in, 8, 2]");
  const int64_t M = x.size(0), K = x.size(1), NP = w.size(0);
  TORCH_CHECK(K == w.size(1) && K > 0, "linear_avx2: x has ", K, " features, the weight ", w.size(1));
  TORCH_CHECK(N > 16 * (NP - 1) && N <= 16 * NP, "linear_avx2: ", N, " outputs in ", NP, " panels of 16");
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_avx2: bias of ", bias->numel(), " for ", N, " outputs");
    bf = bias->to(torch::kFloat).contiguous();
  }
#ifdef TAILSERVE_HAVE_AVX2
  if (M == 0) return y;
  auto xc = x.contiguous();
  const int64_t T = (M + 5) / 6;
  auto xpack = torch::empty({T * K * 6}, x.options().dtype(torch::kFloat));
  float* xpp = xpack.data_ptr<float>();
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t m0 = row_tile_start(t, M, T);
      pack_rows(xs + m0 * K, K, static_cast<int>(row_tile_start(t + 1, M, T) - m0), xpp + t * K * 6);
    }
  });
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // A task is a group of 4 panels (64 outputs) x a block of row tiles, numbered panel-major and
  // handed out in that order (parallel_tasks), so each panel is read from memory once; within a
  // task each row tile takes the group's panels from L1/L2 in turn. One or two rows take 4 or 2
  // panels per tile instead (4 or 8 FMA chains rather than 2 or 4).
  constexpr int64_t PG = 4;
  const int64_t TB = K <= 1024 ? 16 : 8;  // row tiles per block: ~96 / ~48 rows of x in L2
  const int64_t ngroups = (NP + PG - 1) / PG, nblocks = (T + TB - 1) / TB;
  const int npan = M == 1 ? 4 : M == 2 ? 2 : 1;
  parallel_tasks(ngroups * nblocks, [&](int64_t task, int64_t) {
    const int64_t g = task / nblocks, blk = task % nblocks, p1 = std::min(NP, (g + 1) * PG);
    for (int64_t t = blk * TB; t < std::min(T, (blk + 1) * TB); ++t) {
      const int64_t m0 = row_tile_start(t, M, T);
      const int rows = static_cast<int>(row_tile_start(t + 1, M, T) - m0);
      const float* xt = xpp + t * K * 6;
      int64_t p = g * PG;
      auto at = [&](int64_t panel) { return std::make_tuple(wp + panel * K * 8, bp ? bp + panel * 16 : nullptr,
                                                            yp + m0 * N + panel * 16, N - panel * 16); };
      if (npan == 4)
        for (; p + 4 <= p1; p += 4) {
          auto [wt, bt, yt, nv] = at(p);
          linear_avx2_tile<1, 4>(xt, wt, K, bt, yt, N, nv);
        }
      if (npan == 2)
        for (; p + 2 <= p1; p += 2) {
          auto [wt, bt, yt, nv] = at(p);
          linear_avx2_tile<2, 2>(xt, wt, K, bt, yt, N, nv);
        }
      for (; p < p1; ++p) {
        auto [wt, bt, yt, nv] = at(p);
        switch (rows) {
          case 1: linear_avx2_tile<1, 1>(xt, wt, K, bt, yt, N, nv); break;
          case 2: linear_avx2_tile<2, 1>(xt, wt, K, bt, yt, N, nv); break;
          case 3: linear_avx2_tile<3, 1>(xt, wt, K, bt, yt, N, nv); break;
          case 4: linear_avx2_tile<4, 1>(xt, wt, K, bt, yt, N, nv); break;
          case 5: linear_avx2_tile<5, 1>(xt, wt, K, bt, yt, N, nv); break;
          default: linear_avx2_tile<6, 1>(xt, wt, K, bt, yt, N, nv); break;
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_avx2: built without AVX2 and FMA");
  return y;
#endif
}

// ---- decode attention, AVX2 + FMA -----------------------------------------------------------
// For CPUs without AVX-512: one task per request; its K rows, then its V rows, each read once,
// whole (every KV head: a slot row is KV x head_dim contiguous values), in key order — the
// order a plain loop that only reads the rows takes, which it matches in bytes per second.
// K: per key, each KV head's row is widened to float32 8 dims at a time (bf16: a shift; float32
// caches load as they are) and multiplied into one FMA chain per query head of its GQA group, so
// the group shares every load; each 8 keys' chains are reduced together (sum8: 6 hadds, 2
// permutes and an add for 8 scores). Softmax in float32. V: 4 keys at a time, each output
// vector (in L1) loaded once, 4 FMAs, stored once. Every score and sum is formed in the same
// order whatever the batch. Each row kDecodePrefetchKeys keys ahead in the sequence K, V, then
// the thread's next request's K is prefetched into L2 while a key is computed, spread one row
// per key (a burst of a whole block's prefetches stalled the loop). Requests are handed out in
// short runs (parallel_tasks), not in fixed halves. On the 2-core EPYC (Zen 3, one thread, batch
// 64, context 289, bf16), prefetching into L1: 7.0-7.8 GB/s of K/V, as fast as the read-only
// loop (7.2); a version that took each KV head's rows of a 16-key block in turn, prefetching the
// next block at once, reached 4.6-5.1, the portable kernel ~3.6-6 (docs/executor.md). On a Zen 4
// forced to level avx2 (r44), prefetching into L2 instead took one thread from 8.6 to 12.8 GB/s
// (76 MB from memory; 22 GB/s with the rows in cache, whichever hint), the same as AVX-512's
// decode kernel found; taking each 16-dim chunk as even and odd bf16 halves (2 ALU ops where
// widening takes 4) with q reused over 4 keys was no faster (21.8 GB/s in cache, 10.9 from
// memory) and was dropped.
#ifdef TAILSERVE_HAVE_AVX2
static inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8f(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// r[i] = the sum of v[i]'s 8 lanes, for 8 vectors at once.
static inline __m256 sum8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // ab: [v0..v3 lanes 0-3 | v0..v3 lanes 4-7], cd the same for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

constexpr int64_t kDecodePrefetchKeys = 16;  // 8 and 32 (Zen 3, L1), 32 and 48 (Zen 4, L2): within noise

static inline void prefetch_row(const char* p, int64_t row_bytes) {
  for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T1);
}

template <typename T, int HD, int G>
static void decode_avx2_impl(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* lengths,
                             float* out, int64_t B, int64_t H, int64_t KV, int64_t L, float scale) {
  static_assert(HD % 8 == 0, "head_dim must be a multiple of 8");
  constexpr int NF = HD / 8;  // float32 vectors per row of one head
  const int64_t row_elems = KV * HD, row_bytes = row_elems * static_cast<int64_t>(sizeof(T));
  const char* kc = reinterpret_cast<const char*>(k);
  const char* vc = reinterpret_cast<const char*>(v);
  parallel_tasks(B, [&](int64_t b, int64_t after) {
    std::vector<float> scores;
    std::vector<__m256> part(KV * G * 8);
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t n = lengths[b];
    const int64_t* __restrict sl = slots + b * L;
    const int64_t stride = ((n + 7) / 8) * 8;
    scores.resize(H * stride);
    float* __restrict sc = scores.data();
    const float* qb = q + b * H * HD;
    for (int64_t s0 = 0; s0 < n; s0 += 8) {
      const int m = static_cast<int>(std::min<int64_t>(8, n - s0));
      for (int i = 0; i < m; ++i) {
        const int64_t t = s0 + i + kDecodePrefetchKeys;  // in the sequence K rows, then V rows
        if (t < n) prefetch_row(kc + sl[t] * row_bytes, row_bytes);
        else if (t - n < n) prefetch_row(vc + sl[t - n] * row_bytes, row_bytes);
        const T* row = k + sl[s0 + i] * row_elems;
        for (int64_t h = 0; h < KV; ++h) {
          const T* rh = row + h * HD;
          const float* qh = qb + h * G * HD;
          __m256 acc[G];
          const __m256 k0 = load8f(rh);
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) acc[g] = _mm256_mul_ps(_mm256_loadu_ps(qh + g * HD), k0);
#pragma GCC unroll 32
          for (int j = 1; j < NF; ++j) {
            const __m256 kj = load8f(rh + 8 * j);
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * HD + 8 * j), kj, acc[g]);
          }
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) part[(h * G + g) * 8 + i] = acc[g];
        }
      }
      for (int64_t r = 0; r < H; ++r) {
        for (int i = m; i < 8; ++i) part[r * 8 + i] = _mm256_setzero_ps();
        _mm256_storeu_ps(sc + r * stride + s0, _mm256_mul_ps(sum8(part.data() + r * 8), vscale));
      }
    }
    for (int64_t r = 0; r < H; ++r) softmax_inplace(sc + r * stride, n);
    float* ob = out + b * H * HD;
    std::fill(ob, ob + H * HD, 0.0f);
    constexpr int KB = 4;  // keys per pass over the accumulators (in L1: H x HD floats)
    for (int64_t l0 = 0; l0 < n; l0 += KB) {
      const int m = static_cast<int>(std::min<int64_t>(KB, n - l0));
      const T* rows[KB];  // a short last group repeats its last row, with weight 0
      for (int i = 0; i < KB; ++i) rows[i] = v + sl[l0 + std::min(i, m - 1)] * row_elems;
      for (int i = 0; i < m; ++i) {  // in the sequence V rows, then the next request's K rows
        const int64_t t = l0 + i + kDecodePrefetchKeys;
        if (t < n) prefetch_row(vc + sl[t] * row_bytes, row_bytes);
        else if (after < B && t - n < lengths[after]) prefetch_row(kc + slots[after * L + t - n] * row_bytes, row_bytes);
      }
      for (int64_t h = 0; h < KV; ++h) {
        __m256 w[G][KB];
        for (int g = 0; g < G; ++g)
          for (int i = 0; i < KB; ++i)
            w[g][i] = i < m ? _mm256_broadcast_ss(sc + (h * G + g) * stride + l0 + i) : _mm256_setzero_ps();
        for (int j = 0; j < NF; ++j) {
          __m256 vr[KB];
#pragma GCC unroll 4
          for (int i = 0; i < KB; ++i) vr[i] = load8f(rows[i] + h * HD + 8 * j);
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) {
            float* o = ob + (h * G + g) * HD + 8 * j;
            __m256 a = _mm256_loadu_ps(o);
#pragma GCC unroll 4
            for (int i = 0; i < KB; ++i) a = _mm256_fmadd_ps(w[g][i], vr[i], a);
            _mm256_storeu_ps(o, a);
          }
        }
      }
    }
  });
}

// ---- prefill attention, AVX2 + FMA ---------------------------------------------------------
// The prefill chunks' tokens of a bf16 model where the CPU has AVX2 but no AVX-512 bf16, laid
// out as for the dpbf16 tiled kernel (``paged_prefill_attention``). One task per (chunk, KV
// head) widens its keys once into float32 blocks of 8 keys transposed ([dim][8 keys]: a
// broadcast q element times one vector gives 8 keys' products) and its values into float32
// rows, then takes its query rows (each token x the G heads of the group) 6 at a time: scores
// 6 rows x 16 keys in 12 accumulators (per dim: 2 loads, 6 broadcasts, 12 FMAs), the causal
// limit, a float32 softmax per row, then P.V with float32 P and sums, one row at a time, and
// one rounding to bf16. PyTorch's SDPA per chunk, which it replaces at level avx2, took 12% of
// a 16 x 256-token prefill step's time on one core (docs/executor.md).
constexpr int acc_width(int nf) {  // the largest divisor of nf with at most 12 accumulators
  for (int jb = nf < 12 ? nf : 12; jb > 1; --jb)
    if (nf % jb == 0) return jb;
  return 1;
}

template <int HD>
static void prefill_avx2_impl(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                              const int64_t* slots, const int64_t* starts, const int64_t* news,
                              const int64_t* ctxs, at::BFloat16* out, int64_t R, int64_t H, int64_t KV,
                              int64_t L, float scale) {
  static_assert(HD % 8 == 0, "head_dim must be a multiple of 8");
  constexpr int NF = HD / 8;
  constexpr int JB = acc_width(NF);
  constexpr int QR = 6;  // query rows per score tile
  const int64_t G = H / KV;
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, vf, sc;
    alignas(32) float qf[QR][HD];
    alignas(32) float res[HD];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / KV, h = task % KV;
      const int64_t n_new = news[c], ctx = ctxs[c], nk = ctx + n_new, first = starts[c];
      if (n_new == 0) continue;
      const int64_t* __restrict sl = slots + c * L;
      const int64_t stride = ((nk + 15) / 16) * 16;  // keys rounded up to whole 16-key steps
      kt.assign(stride * HD, 0.0f);
      vf.resize(nk * HD);
      for (int64_t j = 0; j < nk; ++j) {
        const at::BFloat16* kr = k + (sl[j] * KV + h) * HD;
        const at::BFloat16* vr = v + (sl[j] * KV + h) * HD;
        float* kd = kt.data() + (j / 8) * HD * 8 + (j % 8);
        for (int d = 0; d < HD; ++d) kd[d * 8] = to_f<at::BFloat16>(kr[d]);
        for (int d = 0; d < HD; ++d) vf[j * HD + d] = to_f<at::BFloat16>(vr[d]);
      }
      sc.resize(QR * stride);
      const int64_t nrows = n_new * G;  // row r: token r / G, head h * G + r % G
      for (int64_t r0 = 0; r0 < nrows; r0 += QR) {
        const int m = static_cast<int>(std::min<int64_t>(QR, nrows - r0));
        int64_t len[QR];
        for (int i = 0; i < QR; ++i) {
          const int64_t r = r0 + std::min(i, m - 1), t = r / G, g = r % G;
          const at::BFloat16* qr = q + ((first + t) * H + h * G + g) * HD;
          for (int d = 0; d < HD; ++d) qf[i][d] = to_f<at::BFloat16>(qr[d]);
          len[i] = ctx + t + 1;
        }
        const int64_t steps = (len[m - 1] + 15) / 16;  // the tile's last row sees the most keys
        for (int64_t kb = 0; kb < steps; ++kb) {
          __m256 acc[QR][2];
#pragma GCC unroll 6
          for (int i = 0; i < QR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
          const float* k0 = kt.data() + 2 * kb * HD * 8;
          const float* k1 = k0 + HD * 8;
#pragma GCC unroll 4
          for (int d = 0; d < HD; ++d) {
            const __m256 a = _mm256_loadu_ps(k0 + d * 8), b = _mm256_loadu_ps(k1 + d * 8);
#pragma GCC unroll 6
            for (int i = 0; i < QR; ++i) {
              const __m256 x = _mm256_broadcast_ss(&qf[i][d]);
              acc[i][0] = _mm256_fmadd_ps(x, a, acc[i][0]);
              acc[i][1] = _mm256_fmadd_ps(x, b, acc[i][1]);
            }
          }
          const __m256 vscale = _mm256_set1_ps(scale);
#pragma GCC unroll 6
          for (int i = 0; i < QR; ++i) {
            _mm256_storeu_ps(sc.data() + i * stride + 16 * kb, _mm256_mul_ps(acc[i][0], vscale));
            _mm256_storeu_ps(sc.data() + i * stride + 16 * kb + 8, _mm256_mul_ps(acc[i][1], vscale));
          }
        }
        for (int i = 0; i < m; ++i) {
          const float* p = sc.data() + i * stride;
          softmax_inplace(sc.data() + i * stride, len[i]);
          for (int j0 = 0; j0 < NF; j0 += JB) {
            __m256 acc[JB];
#pragma GCC unroll 12
            for (int jj = 0; jj < JB; ++jj) acc[jj] = _mm256_setzero_ps();
            for (int64_t j = 0; j < len[i]; ++j) {
              const __m256 w = _mm256_broadcast_ss(p + j);
              const float* vr = vf.data() + j * HD + 8 * j0;
#pragma GCC unroll 12
              for (int jj = 0; jj < JB; ++jj) acc[jj] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * jj), acc[jj]);
            }
#pragma GCC unroll 12
            for (int jj = 0; jj < JB; ++jj) _mm256_store_ps(res + 8 * (j0 + jj), acc[jj]);
          }
          const int64_t r = r0 + i, t = r / G, g = r % G;
          at::BFloat16* o = out + ((first + t) * H + h * G + g) * HD;
          for (int d = 0; d < HD; ++d) o[d] = from_f<at::BFloat16>(res[d]);
        }
      }
    }
  });
}

static bool prefill_avx2(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                         const int64_t* slots, const int64_t* starts, const int64_t* news, const int64_t* ctxs,
                         at::BFloat16* out, int64_t R, int64_t H, int64_t KV, int64_t D, int64_t L, float scale) {
#define TS_CASE(HDV) \
  if (D == HDV) { prefill_avx2_impl<HDV>(q, k, v, slots, starts, news, ctxs, out, R, H, KV, L, scale); return true; }
  TS_CASE(64) TS_CASE(128) TS_CASE(32) TS_CASE(96) TS_CASE(256)
#undef TS_CASE
  return false;
}

// The AVX2 kernel for this cache dtype, head_dim and group size, or false (the portable one runs).
template <typename T>
static bool decode_avx2(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* lengths,
                        float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t L, float scale) {
  const int64_t G = H / KV;
#define TS_CASE(HDV, GV) \
  if (D == HDV && G == GV) { decode_avx2_impl<T, HDV, GV>(q, k, v, slots, lengths, out, B, H, KV, L, scale); return true; }
#define TS_GROUPS(HDV) TS_CASE(HDV, 1) TS_CASE(HDV, 2) TS_CASE(HDV, 3) TS_CASE(HDV, 4) TS_CASE(HDV, 5) \
  TS_CASE(HDV, 6) TS_CASE(HDV, 7) TS_CASE(HDV, 8)
  TS_GROUPS(64) TS_GROUPS(128) TS_GROUPS(32) TS_GROUPS(96) TS_GROUPS(256)
#undef TS_GROUPS
#undef TS_CASE
  return false;
}
#endif

// Whether this build has the AVX2 kernels, ``linear_avx2`` and the AVX2 decode attention
// (compiled for x86-64-v3 or above).
bool avx2_built() {
#ifdef TAILSERVE_HAVE_AVX2
  return true;
#else
  return false;
#endif
}

// Whether ``paged_prefill_attention`` takes the AMX kernel for this head_dim (else dpbf16's).
bool prefill_amx_applies(int64_t D) {
#ifdef TAILSERVE_HAVE_AMX
  return amx_permitted() && (D == 64 || D == 128 || D == 256);
#else
  return false;
#endif
}

// Whether this build's AMX kernels can run: built for level amx_bf16 and the OS granted the
// tiles (every build has the symbols; the others raise or decline).
bool amx_built() {
#ifdef TAILSERVE_HAVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// Which decode kernel this build runs for bf16 caches: "avx512_bf16" or "portable".
std::string decode_kernel_isa() {
#ifdef TAILSERVE_HAVE_DPBF16
  return "avx512_bf16";
#else
  return "portable";
#endif
}

// ``kernel``: "avx512_bf16" (bf16 caches, where built), "avx2" (bf16 and float32 caches, where
// built), anything else the portable loops; a kernel without an instance for the shape falls
// back to the portable one.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                     torch::Tensor slots, torch::Tensor lengths, double scale,
                                     std::string kernel) {
  const bool use_dpbf16 = kernel == "avx512_bf16";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-D");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous");
  auto sl = slots.to(torch::kLong).contiguous();
  auto ln = lengths.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), L = sl.size(1);
  TORCH_CHECK(H % KV == 0, "heads must be a multiple of KV heads");
#ifdef TAILSERVE_HAVE_DPBF16
  if (use_dpbf16 && k.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kBFloat16) {
    auto qb = q.contiguous();
    auto out = torch::empty({B, H, D}, q.options());
    if (decode_bf16(qb.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                    sl.data_ptr<int64_t>(), ln.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KV,
                    D, L, static_cast<float>(scale)))
      return out;
  }
#endif
  auto qf = q.to(torch::kFloat).contiguous();
  auto out = torch::empty({B, H, D}, qf.options());
#ifdef TAILSERVE_HAVE_AVX2
  if (kernel == "avx2") {
    const float* qp = qf.data_ptr<float>();
    const int64_t* sp = sl.data_ptr<int64_t>();
    const int64_t* lp = ln.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    const float sc = static_cast<float>(scale);
    bool done = false;
    if (k.scalar_type() == at::kBFloat16)
      done = decode_avx2(qp, k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), sp, lp, op, B, H, KV, D, L, sc);
    else if (k.scalar_type() == at::kFloat)
      done = decode_avx2(qp, k.data_ptr<float>(), v.data_ptr<float>(), sp, lp, op, B, H, KV, D, L, sc);
    if (done) return out.to(q.scalar_type());
  }
#endif
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
  return out.to(q.scalar_type());
}

// The prefill tokens of an iteration, chunk by chunk: q [B, H, D] bf16 holds every chunk's new
// tokens in order, chunk c's from row starts[c] (news[c] of them); slots [R, L] lists, per chunk,
// the slots of its cached context (ctxs[c]) then of its new tokens, whose K/V are already
// stored. The AMX kernel where built and the head_dim fits it (``prefill_amx_applies``), else
// the AVX-512 bf16 one where built (``decode_kernel_isa``), else the AVX2 one (level avx2;
// Python decides which level calls it); bf16 out, each value rounded once from its
// float32 sum.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                                      torch::Tensor starts, torch::Tensor news, torch::Tensor ctxs, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-D");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: bf16 only");
  auto qb = q.contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  auto st = starts.to(torch::kLong).contiguous();
  auto nw = news.to(torch::kLong).contiguous();
  auto cx = ctxs.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), R = sl.size(0), L = sl.size(1);
  TORCH_CHECK(H % KV == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(st.numel() == R && nw.numel() == R && cx.numel() == R, "paged_prefill_attention: one start, count and context per chunk");
  auto out = torch::empty({B, H, D}, q.options());
#ifdef TAILSERVE_HAVE_AMX
  if (prefill_amx(qb.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                  sl.data_ptr<int64_t>(), st.data_ptr<int64_t>(), nw.data_ptr<int64_t>(), cx.data_ptr<int64_t>(),
                  out.data_ptr<at::BFloat16>(), R, H, KV, D, L, static_cast<float>(scale)))
    return out;
#endif
#ifdef TAILSERVE_HAVE_DPBF16
  if (prefill_bf16(qb.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                   sl.data_ptr<int64_t>(), st.data_ptr<int64_t>(), nw.data_ptr<int64_t>(), cx.data_ptr<int64_t>(),
                   out.data_ptr<at::BFloat16>(), R, H, KV, D, L, static_cast<float>(scale)))
    return out;
#elif defined(TAILSERVE_HAVE_AVX2)
  if (prefill_avx2(qb.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                   sl.data_ptr<int64_t>(), st.data_ptr<int64_t>(), nw.data_ptr<int64_t>(), cx.data_ptr<int64_t>(),
                   out.data_ptr<at::BFloat16>(), R, H, KV, D, L, static_cast<float>(scale)))
    return out;
#endif
  TORCH_CHECK(false, "paged_prefill_attention: no AVX-512 bf16 or AVX2 kernel for head_dim ", D);
  return out;
}

// ---- elementwise -----------------------------------------------------------------------------
static int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

// qkv [N, (H + 2 KV) D] -> q [N, H, D], k [N, KV, D] with rotate-half RoPE, v [N, KV, D];
// cos, sin [P, D] in T; positions [N]. Rounds as x * cos + rotate(x) * sin in T does.
std::vector<torch::Tensor> rope_split(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                      torch::Tensor positions, int64_t H, int64_t KV, int64_t D) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * KV) * D, "rope_split: qkv shape");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && D % 2 == 0, "rope_split: tables");
  const int64_t N = qkv.size(0), W = qkv.size(1), half = D / 2;
  auto pos = positions.to(torch::kLong).contiguous();
  auto q = torch::empty({N, H, D}, qkv.options());
  auto k = torch::empty({N, KV, D}, qkv.options());
  auto v = torch::empty({N, KV, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_split", [&] {
    using T = scalar_t;
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    T* vp = v.data_ptr<T>();
    at::parallel_for(0, N, grain_rows(W), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T* c = cp + pp[i] * D;
        const T* s = sp + pp[i] * D;
        const T* row = xp + i * W;
        for (int64_t head = 0; head < H + KV; ++head) {
          const T* x = row + head * D;
          T* o = head < H ? qp + (i * H + head) * D : kp + (i * KV + head - H) * D;
          for (int64_t d = 0; d < D; ++d) {
            const float rot = d < half ? -to_f<T>(x[d + half]) : to_f<T>(x[d - half]);
            const float a = round_to<T>(to_f<T>(x[d]) * to_f<T>(c[d]));
            const float r = round_to<T>(rot * to_f<T>(s[d]));
            o[d] = from_f<T>(a + r);
          }
        }
        std::memcpy(vp + i * KV * D, row + (H + KV) * D, sizeof(T) * KV * D);
      }
    });
  });
  return {q, k, v};
}

// Greedy tokens: the first index of each row's maximum (torch.argmax's tie rule), and whether
// any logit is NaN (the sampler then cleans the logits and asks again), in one pass. The NaN
// test reads the bits: -ffast-math lets the compiler assume a float compare never sees NaN.
// Logits in float32 or the model dtype: a bf16/fp16 value widens to float32 exactly (NaN stays
// NaN), so the answer is that of the float32 copy the LM head's cast would make, read from
// half the bytes and without the copy.
template <typename T>
static void argmax_impl(const T* xp, int64_t R, int64_t V, int64_t* op, uint8_t* row_nan) {
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* row = xp + r * V;
      float best = -std::numeric_limits<float>::infinity();
      uint32_t nan = 0;
      for (int64_t i = 0; i < V; ++i) {
        const float x = to_f<T>(row[i]);
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof(bits));
        best = x > best ? x : best;
        nan |= (bits & 0x7fffffffu) > 0x7f800000u;
      }
      // The first index holding the maximum: 64 values at a time tested at once, then that
      // block one by one; a value-by-value search read half a row at a scalar pace on average.
      // ``hit`` is an int: g++ 12 leaves a ``bool |=`` loop scalar (the search took ~150 of
      // argmax_rows' ~190 us for 64 x 8,192 bf16 on one core), an int one it vectorises (~17).
      int64_t idx = 0;
      for (; idx + 64 <= V; idx += 64) {
        int hit = 0;
        for (int64_t i = idx; i < idx + 64; ++i) hit |= to_f<T>(row[i]) == best;
        if (hit) break;
      }
      while (idx < V - 1 && !(to_f<T>(row[idx]) == best)) ++idx;
      op[r] = idx;
      row_nan[r] = nan != 0;
    }
  });
}

std::vector<torch::Tensor> argmax_rows(torch::Tensor logits) {
  const auto dt = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dt == torch::kFloat || dt == torch::kBFloat16 || dt == torch::kHalf),
              "argmax_rows: float32, bfloat16 or float16 [R, V]");
  auto x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(torch::kLong));
  std::vector<uint8_t> row_nan(R, 0);
  int64_t* op = out.data_ptr<int64_t>();
  if (dt == torch::kFloat) argmax_impl<float>(x.data_ptr<float>(), R, V, op, row_nan.data());
  else if (dt == torch::kBFloat16) argmax_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(), R, V, op, row_nan.data());
  else argmax_impl<at::Half>(x.data_ptr<at::Half>(), R, V, op, row_nan.data());
  bool any_nan = false;
  for (uint8_t f : row_nan) any_nan = any_nan || f;
  return {out, torch::tensor(any_nan)};
}

// A decode batch's slots from its block tables: slots[i, j] = table[i, j / bs] * bs + j % bs for
// the positions j <= contexts[i] row i attends over, the null slot past them, and that validity
// as a bool mask. One pass over [B, width] (the tensor ops it replaces, a broadcast product,
// a compare and a where over ~21k values, took ~150 us a decode step at batch 64).
std::vector<torch::Tensor> decode_slots(torch::Tensor table, torch::Tensor contexts, int64_t block_size,
                                        int64_t width, int64_t null_slot) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kLong, "decode_slots: table [B, blocks] long");
  TORCH_CHECK(contexts.dim() == 1 && contexts.scalar_type() == torch::kLong && contexts.size(0) == table.size(0),
              "decode_slots: contexts [B] long");
  TORCH_CHECK(block_size > 0 && width >= 0 && table.size(1) * block_size >= width, "decode_slots: table narrower than width");
  auto t = table.contiguous();
  auto c = contexts.contiguous();
  const int64_t B = t.size(0), NT = t.size(1);
  auto slots = torch::empty({B, width}, t.options());
  auto valid = torch::empty({B, width}, t.options().dtype(torch::kBool));
  const int64_t* tp = t.data_ptr<int64_t>();
  const int64_t* cp = c.data_ptr<int64_t>();
  int64_t* sp = slots.data_ptr<int64_t>();
  bool* vp = valid.data_ptr<bool>();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = std::min<int64_t>(std::max<int64_t>(cp[i] + 1, 0), width);
    int64_t* srow = sp + i * width;
    bool* vrow = vp + i * width;
    for (int64_t j0 = 0; j0 < n; j0 += block_size) {
      const int64_t base = tp[i * NT + j0 / block_size] * block_size, end = std::min(n, j0 + block_size);
      for (int64_t j = j0; j < end; ++j) srow[j] = base + (j - j0);
    }
    for (int64_t j = n; j < width; ++j) srow[j] = null_slot;
    std::memset(vrow, 1, n);
    std::memset(vrow + n, 0, width - n);
  }
  return {slots, valid};
}

// The new tokens' K and V into the cache: row i of k and v ([N, KV, D]) to slot slots[i] of
// k_cache and v_cache ([S, KV, D]), as index_copy_ along dim 0 does, each slot checked.
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv: the cache must be contiguous");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "store_kv: cache shapes");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "store_kv: dtypes");
  auto kc = k.contiguous();
  auto vc = v.contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  const int64_t N = sl.numel(), S = k_cache.size(0), row = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(kc.numel() == N * row && vc.numel() == N * row, "store_kv: one K and V row per slot");
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "store_kv: slot ", sp[i], " outside the cache's ", S);
  const int64_t bytes = row * k_cache.element_size();
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  // Each destination row is a cache miss, and a store that misses waits for its line: asking
  // for every line with write intent first lets the misses overlap (a plain copy of a decode
  // batch's 64 rows took ~110 us, one miss after another).
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(bytes, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t c = 0; c < bytes; c += 64) {
        __builtin_prefetch(kd + sp[i] * bytes + c, 1, 3);
        __builtin_prefetch(vd + sp[i] * bytes + c, 1, 3);
      }
    for (int64_t i = b; i < e; ++i) {
      std::memcpy(kd + sp[i] * bytes, ks + i * bytes, bytes);
      std::memcpy(vd + sp[i] * bytes, vs + i * bytes, bytes);
    }
  });
}
"""

FUNCTIONS = [
    "paged_decode_attention",
    "decode_kernel_isa",
    "paged_prefill_attention",
    "rope_split",
    "argmax_rows",
    "store_kv",
    "decode_slots",
    "linear_bf16",
    "linear_avx2",
    "avx2_built",
    "linear_amx",
    "amx_built",
    "prefill_amx_applies",
]
