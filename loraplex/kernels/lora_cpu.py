"""A fused CPU kernel for batched multi-LoRA (fp32), compiled once per machine with the system C++ compiler.

Why: on a CPU each torch matmul call costs ~10-20 us however small it is, and the torch path issues
(1 + slices) of them per adapter per projection. A decode step with 8 adapters over 30 layers is
thousands of calls, more than the arithmetic. Decode groups are a few tokens each, so the work is
memory-bound on reading each adapter's A and B once: this kernel reads every weight row once per four
tokens, keeps the accumulators of four tokens in vector registers, and runs all groups of a projection in
one call split over threads. Prefill groups (many tokens of one adapter) run through the same kernel, cut
into pieces so that they spread over the threads: measured on a 2-core AVX-512 machine, it beats the torch
path's MKL calls at every group size tried (16 tokens per adapter: 24 vs 68 ms for 8 adapters over the
120 projections of SmolLM2; 200 tokens: 182 vs 323 ms).

When no compiler is available the torch path is used (same results).
"""

from __future__ import annotations

import logging

import torch

from loraplex.kernels.cpp_build import InlineExtension
from loraplex.kernels.lora import LoraBatch, LoraSlotWeights, add_lora_torch

log = logging.getLogger(__name__)

# Below this many multiply-adds a call stays on one thread: waking the other costs more than it saves.
MIN_PARALLEL_COST = 200_000

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// One vector register of floats (GCC/Clang vector extension): 16 with AVX-512, otherwise 8 (AVX; two SSE or
// NEON registers). The register blocking below is sized for 32 registers with AVX-512 and 16 without.
#ifdef __AVX512F__
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vfw __attribute__((vector_size(VW * sizeof(float))));

static inline vfw ldw(const float* p) {
  vfw v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Adapter weights may be stored in half precision (`lora_dtype`): half the bytes to stream, widened to fp32
// as they are loaded; x, the shrunk values, y and every accumulation stay fp32.
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

static inline float to_f32(float v) { return v; }
static inline float to_f32(BF16 h) {
  const uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
static inline float to_f32(F16 h) {  // IEEE binary16, subnormals included
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1Fu, man = h.bits & 0x3FFu, u;
  if (exp == 0x1Fu) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    exp = 113u;
    while ((man & 0x400u) == 0) { man <<= 1; --exp; }
    u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

static inline vfw ldw(const BF16* p) {
#ifdef __AVX512F__
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vfw>(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vfw>(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
#else
  float f[VW];
  for (int i = 0; i < VW; ++i) f[i] = to_f32(p[i]);
  return ldw(f);
#endif
}

static inline vfw ldw(const F16* p) {
#ifdef __AVX512F__
  return reinterpret_cast<vfw>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<vfw>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float f[VW];
  for (int i = 0; i < VW; ++i) f[i] = to_f32(p[i]);
  return ldw(f);
#endif
}

// Keeps a loaded vector in a register: GCC otherwise folds the load into every multiply-add that uses it,
// reloading the same vector once per use (the shrink's loads doubled and it ran at 40% of the FMA rate).
#if defined(__GNUC__) && (defined(__AVX512F__) || defined(__AVX__))
#define LP_IN_REGISTER(v) asm("" : "+v"(v))
#else
#define LP_IN_REGISTER(v) (void)0
#endif

// The sum of a vector's lanes as a tree of halvings (a lane-by-lane loop is one long dependency chain of
// scalar adds, which cost the shrink as much as its multiply-adds).
static inline float hsumw(vfw v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float h[VW];
  std::memcpy(h, &v, sizeof(v));
  for (int width = VW / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) h[i] += h[i + width];
  return h[0];
#endif
}

// The R x NT dot products' lanes summed, plus the columns past the last full vector; written to out, or added
// to it (`add`: a later block of the K columns).
#if defined(__AVX__) && !defined(__AVX512F__)
// Four accumulators' lanes summed at once by three horizontal adds (one vector of four sums), where one
// accumulator at a time takes two shuffles and adds per halving.
static inline __m128 hsum4(vfw v0, vfw v1, vfw v2, vfw v3) {
  const __m256 a = _mm256_hadd_ps(reinterpret_cast<__m256>(v0), reinterpret_cast<__m256>(v1));
  const __m256 b = _mm256_hadd_ps(reinterpret_cast<__m256>(v2), reinterpret_cast<__m256>(v3));
  const __m256 c = _mm256_hadd_ps(a, b);
  return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}
#endif

template <typename W, int R, int NT>
static inline void shrink_finish(const vfw (&acc)[R][NT], const W* const* arows, const float* const* xrows,
                                 int64_t k, int64_t in, float* out, int64_t os, bool add) {
  constexpr int N = R * NT;
  float sums[N];
  int i = 0;
#if defined(__AVX__) && !defined(__AVX512F__)
  for (; i + 4 <= N; i += 4)
    _mm_storeu_ps(sums + i, hsum4(acc[i / NT][i % NT], acc[(i + 1) / NT][(i + 1) % NT],
                                  acc[(i + 2) / NT][(i + 2) % NT], acc[(i + 3) / NT][(i + 3) % NT]));
#endif
  for (; i < N; ++i) sums[i] = hsumw(acc[i / NT][i % NT]);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float sum = sums[r * NT + t];
      for (int64_t kk = k; kk < in; ++kk) sum += to_f32(arows[r][kk]) * xrows[t][kk];
      out[t * os + r] = add ? out[t * os + r] + sum : sum;
    }
}

// out[t * os + r] = <A row r, x row t> for R rows of A and NT tokens: every A vector loaded once is used
// for all NT tokens, and R * NT independent accumulators keep the FMA units busy (one dot product at a
// time is a single dependency chain, latency-bound).
template <typename W, int R, int NT>
static inline void shrink_block(const W* const* arows, const float* const* xrows, int64_t in, float* out,
                                int64_t os, int64_t ahead, bool add) {
  vfw acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = vfw{};
  int64_t k = 0;
  for (; k + VW <= in; k += VW) {
    vfw va[R];
    for (int r = 0; r < R; ++r) va[r] = ldw(arows[r] + k);
    // the rows R further on, one cache line (16 floats) at a time: the next block's A streams in while
    // this one computes (8 adapters x 4 tokens: 10.9-11.3 -> 10.3 ms for SmolLM2's 120 projections)
    // Into L2 (locality 2), here and in the expand: asked into L1, the lines stalled the loads in use
    // (Zen 4, the 8-adapter engine workload against base-only: 79% -> 82%, medians of 8 alternated pairs).
    if ((k & 15) == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(arows[r] + ahead + k, 0, 2);
    for (int t = 0; t < NT; ++t) {
      const vfw vx = ldw(xrows[t] + k);
      for (int r = 0; r < R; ++r) acc[r][t] += va[r] * vx;
    }
  }
  shrink_finish<W, R, NT>(acc, arows, xrows, k, in, out, os, add);
}

// The decode shape (up to 4 A rows x 4 tokens) with named accumulators, every vector loaded once per K
// step: NT + R loads per R * NT multiply-adds. The array form above compiles (GCC 12) to a load folded
// into every multiply-add, each A and x vector loaded once per use, and one accumulator spilled: at 4 x 4
// twice the loads the FMA rate allows, and the decode shrink ran at 40% of it (Zen 4).
template <typename W, int R, int NT>
static inline void shrink_block_named(const W* const* arows, const float* const* xrows, int64_t in, float* out,
                                      int64_t os, int64_t ahead, bool add) {
  static_assert(R <= 4 && NT <= 4, "up to 4 x 4");
  vfw c00{}, c01{}, c02{}, c03{}, c10{}, c11{}, c12{}, c13{}, c20{}, c21{}, c22{}, c23{}, c30{}, c31{}, c32{}, c33{};
  int64_t k = 0;
  for (; k + VW <= in; k += VW) {
    vfw x0{}, x1{}, x2{}, x3{};
    x0 = ldw(xrows[0] + k);
    LP_IN_REGISTER(x0);
    if constexpr (NT > 1) { x1 = ldw(xrows[1] + k); LP_IN_REGISTER(x1); }
    if constexpr (NT > 2) { x2 = ldw(xrows[2] + k); LP_IN_REGISTER(x2); }
    if constexpr (NT > 3) { x3 = ldw(xrows[3] + k); LP_IN_REGISTER(x3); }
    if ((k & 15) == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(arows[r] + ahead + k, 0, 2);
#define LP_SHRINK_ROW(r)                                   \
    if constexpr (R > r) {                                 \
      vfw a = ldw(arows[r] + k);                           \
      LP_IN_REGISTER(a);                                   \
      c##r##0 += a * x0;                                   \
      if constexpr (NT > 1) c##r##1 += a * x1;             \
      if constexpr (NT > 2) c##r##2 += a * x2;             \
      if constexpr (NT > 3) c##r##3 += a * x3;             \
    }
    LP_SHRINK_ROW(0) LP_SHRINK_ROW(1) LP_SHRINK_ROW(2) LP_SHRINK_ROW(3)
#undef LP_SHRINK_ROW
  }
  vfw acc[R][NT];
  const vfw all[4][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}, {c30, c31, c32, c33}};
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = all[r][t];
  shrink_finish<W, R, NT>(acc, arows, xrows, k, in, out, os, add);
}

// The prefill shape with AVX-512 (2 A rows x 8 tokens) the same way: 10 loads per 16 multiply-adds, where
// the array form loaded each x vector twice and spilled an accumulator (21 loads).
template <typename W>
static inline void shrink_block_2x8(const W* const* arows, const float* const* xrows, int64_t in, float* out,
                                    int64_t os, int64_t ahead, bool add) {
  vfw c00{}, c01{}, c02{}, c03{}, c04{}, c05{}, c06{}, c07{}, c10{}, c11{}, c12{}, c13{}, c14{}, c15{}, c16{}, c17{};
  int64_t k = 0;
  for (; k + VW <= in; k += VW) {
#define LP_X(t) vfw x##t = ldw(xrows[t] + k); LP_IN_REGISTER(x##t);
    LP_X(0) LP_X(1) LP_X(2) LP_X(3) LP_X(4) LP_X(5) LP_X(6) LP_X(7)
#undef LP_X
    if ((k & 15) == 0)
      for (int r = 0; r < 2; ++r) __builtin_prefetch(arows[r] + ahead + k, 0, 2);
#define LP_ROW(r)                                                                 \
    {                                                                             \
      vfw a = ldw(arows[r] + k);                                                  \
      LP_IN_REGISTER(a);                                                          \
      c##r##0 += a * x0; c##r##1 += a * x1; c##r##2 += a * x2; c##r##3 += a * x3; \
      c##r##4 += a * x4; c##r##5 += a * x5; c##r##6 += a * x6; c##r##7 += a * x7; \
    }
    LP_ROW(0) LP_ROW(1)
#undef LP_ROW
  }
  const vfw acc[2][8] = {{c00, c01, c02, c03, c04, c05, c06, c07}, {c10, c11, c12, c13, c14, c15, c16, c17}};
  shrink_finish<W, 2, 8>(acc, arows, xrows, k, in, out, os, add);
}

// The AVX2 prefill shape (2 A rows x 6 tokens): the two A vectors held in registers, each x vector loaded once
// and used for both rows: 8 loads per 12 multiply-adds, 12 accumulators.
template <typename W>
static inline void shrink_block_2x6(const W* const* arows, const float* const* xrows, int64_t in, float* out,
                                    int64_t os, int64_t ahead, bool add) {
  vfw c00{}, c01{}, c02{}, c03{}, c04{}, c05{}, c10{}, c11{}, c12{}, c13{}, c14{}, c15{};
  int64_t k = 0;
  for (; k + VW <= in; k += VW) {
    vfw a0 = ldw(arows[0] + k), a1 = ldw(arows[1] + k);
    LP_IN_REGISTER(a0);
    LP_IN_REGISTER(a1);
    if ((k & 15) == 0)
      for (int r = 0; r < 2; ++r) __builtin_prefetch(arows[r] + ahead + k, 0, 2);
#define LP_T(t) { vfw x = ldw(xrows[t] + k); LP_IN_REGISTER(x); c0##t += a0 * x; c1##t += a1 * x; }
    LP_T(0) LP_T(1) LP_T(2) LP_T(3) LP_T(4) LP_T(5)
#undef LP_T
  }
  const vfw acc[2][6] = {{c00, c01, c02, c03, c04, c05}, {c10, c11, c12, c13, c14, c15}};
  shrink_finish<W, 2, 6>(acc, arows, xrows, k, in, out, os, add);
}

// How far ahead (in weights) a decode block's A rows are prefetched, at least: the next block's rows alone are
// one row ahead in the one-row decode (2.3 KB for SmolLM2's 576 inputs), too little to cover the memory's
// latency at its rate; 8 KB ahead took the cold 8-adapter decode kernel over SmolLM2's 120 projections from
// 11.9-13.0 to 11.5-11.9 ms (medians of 30-40 alternated runs, 2 threads, Zen 4; 4 KB and 16-32 KB were
// between the two; AVX2 blocks of 2-4 rows, already 4.6-9 KB ahead, the same within noise).
constexpr int64_t DECODE_AHEAD = 2048;

// All `total` A rows (as1 apart) against NT tokens, R rows at a time.
template <typename W, int R, int NT>
static void shrink_rows(const W* a, int64_t as1, int64_t total, const float* const* xrows, int64_t in,
                        float* out, int64_t os, bool add = false) {
  int64_t j = 0;
  for (; j + R <= total; j += R) {
    const W* arows[R];
    for (int r = 0; r < R; ++r) arows[r] = a + (j + r) * as1;
    if constexpr (R <= 4 && NT <= 4)  // prefetched at least 8 KB ahead (see DECODE_AHEAD)
      shrink_block_named<W, R, NT>(arows, xrows, in, out + j, os, std::max<int64_t>(R * as1, DECODE_AHEAD), add);
    else if constexpr (R == 2 && NT == 8 && VW == 16)
      shrink_block_2x8<W>(arows, xrows, in, out + j, os, R * as1, add);
    else if constexpr (R == 2 && NT == 6)
      shrink_block_2x6<W>(arows, xrows, in, out + j, os, R * as1, add);
    else
      shrink_block<W, R, NT>(arows, xrows, in, out + j, os, R * as1, add);
  }
  for (; j < total; ++j) {
    const W* arow[1] = {a + j * as1};
    if constexpr (NT <= 4)
      shrink_block_named<W, 1, NT>(arow, xrows, in, out + j, os, as1, add);
    else
      shrink_block<W, 1, NT>(arow, xrows, in, out + j, os, as1, add);
  }
}

#ifdef __AVX512F__
constexpr int WIDE_ROWS = 4;  // 32 vector registers: 4 rows x 4 tokens of accumulators fit
#else
constexpr int WIDE_ROWS = 2;
#endif
// A decode piece's A rows stream from memory once per step. With AVX-512 and fp32 rows they go one at a
// time, so that each piece is read as a single stream, where blocks of up to four rows read four streams
// side by side: the 120 projections of an 8-adapter decode step from memory (Zen 5), 4 tokens per adapter
// 9.89 -> 9.19 ms on two threads and 14.24 -> 13.51 ms on one; 1, 2 and 3 tokens 4-7% faster too; with
// the weights in L3, the same within 0-6%. Half-precision rows measured no better that way (their widening
// is work the four-row blocks share), and a prefill piece's last tokens re-read rows already in cache.
template <typename W>
constexpr bool ONE_ROW_DECODE = VW == 16 && std::is_same<W, float>::value;

// Prefill pieces (more than four tokens) go eight tokens at a time with AVX-512: each weight vector loaded
// from L2 then serves eight tokens instead of four, with 16 accumulators (2 A rows or 2 B vectors). The 120
// projections of SmolLM2 over a 1572-token prefill with 8 adapters (Zen 5): 164 -> 115 ms; blocks of 6, 12
// or 16 tokens, or 24 accumulators, measured 11-26% slower than these. With AVX2's 16 registers, six tokens
// by 2 A rows or 2 B vectors (12 accumulators): 8 loads per 12 multiply-adds, where eight tokens by one row
// took 9 loads per 8 (1529-token prefill with 8 adapters, Zen 3: 497 -> 434 ms; five tokens 480 ms).
constexpr int PREFILL_TOKENS = VW == 16 ? 8 : 6;
constexpr int PREFILL_ROWS = 2;

// y[t][c] += sum over q < r of s[t][q] * B[q][c], for NT tokens and NC vectors of columns: the B vectors
// of a row are loaded once for all NT tokens, and the NT * NC accumulators stay in registers over the rank.
template <typename W, int NT, int NC>
static inline void expand_block(const W* b, int64_t bs1, int64_t r, const float* const* srows,
                                float* const* yrows, int64_t c0) {
  vfw acc[NT][NC];
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < NC; ++c) acc[t][c] = vfw{};
  for (int64_t q = 0; q < r; ++q) {
    vfw vb[NC];
    for (int c = 0; c < NC; ++c) vb[c] = ldw(b + q * bs1 + c0 + VW * c);
    for (int t = 0; t < NT; ++t) {
      const float sv = srows[t][q];
      for (int c = 0; c < NC; ++c) acc[t][c] += sv * vb[c];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < NC; ++c) {
      float* y = yrows[t] + c0 + VW * c;
      const vfw sum = ldw(y) + acc[t][c];
      std::memcpy(y, &sum, sizeof(sum));
    }
}

template <typename W, int NT>
static void expand_cols(const W* b, int64_t bs1, int64_t r, int64_t width, const float* const* srows,
                        float* const* yrows) {
  // NT * NC accumulators: 16 at most
  constexpr int NC = NT == PREFILL_TOKENS ? PREFILL_ROWS : NT <= 2 ? 4 : (WIDE_ROWS == 4 ? 4 : 2);
  int64_t c0 = 0;
  for (; c0 + VW * NC <= width; c0 += VW * NC) expand_block<W, NT, NC>(b, bs1, r, srows, yrows, c0);
  for (; c0 + VW <= width; c0 += VW) expand_block<W, NT, 1>(b, bs1, r, srows, yrows, c0);
  for (; c0 < width; ++c0)  // columns past the last full vector
    for (int t = 0; t < NT; ++t) {
      float sum = 0.f;
      for (int64_t q = 0; q < r; ++q) sum += srows[t][q] * to_f32(b[q * bs1 + c0]);
      yrows[t][c0] += sum;
    }
}

// y[t][c] += sum over q < r_s of s[t][roff_s + q] * B[q][c] for the columns c of each slice s: QR rows of B
// together (a row of B is contiguous across slices, so B streams front to back), every slice's columns of
// those rows in turn. Each output vector is loaded and stored once per QR rows: four rows instead of two
// took the cold 8-adapter decode kernel (120 projections, Zen 4) from 13.0-14.2 to 12.2-13.2 ms. A slice
// whose rank ends inside the QR rows repeats its last row pointer with a zero factor.
constexpr int QR = VW == 16 ? 4 : 2;  // QR x NT broadcast factors and QR row vectors in registers

template <typename W, int NT>
static void expand_rows(const W* b, int64_t bs1, int64_t rmax, const int32_t* rk, const int32_t* ro,
                        const int64_t* om, int64_t S, const float* const* srows, float* const* yrows) {
  for (int64_t q = 0; q < rmax; q += QR) {
    const W* bq = b + q * bs1;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r = rk[s];
      if (q >= r) continue;
      const int nv = static_cast<int>(std::min<int64_t>(QR, r - q));
      const W* br[QR];
      vfw sv[QR][NT];
      float f[QR][NT];
      for (int i = 0; i < QR; ++i) {
        br[i] = bq + (i < nv ? i : 0) * bs1;
        for (int t = 0; t < NT; ++t) {
          f[i][t] = i < nv ? srows[t][ro[s] + q + i] : 0.f;
          sv[i][t] = vfw{} + f[i][t];
        }
      }
      const int64_t c_begin = om[2 * s], c_end = c_begin + om[2 * s + 1];
      int64_t c = c_begin;
      for (; c + VW <= c_end; c += VW) {
        vfw v[QR];
        for (int i = 0; i < QR; ++i) v[i] = ldw(br[i] + c);
        // a line of each of the next QR rows: the next pass's rows stream in during this one (4 KB ahead in
        // the same rows reached mostly lines of the rows being read; cold decode kernel over 120 projections,
        // Zen 4: 18.9 -> 17.2 ms on one thread, 11.8 -> 11.4 ms on two)
        if ((c & 15) == 0)
          for (int i = 0; i < QR; ++i) __builtin_prefetch(br[i] + QR * bs1 + c, 0, 2);
        for (int t = 0; t < NT; ++t) {
          vfw sum = ldw(yrows[t] + c);
          for (int i = 0; i < QR; ++i) sum += sv[i][t] * v[i];
          std::memcpy(yrows[t] + c, &sum, sizeof(sum));
        }
      }
      for (; c < c_end; ++c)
        for (int t = 0; t < NT; ++t) {
          float sum = 0.f;
          for (int i = 0; i < QR; ++i) sum += f[i][t] * to_f32(br[i][c]);
          yrows[t][c] += sum;
        }
    }
  }
}

// a_ptrs / b_ptrs: int64 [num_slots], the address of each slot's A ([rank_total, in], rows `as1` floats
// apart) and B ([max rank, out], rows `bs1` apart); groups: int64 [G, 3] (slot, start, count);
// ranks / rank_offsets: int32 [num_slots, S]; out_meta: int64 [S, 2] (offset, size).
// y += expand(shrink(x)) for every group.
template <typename W>
static void lora_groups_impl(torch::Tensor y, torch::Tensor x, torch::Tensor a_ptrs, torch::Tensor b_ptrs,
                             int64_t as1, int64_t bs1, torch::Tensor sorted_ids, torch::Tensor groups,
                             torch::Tensor ranks, torch::Tensor rank_offsets, torch::Tensor out_meta,
                             torch::Tensor shrunk, int64_t min_parallel_cost) {
  const int64_t G = groups.size(0), S = ranks.size(1), in = x.size(1);
  const int64_t* g = groups.data_ptr<int64_t>();
  const int64_t* ids = sorted_ids.data_ptr<int64_t>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  const int32_t* ro = rank_offsets.data_ptr<int32_t>();
  const int64_t* om = out_meta.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const int64_t* ap = a_ptrs.data_ptr<int64_t>();
  const int64_t* bp = b_ptrs.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  float* sp = shrunk.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0), ss = shrunk.stride(0);

  // One piece of a group (some of an adapter's tokens): shrink, then expand. B is rank-major, so the
  // expand is AXPYs over contiguous output columns; every weight row is read once and reused for the
  // piece's tokens.
  auto run_piece = [&](int64_t slot, int64_t start, int64_t count) {
    int64_t total = 0;
    for (int64_t s = 0; s < S; ++s) total += rk[slot * S + s];
    if (total == 0 || ap[slot] == 0 || bp[slot] == 0) return;  // an empty slot: nothing to add
    // shrink: a prefill piece eight tokens at a time, the rest four at a time; each A block is read once per
    // block of tokens
    const W* abase = reinterpret_cast<const W*>(ap[slot]);
    // A block's x rows stay in L1 over every A row when they fit: wider inputs (SmolLM2's down projection,
    // 1536) go in blocks of at most 512 columns, each block's sums added to the previous ones (Zen 3, one
    // 192-token group of rank 32, 1536 -> 576, one thread, weights in cache: the call 59-61 -> 67-73 GFLOP/s).
    const int64_t kblocks = in > 768 ? (in + 511) / 512 : 1;
    const int64_t kc = ((in + kblocks - 1) / kblocks + VW - 1) / VW * VW;
    int64_t tb = 0;
    for (; count > 4 && tb + PREFILL_TOKENS <= count; tb += PREFILL_TOKENS) {
      const float* xrows[PREFILL_TOKENS];
      for (int64_t t = 0; t < PREFILL_TOKENS; ++t) xrows[t] = xp + ids[start + tb + t] * xs;
      // half-precision rows one at a time: with two, GCC kept the widened rows on the stack (fp16, 1572-token
      // prefill with 8 adapters, Zen 5: 172 -> 118 ms)
      constexpr int R = std::is_same<W, float>::value ? PREFILL_ROWS : 1;
      for (int64_t k0 = 0; k0 < in; k0 += kc) {
        const float* xk[PREFILL_TOKENS];
        for (int64_t t = 0; t < PREFILL_TOKENS; ++t) xk[t] = xrows[t] + k0;
        shrink_rows<W, R, PREFILL_TOKENS>(abase + k0, as1, total, xk, std::min(kc, in - k0),
                                          sp + (start + tb) * ss, ss, k0 > 0);
      }
    }
    for (int64_t t0 = tb; t0 < count; t0 += 4) {
      const float* xrows[4];
      const int64_t nt = std::min<int64_t>(4, count - t0);
      for (int64_t t = 0; t < nt; ++t) xrows[t] = xp + ids[start + t0 + t] * xs;
      float* o = sp + (start + t0) * ss;
      if (ONE_ROW_DECODE<W> && count <= 4) {
        switch (nt) {
          case 1: shrink_rows<W, 1, 1>(abase, as1, total, xrows, in, o, ss); break;
          case 2: shrink_rows<W, 1, 2>(abase, as1, total, xrows, in, o, ss); break;
          case 3: shrink_rows<W, 1, 3>(abase, as1, total, xrows, in, o, ss); break;
          default: shrink_rows<W, 1, 4>(abase, as1, total, xrows, in, o, ss); break;
        }
        continue;
      }
      switch (nt) {
        case 1: shrink_rows<W, 4, 1>(abase, as1, total, xrows, in, o, ss); break;
        case 2: shrink_rows<W, 4, 2>(abase, as1, total, xrows, in, o, ss); break;
        case 3: shrink_rows<W, WIDE_ROWS, 3>(abase, as1, total, xrows, in, o, ss); break;
        default: shrink_rows<W, WIDE_ROWS, 4>(abase, as1, total, xrows, in, o, ss); break;
      }
    }
    // expand. A decode piece (up to four tokens) reads B's rows in order, each whole across the slices that
    // still have rank left, so the adapter's B streams from memory front to back; rows go QR at a time
    // into the tokens' outputs, which stay in cache. (Walking down each column block instead touches
    // every rank row a few cache lines at a time, which the hardware prefetcher does not follow: 8
    // adapters x 4 tokens, 120 projections on a 2-core Xeon, 20.6-22.2 -> 16.9-19.1 ms per step.)
    if (count <= 4) {
      int64_t rmax = 0;
      for (int64_t s = 0; s < S; ++s) rmax = std::max<int64_t>(rmax, rk[slot * S + s]);
      const W* bslot = reinterpret_cast<const W*>(bp[slot]);
      const float* srows[4];
      float* yrows[4];
      for (int64_t t = 0; t < count; ++t) {
        srows[t] = sp + (start + t) * ss;
        yrows[t] = yp + ids[start + t] * ys;
      }
      switch (count) {
        case 1: expand_rows<W, 1>(bslot, bs1, rmax, rk + slot * S, ro + slot * S, om, S, srows, yrows); break;
        case 2: expand_rows<W, 2>(bslot, bs1, rmax, rk + slot * S, ro + slot * S, om, S, srows, yrows); break;
        case 3: expand_rows<W, 3>(bslot, bs1, rmax, rk + slot * S, ro + slot * S, om, S, srows, yrows); break;
        default: expand_rows<W, 4>(bslot, bs1, rmax, rk + slot * S, ro + slot * S, om, S, srows, yrows); break;
      }
      return;
    }
    // A larger piece (prefill) keeps a few vectors of output columns of eight tokens (then up to four) in
    // registers over the rank, slice by slice (the row walk above would load and store the outputs at
    // every row).
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r = rk[slot * S + s], roff = ro[slot * S + s];
      if (r == 0) continue;
      const W* bslice = reinterpret_cast<const W*>(bp[slot]) + om[2 * s];
      int64_t tb = 0;
      for (; tb + PREFILL_TOKENS <= count; tb += PREFILL_TOKENS) {
        const float* srows[PREFILL_TOKENS];
        float* yrows[PREFILL_TOKENS];
        for (int64_t t = 0; t < PREFILL_TOKENS; ++t) {
          srows[t] = sp + (start + tb + t) * ss + roff;
          yrows[t] = yp + ids[start + tb + t] * ys + om[2 * s];
        }
        expand_cols<W, PREFILL_TOKENS>(bslice, bs1, r, om[2 * s + 1], srows, yrows);
      }
      for (int64_t t0 = tb; t0 < count; t0 += 4) {
        const int64_t nt = std::min<int64_t>(4, count - t0);
        const float* srows[4];
        float* yrows[4];
        for (int64_t t = 0; t < nt; ++t) {
          srows[t] = sp + (start + t0 + t) * ss + roff;
          yrows[t] = yp + ids[start + t0 + t] * ys + om[2 * s];
        }
        switch (nt) {
          case 1: expand_cols<W, 1>(bslice, bs1, r, om[2 * s + 1], srows, yrows); break;
          case 2: expand_cols<W, 2>(bslice, bs1, r, om[2 * s + 1], srows, yrows); break;
          case 3: expand_cols<W, 3>(bslice, bs1, r, om[2 * s + 1], srows, yrows); break;
          default: expand_cols<W, 4>(bslice, bs1, r, om[2 * s + 1], srows, yrows); break;
        }
      }
    }
  };

  // Groups never share output rows, so threads take whole pieces of groups (a group of many tokens is cut
  // into pieces of at most PIECE tokens, so that one long prefill still uses every thread): one parallel
  // region per call and no barrier between shrink and expand (barriers are what hurts on a busy 2-core
  // machine). Threads take pieces largest first, as they free up.
  constexpr int64_t PIECE = 32;
  const int64_t out_total = om[2 * (S - 1)] + om[2 * (S - 1) + 1];
  struct Piece {
    int64_t cost, slot, start, count;
  };
  std::vector<Piece> pieces;
  int64_t total_cost = 0;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t slot = g[3 * i], start = g[3 * i + 1], count = g[3 * i + 2];
    int64_t r = 0;
    for (int64_t s = 0; s < S; ++s) r += rk[slot * S + s];
    for (int64_t t0 = 0; t0 < count; t0 += PIECE) {
      const int64_t n = std::min(PIECE, count - t0);
      pieces.push_back({n * r * (in + out_total), slot, start + t0, n});
      total_cost += pieces.back().cost;
    }
  }
  const int64_t P = static_cast<int64_t>(pieces.size());
  const int64_t bins = total_cost < min_parallel_cost ? 1 : std::min<int64_t>(at::get_num_threads(), P);
  if (bins <= 1) {
    for (const Piece& p : pieces) run_piece(p.slot, p.start, p.count);
    return;
  }
  // Largest first, each thread claiming the next piece as it finishes one (fixed shares of equal cost left
  // the faster thread waiting on a 2-core VM, whose two threads seldom run at the same speed).
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.cost > b.cost; });
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, bins, 1, [&](int64_t, int64_t) {
    for (int64_t i = claimed.fetch_add(1); i < P; i = claimed.fetch_add(1))
      run_piece(pieces[i].slot, pieces[i].start, pieces[i].count);
  });
}

// weight_dtype: 0 fp32, 1 fp16, 2 bf16 (the slots' A and B); everything else is fp32.
void lora_groups(torch::Tensor y, torch::Tensor x, torch::Tensor a_ptrs, torch::Tensor b_ptrs, int64_t as1,
                 int64_t bs1, int64_t weight_dtype, torch::Tensor sorted_ids, torch::Tensor groups,
                 torch::Tensor ranks, torch::Tensor rank_offsets, torch::Tensor out_meta, torch::Tensor shrunk,
                 int64_t min_parallel_cost) {
  switch (weight_dtype) {
    case 0: return lora_groups_impl<float>(y, x, a_ptrs, b_ptrs, as1, bs1, sorted_ids, groups, ranks,
                                           rank_offsets, out_meta, shrunk, min_parallel_cost);
    case 1: return lora_groups_impl<F16>(y, x, a_ptrs, b_ptrs, as1, bs1, sorted_ids, groups, ranks,
                                         rank_offsets, out_meta, shrunk, min_parallel_cost);
    case 2: return lora_groups_impl<BF16>(y, x, a_ptrs, b_ptrs, as1, bs1, sorted_ids, groups, ranks,
                                          rank_offsets, out_meta, shrunk, min_parallel_cost);
    default: TORCH_CHECK(false, "lora_groups: unknown weight dtype ", weight_dtype);
  }
}

// The address of `lora_groups`, for other extensions that run whole layers in C++ (ops_cpu's decoder_stack).
int64_t lora_groups_address() { return reinterpret_cast<int64_t>(&lora_groups); }
"""

EXTENSION_NAME = "loraplex_lora_cpu_v26"  # bump the suffix when the C++ source changes incompatibly
_EXTENSION = InlineExtension(
    EXTENSION_NAME, _SOURCE, ["lora_groups", "lora_groups_address"], what="CPU LoRA kernel",
)


def _load():
    return _EXTENSION.load()


def available() -> bool:
    return _load() is not None


def lora_groups_address() -> int | None:
    """The C address of `lora_groups`, for C++ that calls it directly; None without the kernel."""
    mod = _load()
    return None if mod is None else mod.lora_groups_address()


def _groups(batch: LoraBatch) -> torch.Tensor:
    """The step's groups as int64 [G, 3] (slot, start, count), built once per step for every projection."""
    cached = batch.scratch.get("cpu_groups")
    if cached is None:
        groups = list(zip(batch.slot_ids, batch.starts, batch.counts, strict=True))
        cached = batch.scratch["cpu_groups"] = torch.tensor(groups, dtype=torch.int64).reshape(-1, 3)
    return cached


class CpuLoraStep:
    """A step's LoRA calls on the kernel with what they share made once: the groups, and one buffer for the
    shrunk values as wide as the widest projection needs (the kernel reads its row stride). A decode step
    makes 120 of these calls for SmolLM2: their Python took 0.76 ms per step through `add_lora_cpu` (its
    checks, the groups lookup and an allocation per call) and takes 0.44 ms this way (Zen 4)."""

    __slots__ = ("_mod", "_ids", "_groups", "_shrunk", "_width")

    def __init__(self, mod, batch: LoraBatch, width: int):
        self._mod = mod
        self._ids = batch.sorted_token_ids
        self._groups = _groups(batch)
        self._width = width
        self._shrunk = torch.empty(batch.num_lora_tokens, width, dtype=torch.float32)

    @property
    def width(self) -> int:
        """The shrunk-values buffer's width: the most A rows a call of this step may have."""
        return self._width

    def step_tensors(self) -> list[torch.Tensor]:
        """What every call of the step shares: sorted token ids, groups, the shrunk-values buffer."""
        return [self._ids, self._groups, self._shrunk]

    def weight_code(self, w: LoraSlotWeights) -> int | None:
        """The kernel's code for the slot weights' dtype; None when the kernel does not take them."""
        code = _WEIGHT_DTYPES.get(w.dtype)
        if code is None or w.a_ptrs is None or w.a_rows > self._width:
            return None
        return code

    def __call__(self, y: torch.Tensor, x: torch.Tensor, w: LoraSlotWeights) -> bool:
        """y += the delta and True, or False (nothing done) when the call is not fp32 rows the kernel takes."""
        code = self.weight_code(w)
        if x.dtype is not _F32 or y.dtype is not _F32 or code is None or x.stride(-1) != 1 or y.stride(-1) != 1:
            return False
        self._mod.lora_groups(y, x, w.a_ptrs, w.b_ptrs, w.in_features, w.out_features, code, self._ids,
                              self._groups, w.ranks_t, w.rank_offsets_t, w.out_meta, self._shrunk,
                              MIN_PARALLEL_COST)
        return True


_F32 = torch.float32
# slot weight dtypes the kernel reads (widened to fp32 as they load), and its code for each
_WEIGHT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def cpu_lora_step(batch: LoraBatch, weights, width: int | None = None) -> CpuLoraStep | None:
    """The step's fast path for CPU slot weights (fp32, or fp16/bf16 with fp32 activations); None where the
    kernel is not available, the slots are not on the CPU or the step has no adapter tokens. `width`: the
    most A rows of any of `weights` (the owner may know it; otherwise found here)."""
    if batch.empty or not weights:
        return None
    first = next(iter(weights.values()))
    if first.device.type != "cpu" or first.dtype not in _WEIGHT_DTYPES:
        return None
    mod = _load()
    if mod is None:
        return None
    return CpuLoraStep(mod, batch, width if width is not None else max(w.a_rows for w in weights.values()))


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch) -> None:
    """y += each token's adapter delta; fp32 contiguous rows via the kernel, anything else via torch."""
    if batch.empty:
        return
    mod = _load()
    if mod is None or not CpuLoraStep(mod, batch, w.a_rows)(y, x, w):
        add_lora_torch(y, x, w, batch)
