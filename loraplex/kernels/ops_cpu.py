"""Fused CPU kernels for the decode step's work around the matmuls (fp32), compiled once per machine.

- paged decode attention: reads each sequence's K/V rows straight from its cache blocks (no gathered,
  padded copy) and handles a KV head's whole group of query heads together, so every K/V row is loaded
  once per group;
- residual add + RMSNorm in place, and RMSNorm alone;
- SiLU(gate) * up from the fused gate_up output, in one pass;
- Neox rotary embedding in place on the q/k part of the fused qkv output.

Each entry point returns None (or False) when it does not apply (another dtype, another device, an
unsupported layout, no compiler); the caller then runs its torch code, which is also the tests' oracle.
"""

from __future__ import annotations

import logging

import torch

from loraplex.kernels.cpp_build import InlineExtension

log = logging.getLogger(__name__)

# Below this many multiply-adds a call stays on one thread: waking the other costs more than it saves.
MIN_PARALLEL_COST = 200_000
# Elementwise kernels hand each thread at least this many elements.
MIN_PARALLEL_ELEMENTS = 65_536

_SOURCE = r"""
#include <torch/extension.h>
#include <atomic>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// exp(x) as a branch-free polynomial (Cephes expf, ~1 ulp on [-87, 88]) so that loops calling it
// vectorize; the input is clamped to [lo, hi] (ExpRange), so very negative x gives ~1e-38 rather than 0.
static inline float fast_exp(float x, float lo, float hi) {
  x = std::min(std::max(x, lo), hi);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// The clamp bounds for fast_exp, read through volatiles: with literal bounds the compiler folds exp() of
// a clamped input into a constant and splits the loop into per-case paths that vectorize badly.
struct ExpRange {
  float lo, hi;
};
static inline ExpRange exp_range() {
  static volatile float lo = -87.0f, hi = 88.3762626647949f;
  return {lo, hi};
}

// Eight floats as one value (GCC/Clang vector extension): one AVX register, two SSE/NEON registers.
typedef float vf8 __attribute__((vector_size(32)));

static inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof(v)); }

static inline float hsum8(vf8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

#if defined(__clang__) || __GNUC__ >= 12
#define LP_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t vi8 __attribute__((vector_size(32)));
#define LP_SHUF(a, b, ...) __builtin_shuffle(a, b, vi8{__VA_ARGS__})
#endif

// Pairwise sums within 128-bit halves, as x86's haddps: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, ...].
static inline vf8 hadd8(vf8 a, vf8 b) {
  return LP_SHUF(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + LP_SHUF(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The horizontal sums of eight vectors, as one vector: [sum(a[0]), ..., sum(a[7])].
static inline vf8 hsum8x8(const vf8* a) {
  const vf8 q0 = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3]));
  const vf8 q1 = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
  return LP_SHUF(q0, q1, 0, 1, 2, 3, 8, 9, 10, 11) + LP_SHUF(q0, q1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scores of up to eight consecutive key rows (`n` of them stored) against one query, D a multiple of 8
// handled by the vectors and the rest by a scalar tail. All eight rows must be readable.
static inline void dots8(const float* __restrict qg, const float* __restrict k, int64_t ks, int64_t D, int64_t n,
                         float* __restrict s) {
  const int64_t D8 = D & ~int64_t(7);
  vf8 a[8] = {};
  for (int64_t d = 0; d < D8; d += 8) {
    const vf8 qv = load8(qg + d);
    for (int r = 0; r < 8; ++r) a[r] += qv * load8(k + r * ks + d);
  }
  float out[8];
  store8(out, hsum8x8(a));
  for (int64_t r = 0; r < n; ++r) {
    float t = out[r];
    for (int64_t d = D8; d < D; ++d) t += qg[d] * k[r * ks + d];
    s[r] = t;
  }
}

// dots8 for G query heads at once (scores of head g at s + g * ls): each key vector is loaded once for
// all G heads. G * 8 accumulators: with AVX-512's 32 vector registers, up to G = 3.
template <int G>
static inline void dots8g(const float* __restrict q, const float* __restrict k, int64_t ks, int64_t D, int64_t n,
                          float* __restrict s, int64_t ls) {
  const int64_t D8 = D & ~int64_t(7);
  vf8 a[G][8] = {};
  for (int64_t d = 0; d < D8; d += 8) {
    vf8 qv[G];
    for (int g = 0; g < G; ++g) qv[g] = load8(q + g * D + d);
    for (int r = 0; r < 8; ++r) {
      const vf8 kv = load8(k + r * ks + d);
      for (int g = 0; g < G; ++g) a[g][r] += qv[g] * kv;
    }
  }
  for (int g = 0; g < G; ++g) {
    float out[8];
    store8(out, hsum8x8(a[g]));
    for (int64_t r = 0; r < n; ++r) {
      float t = out[r];
      for (int64_t d = D8; d < D; ++d) t += q[g * D + d] * k[r * ks + d];
      s[g * ls + r] = t;
    }
  }
}

static inline float dot1(const float* __restrict qg, const float* __restrict k, int64_t D) {
  const int64_t D8 = D & ~int64_t(7);
  vf8 a{};
  for (int64_t d = 0; d < D8; d += 8) a += load8(qg + d) * load8(k + d);
  float t = hsum8(a);
  for (int64_t d = D8; d < D; ++d) t += qg[d] * k[d];
  return t;
}

// out[g][d0 : d0 + W * NC] = sum over the context of p[g][t] * V[t][...], W the floats of a vector of type
// VT, NC vectors per query head kept in registers across all rows (G * NC independent accumulators).
// The loops over g and c are unrolled by pragma: left to itself GCC kept the 8-wide accumulators
// on the stack (a 2-core Zen 3: 30 layers' decode attention 17.8 -> 13.4 ms from cold caches).
template <typename VT, int G, int NC>
static inline void weighted_values(const float* __restrict p, int64_t L, const float* vh, int64_t vs1,
                                   int64_t vs2, const int64_t* table, int64_t BS, int64_t d0,
                                   float* __restrict out, int64_t os) {
  constexpr int W = sizeof(VT) / sizeof(float);
  VT acc[G][NC];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[g][c] = VT{};
  for (int64_t j = 0, t0 = 0; t0 < L; ++j, t0 += BS) {
    const float* vb = vh + table[j] * vs1 + d0;
    const int64_t n = std::min(BS, L - t0);
    for (int64_t i = 0; i < n; ++i) {
      const float* vrow = vb + i * vs2;
      VT v[NC];
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) std::memcpy(&v[c], vrow + W * c, sizeof(VT));
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const float pg = p[g * L + t0 + i];
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) acc[g][c] += pg * v[c];
      }
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) std::memcpy(out + g * os + d0 + W * c, &acc[g][c], sizeof(VT));
}

#ifdef __AVX512F__
// Sixteen floats (one AVX-512 register): weighted_values with half the instructions per row.
typedef float vf16 __attribute__((vector_size(64)));
#endif

// Into L2 (locality 2), not L1: a block's 64 lines asked into L1 at once stall the loads that compute the
// scores (on Zen 4, 30 layers' decode attention from cold caches took 11.6-11.9 ms that way, 9.2-9.4 so).
static inline void prefetch_rows(const float* base, int64_t n, int64_t stride, int64_t D) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(base + i * stride + d, 0, 2);
}

// Decode attention for one sequence and one KV head, for G (1..4) of its query heads. q: [G, D], already
// scaled; kh/vh: this KV head's cache, its rows found through `table`; scores: [G, L] scratch; out: the
// G heads' outputs, `os` apart. The first `skip` rows (outside a sliding window that starts inside the
// first block) are scored but weigh exactly 0.
//
// Keys: eight rows at a time per query (eight accumulators, reduced together into eight contiguous
// scores). Values: the output is built a few vectors wide in registers over all rows, so accumulators
// never go through memory. Softmax in between, in fp32 with the maximum subtracted.
template <int G>
static void attend_group(const float* __restrict q, const float* kh, int64_t ks1, int64_t ks2, const float* vh,
                         int64_t vs1, int64_t vs2, const int64_t* table, int64_t BS, int64_t L, int64_t D,
                         int64_t skip, float* __restrict scores, float* __restrict out, int64_t os, ExpRange er) {
  for (int64_t j = 0, t0 = 0; t0 < L; ++j, t0 += BS) {
    const float* kb = kh + table[j] * ks1;
    const int64_t n = std::min(BS, L - t0);
    // Blocks are scattered runs of a few KB that the hardware prefetchers cannot foresee: ask for the next
    // key block, and this block's values (read after the softmax), while this block's scores compute.
    if (t0 + BS < L) prefetch_rows(kh + table[j + 1] * ks1, std::min(BS, L - t0 - BS), ks2, D);
    prefetch_rows(vh + table[j] * vs1, n, vs2, D);
    int64_t i = 0;
    for (; i < n && i + 8 <= BS; i += 8) {  // rows past the context are read, not used
#ifdef __AVX512F__
      if constexpr (G <= 3) {
        dots8g<G>(q, kb + i * ks2, ks2, D, std::min<int64_t>(8, n - i), scores + t0 + i, L);
        continue;
      }
#endif
      for (int g = 0; g < G; ++g)
        dots8(q + g * D, kb + i * ks2, ks2, D, std::min<int64_t>(8, n - i), scores + g * L + t0 + i);
    }
    for (; i < n; ++i)
      for (int g = 0; g < G; ++g) scores[g * L + t0 + i] = dot1(q + g * D, kb + i * ks2, D);
  }

  const int64_t n = L - skip;  // the rows that count
  for (int g = 0; g < G; ++g) {
    std::fill(scores + g * L, scores + g * L + skip, 0.f);
    float* s = scores + g * L + skip;
    float m = s[0];  // the maximum eight lanes at a time (a scalar loop otherwise: 7% of the kernel)
    int64_t t8 = 0;
    if (n >= 8) {
      vf8 m8 = load8(s);
      for (t8 = 8; t8 + 8 <= n; t8 += 8) {
        const vf8 v = load8(s + t8);
        m8 = m8 > v ? m8 : v;
      }
      for (int r = 0; r < 8; ++r) m = std::max(m, m8[r]);
    }
    for (int64_t t = t8; t < n; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t t = 0; t < n; ++t) {
      const float e = fast_exp(s[t] - m, er.lo, er.hi);
      s[t] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    #pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }

  // Wide chunks keep about 8-12 accumulator chains in flight: enough to hide FMA latency, few enough
  // for 16 vector registers.
  constexpr int NC = G == 1 ? 8 : G == 4 ? 2 : 4;
  int64_t d0 = 0;
#ifdef __AVX512F__
  constexpr int NC16 = G == 4 ? 2 : 4;  // G * NC16 accumulators and NC16 value vectors in 32 registers
  for (; d0 + 16 * NC16 <= D; d0 += 16 * NC16)
    weighted_values<vf16, G, NC16>(scores, L, vh, vs1, vs2, table, BS, d0, out, os);
  for (; d0 + 16 <= D; d0 += 16) weighted_values<vf16, G, 1>(scores, L, vh, vs1, vs2, table, BS, d0, out, os);
#endif
  for (; d0 + 8 * NC <= D; d0 += 8 * NC) weighted_values<vf8, G, NC>(scores, L, vh, vs1, vs2, table, BS, d0, out, os);
  for (; d0 + 8 <= D; d0 += 8) weighted_values<vf8, G, 1>(scores, L, vh, vs1, vs2, table, BS, d0, out, os);
  if (d0 < D) {  // head_dim not a multiple of 8: the last columns one at a time
    for (int g = 0; g < G; ++g) std::fill(out + g * os + d0, out + g * os + D, 0.f);
    for (int64_t j = 0, t0 = 0; t0 < L; ++j, t0 += BS) {
      const float* vb = vh + table[j] * vs1;
      const int64_t n = std::min(BS, L - t0);
      for (int64_t i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) {
          const float pg = scores[g * L + t0 + i];
          for (int64_t d = d0; d < D; ++d) out[g * os + d] += pg * vb[i * vs2 + d];
        }
    }
  }
}

}  // namespace

// q [B, H, D] (last dim contiguous); caches [Hkv, num_blocks, block_size, D]; block_tables int64 [B, W];
// context_lens int64 [B]. Returns out [B, H, D]: softmax(q K^T * scale) V over each sequence's tokens, or
// with window > 0 over its last `window` tokens only (sliding-window attention: the query at position L - 1
// sees keys at positions L - window .. L - 1); blocks wholly before the window are never read.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t min_parallel_cost, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k/v cache shapes differ");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && context_lens.dim() == 1, "bad tables");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && H % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch sizes differ");
  const int64_t G = H / Hkv, W = block_tables.size(1);
  auto out = torch::empty({B, H, D}, q.options());
  if (B == 0 || H == 0) return out;

  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t ts = block_tables.stride(0), ls = context_lens.stride(0);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: the whole context)");
  // The first block a sequence of L tokens reads: the one holding the window's first position.
  auto first_block = [&](int64_t L) { return window > 0 ? std::max<int64_t>(0, L - window) / BS : 0; };
  int64_t max_len = 0, total_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens[b * ls];
    TORCH_CHECK(L >= 0 && L <= W * BS, "context length ", L, " does not fit the block table");
    const int64_t j0 = first_block(L);
    for (int64_t j = j0; j < (L + BS - 1) / BS; ++j) {
      const int64_t blk = tables[b * ts + j];
      TORCH_CHECK(blk >= 0 && blk < NB, "block id ", blk, " out of range");
    }
    max_len = std::max(max_len, L - j0 * BS);
    total_len += L - j0 * BS;
  }

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float sc = static_cast<float>(scale);
  const ExpRange er = exp_range();

  // One work item per (sequence, kv head): its query heads in chunks of up to 4.
  auto run_item = [&](int64_t item, float* qbuf, float* scores) {
    const int64_t b = item / Hkv, h = item % Hkv;
    const int64_t full = lens[b * ls], j0 = first_block(full);
    const int64_t L = full - j0 * BS;  // the rows read: from the first block the window touches
    const int64_t skip = window > 0 ? std::max<int64_t>(0, full - window) - j0 * BS : 0;
    float* o = op + (b * H + h * G) * D;
    if (L == 0) {
      std::fill(o, o + G * D, 0.f);
      return;
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qp + b * qs0 + (h * G + g) * qs1;
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) qbuf[g * D + d] = qg[d] * sc;
    }
    const int64_t* table = tables + b * ts + j0;
    const float* kh = kp + h * ks0;
    const float* vh = vp + h * vs0;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* qc = qbuf + g0 * D;
      float* oc = o + g0 * D;
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: attend_group<1>(qc, kh, ks1, ks2, vh, vs1, vs2, table, BS, L, D, skip, scores, oc, D, er); break;
        case 2: attend_group<2>(qc, kh, ks1, ks2, vh, vs1, vs2, table, BS, L, D, skip, scores, oc, D, er); break;
        case 3: attend_group<3>(qc, kh, ks1, ks2, vh, vs1, vs2, table, BS, L, D, skip, scores, oc, D, er); break;
        default: attend_group<4>(qc, kh, ks1, ks2, vh, vs1, vs2, table, BS, L, D, skip, scores, oc, D, er); break;
      }
    }
  };

  // Threads claim items a few at a time as they go (rather than fixed runs of equal cost: on a 2-core VM
  // the two threads seldom run at the same speed, and with fixed runs the faster waited at the end).
  const int64_t items = B * Hkv;
  const int64_t work = total_len * H * D * 2;
  const int64_t threads = work < min_parallel_cost ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  const int64_t chunk = std::max<int64_t>(1, items / (threads * 8));
  std::atomic<int64_t> claimed{0};
  auto run_items = [&](int64_t, int64_t) {
    std::vector<float> buf(G * D + 4 * std::max<int64_t>(max_len, 1));
    float* qbuf = buf.data();
    float* scores = qbuf + G * D;
    for (int64_t i0 = claimed.fetch_add(chunk); i0 < items; i0 = claimed.fetch_add(chunk))
      for (int64_t i = i0; i < std::min(items, i0 + chunk); ++i) run_item(i, qbuf, scores);
  };
  if (threads <= 1)
    run_items(0, 1);
  else
    at::parallel_for(0, threads, 1, run_items);
  return out;
}

static inline int64_t row_grain(int64_t width, int64_t min_elements) {
  return std::max<int64_t>(1, (min_elements + width - 1) / std::max<int64_t>(width, 1));
}

// residual += x; x = residual * rsqrt(mean(residual^2) + eps) * weight. x, residual: [T, N] rows
// contiguous; fp32 throughout.
void fused_add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps,
                         int64_t min_elements) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && x.stride(1) == 1 && residual.stride(1) == 1,
              "bad shapes");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.numel() == N && weight.is_contiguous(), "bad weight");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, row_grain(N, min_elements), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict xr = xp + t * xs;
      float* __restrict rr = rp + t * rs;
      float ss = 0.f;
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < N; ++i) {
        const float v = rr[i] + xr[i];
        rr[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + e);
      #pragma omp simd
      for (int64_t i = 0; i < N; ++i) xr[i] = (rr[i] * inv) * wp[i];
    }
  });
}

// out = x * rsqrt(mean(x^2) + eps) * weight; x, out: [T, N] rows contiguous.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps, int64_t min_elements) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && x.stride(1) == 1 && out.stride(1) == 1, "bad shapes");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.numel() == N && weight.is_contiguous(), "bad weight");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, row_grain(N, min_elements), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict xr = xp + t * xs;
      float* __restrict orow = op + t * os;
      float ss = 0.f;
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + e);
      #pragma omp simd
      for (int64_t i = 0; i < N; ++i) orow[i] = (xr[i] * inv) * wp[i];
    }
  });
}

// out [T, I] = silu(x[:, :I]) * x[:, I:], x: [T, 2I].
void silu_and_mul(torch::Tensor out, torch::Tensor x, int64_t min_elements) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "bad shapes");
  const int64_t T = x.size(0), I = out.size(1);
  TORCH_CHECK(out.size(0) == T && x.size(1) == 2 * I, "bad shapes");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const ExpRange er = exp_range();
  at::parallel_for(0, T, row_grain(I, min_elements), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict gate = xp + t * xs;
      const float* __restrict up = gate + I;
      float* __restrict orow = op + t * os;
      #pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float g = gate[i];
        orow[i] = g / (1.f + fast_exp(-g, er.lo, er.hi)) * up[i];
      }
    }
  });
}

// Neox rotary in place: x [T, heads, D] (D contiguous), cos/sin [T, 1, D/2] (last dim contiguous).
// k_cache/v_cache [Hkv, num_blocks, block_size, D] (contiguous); k/v [T, Hkv, D] (rows of D contiguous);
// slots int64 [T]: token t's K/V go to slot slots[t] (block * block_size + offset) of every head.
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
               torch::Tensor slots) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              v_cache.is_contiguous(), "write_kv_: caches must be contiguous [Hkv, blocks, block_size, D]");
  const int64_t Hkv = k_cache.size(0), S = k_cache.size(1) * k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == Hkv && k.size(2) == D &&
              k.stride(2) == 1 && v.stride(2) == 1, "write_kv_: k/v must be [T, Hkv, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong,
              "write_kv_: one int64 slot per token");
  const int64_t T = k.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t * slots.stride(0)] >= 0 && sl[t * slots.stride(0)] < S,
                                              "write_kv_: slot ", sl[t * slots.stride(0)], " out of range");
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1), ss = slots.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sl[t * ss];
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kc + (h * S + slot) * D, kp + t * k0 + h * k1, D * sizeof(float));
      std::memcpy(vc + (h * S + slot) * D, vp + t * v0 + h * v1, D * sizeof(float));
    }
  }
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t min_elements) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos.dim() == 3 && sin.dim() == 3, "bad shapes");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == T && sin.size(0) == T && cos.size(2) == half && sin.size(2) == half
                  && cos.stride(2) == 1 && sin.stride(2) == 1, "bad cos/sin");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, row_grain(NH * D, min_elements), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict c = cp + t * cs;
      const float* __restrict s = sp + t * ss;
      for (int64_t h = 0; h < NH; ++h) {
        float* __restrict x1 = xp + t * xs0 + h * xs1;
        float* __restrict x2 = x1 + half;
        #pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// ---- a Llama-family decoder stack in one call ----------------------------------------------------------
// The model's per-layer Python (module calls, slicing, each wrapper's checks) is about a tenth of a decode
// step of a small model; here the same kernels run in the same order with the same arguments, so the
// results are those of the module path bit for bit. The GEMM and the LoRA kernel live in their own
// extensions and are called through their addresses (`linear_address`, `lora_groups_address`).
using LinearFn = torch::Tensor (*)(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>, int64_t);
using LoraFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                        torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                        int64_t);

// x [T, hidden]: the step's embeddings (used as the first residual, overwritten); cos/sin [T, 1, rotary_dim/2].
// layers: 6 per layer: input norm weight, qkv panels, o panels, post-attention norm weight, gate_up panels,
//   down panels. biases: none, or 4 per layer (qkv, o, gate_up, down), an empty tensor where that projection
//   has none. caches: k and v per layer [Hkv, blocks, block_size, D].
// qk_norms: none, or 2 per layer: the per-head RMSNorm weights [D] of q and of k (Qwen3), applied before the
//   rotation with the same eps as the other norms.
// sizes: num_heads, num_kv_heads, head_dim, hidden, intermediate, rotary_dim (the leading dims of each head
//   that rotate: head_dim, or less with a partial_rotary_factor). slots [T]: where each token's K/V go;
//   tables [T, W] / lens [T]: every row's blocks and context length (the attention kernel's arguments).
// lora: none, or 5 per projection (a_ptrs, b_ptrs, ranks, rank_offsets, out_meta), 4 projections per layer
//   (qkv, o, gate_up, down), lora_dims 3 per projection (in_features, out_features, weight dtype code) and
//   lora_shared: sorted token ids, groups, the shrunk-values buffer.
// limits: GEMM, attention and LoRA minimum parallel cost, elementwise minimum elements.
// windows: none, or one per layer: its sliding window (0: the whole context).
// Returns the final norm's output [T, hidden].
torch::Tensor decoder_stack(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> layers,
                            std::vector<torch::Tensor> biases, std::vector<torch::Tensor> caches,
                            torch::Tensor final_norm, std::vector<int64_t> sizes, double eps, double scale,
                            torch::Tensor slots, torch::Tensor tables, torch::Tensor lens,
                            std::vector<torch::Tensor> lora, std::vector<int64_t> lora_dims,
                            std::vector<torch::Tensor> lora_shared, int64_t linear_fn, int64_t lora_fn,
                            std::vector<int64_t> limits, std::vector<int64_t> windows,
                            std::vector<torch::Tensor> qk_norms) {
  TORCH_CHECK(sizes.size() == 6 && limits.size() == 4, "decoder_stack: sizes and limits");
  TORCH_CHECK(layers.size() % 6 == 0 && !layers.empty(), "decoder_stack: 6 tensors per layer");
  const int64_t L = static_cast<int64_t>(layers.size() / 6);
  TORCH_CHECK(windows.empty() || windows.size() == static_cast<size_t>(L), "decoder_stack: one window per layer");
  TORCH_CHECK(caches.size() == static_cast<size_t>(2 * L), "decoder_stack: k and v caches per layer");
  TORCH_CHECK(biases.empty() || biases.size() == static_cast<size_t>(4 * L), "decoder_stack: 4 biases per layer");
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == static_cast<size_t>(2 * L), "decoder_stack: q/k norms");
  const bool has_lora = !lora.empty();
  TORCH_CHECK(!has_lora || (lora.size() == static_cast<size_t>(20 * L) && lora_dims.size() == static_cast<size_t>(12 * L)
                            && lora_shared.size() == 3 && lora_fn != 0), "decoder_stack: LoRA arguments");
  TORCH_CHECK(linear_fn != 0, "decoder_stack: no GEMM");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "decoder_stack: x [T, hidden] fp32");
  const auto linear = reinterpret_cast<LinearFn>(linear_fn);
  const auto lora_groups = reinterpret_cast<LoraFn>(lora_fn);
  const int64_t H = sizes[0], Hkv = sizes[1], D = sizes[2], hidden = sizes[3], inter = sizes[4], RD = sizes[5];
  TORCH_CHECK(RD > 0 && RD <= D && RD % 2 == 0, "decoder_stack: rotary_dim must be even, in 1..head_dim");
  const int64_t T = x.size(0), q_end = H * D, k_end = q_end + Hkv * D, qkv_n = k_end + Hkv * D;
  const int64_t gemm_cost = limits[0], attn_cost = limits[1], lora_cost = limits[2], elems = limits[3];
  auto add_lora = [&](int64_t layer, int64_t proj, torch::Tensor& y, const torch::Tensor& in) {
    if (!has_lora) return;
    const int64_t p = layer * 4 + proj;
    const torch::Tensor* w = &lora[p * 5];
    const int64_t* d = &lora_dims[p * 3];
    lora_groups(y, in, w[0], w[1], d[0], d[1], d[2], lora_shared[0], lora_shared[1], w[2], w[3], w[4],
                lora_shared[2], lora_cost);
  };
  auto bias_of = [&](int64_t layer, int64_t proj) -> c10::optional<torch::Tensor> {
    if (biases.empty() || biases[layer * 4 + proj].numel() == 0) return c10::nullopt;
    return biases[layer * 4 + proj];
  };
  // Qwen3's per-head norm, as the module path runs it: the heads copied out of the qkv rows, normed into a new
  // [T, heads, D] tensor.
  auto head_norm = [&](const torch::Tensor& qkv, int64_t start, int64_t heads, const torch::Tensor& weight) {
    torch::Tensor out = torch::empty({T * heads, D}, x.options());
    rms_norm(out, qkv.narrow(1, start, heads * D).reshape({T * heads, D}), weight, eps, elems);
    return out.view({T, heads, D});
  };
  torch::Tensor residual = x;
  torch::Tensor h;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &layers[l * 6];
    if (l == 0) {
      h = torch::empty_like(x);
      rms_norm(h, x, w[0], eps, elems);
    } else {
      fused_add_rms_norm_(h, residual, w[0], eps, elems);
    }
    torch::Tensor qkv = linear(h, w[1], qkv_n, bias_of(l, 0), gemm_cost);
    add_lora(l, 0, qkv, h);
    torch::Tensor q, k;
    if (!qk_norms.empty()) {
      q = head_norm(qkv, 0, H, qk_norms[2 * l]);
      k = head_norm(qkv, q_end, Hkv, qk_norms[2 * l + 1]);
      rotary_(q.narrow(2, 0, RD), cos, sin, elems);
      rotary_(k.narrow(2, 0, RD), cos, sin, elems);
    } else {
      rotary_(qkv.narrow(1, 0, k_end).view({T, H + Hkv, D}).narrow(2, 0, RD), cos, sin, elems);
      q = qkv.narrow(1, 0, q_end).view({T, H, D});
      k = qkv.narrow(1, q_end, Hkv * D).view({T, Hkv, D});
    }
    torch::Tensor v = qkv.narrow(1, k_end, Hkv * D).view({T, Hkv, D});
    const torch::Tensor& kc = caches[2 * l];
    const torch::Tensor& vc = caches[2 * l + 1];
    write_kv_(kc, vc, k, v, slots);
    torch::Tensor attn = paged_decode_attention(q, kc, vc, tables, lens, scale, attn_cost,
                                                windows.empty() ? 0 : windows[l]).reshape({T, q_end});
    torch::Tensor o = linear(attn, w[2], hidden, bias_of(l, 1), gemm_cost);
    add_lora(l, 1, o, attn);
    fused_add_rms_norm_(o, residual, w[3], eps, elems);
    torch::Tensor gate_up = linear(o, w[4], 2 * inter, bias_of(l, 2), gemm_cost);
    add_lora(l, 2, gate_up, o);
    torch::Tensor act = torch::empty({T, inter}, x.options());
    silu_and_mul(act, gate_up, elems);
    h = linear(act, w[5], hidden, bias_of(l, 3), gemm_cost);
    add_lora(l, 3, h, act);
  }
  fused_add_rms_norm_(h, residual, final_norm, eps, elems);
  return h;
}
"""

_FUNCTIONS = [
    "paged_decode_attention", "fused_add_rms_norm_", "rms_norm", "silu_and_mul", "rotary_", "write_kv_", "decoder_stack",
]

EXTENSION_NAME = "loraplex_ops_cpu_v12"  # bump the suffix when the C++ source changes incompatibly
_EXTENSION = InlineExtension(
    EXTENSION_NAME, _SOURCE, _FUNCTIONS, what="CPU fused ops",
    # no-trapping-math: lets the clamps in fast_exp become vector min/max (nothing reads FP flags)
    extra_cflags=["-fno-trapping-math"],
)


def _load():
    return _EXTENSION.load()


def available() -> bool:
    return _load() is not None


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu


def write_kv_(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Store new keys/values [T, Hkv, D] at their cache slots in one pass; False when it does not apply
    (not fp32 on CPU, a layout the kernel does not take, no compiler): the caller's torch code runs."""
    if not (_fp32_cpu(k_cache) and _fp32_cpu(v_cache) and _fp32_cpu(k) and _fp32_cpu(v)):
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k.dim() == 3 and k.stride(-1) == 1
            and v.dim() == 3 and v.stride(-1) == 1 and slot_mapping.dtype == torch.int64 and not slot_mapping.is_cuda):
        return False
    mod = _load()
    if mod is None:
        return False
    mod.write_kv_(k_cache, v_cache, k, v, slot_mapping)
    return True


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor | None:
    """Decode attention read straight from the paged cache: q [B, H, D] -> [B, H, D], over each row's last
    `window` tokens when a window is given; None when it does not apply (not fp32 on CPU, head_dim not
    contiguous, no compiler)."""
    if not (_fp32_cpu(q) and _fp32_cpu(k_cache) and _fp32_cpu(v_cache)):
        return None
    if q.dim() != 3 or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return None
    if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64 or block_tables.stride(-1) != 1:
        return None
    mod = _load()
    if mod is None:
        return None
    return mod.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, MIN_PARALLEL_COST,
                                      window or 0)


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """residual += x, then x = rmsnorm(residual) * weight, both in place. False (nothing done) when it
    does not apply."""
    if not (_fp32_cpu(x) and _fp32_cpu(residual) and _fp32_cpu(weight)):
        return False
    if not (_rows(x) and _rows(residual)) or x.shape != residual.shape or not weight.is_contiguous():
        return False
    mod = _load()
    if mod is None:
        return False
    mod.fused_add_rms_norm_(x, residual, weight, eps, MIN_PARALLEL_ELEMENTS)
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """rmsnorm(x) * weight into a new tensor; None when it does not apply."""
    if not (_fp32_cpu(x) and _fp32_cpu(weight)) or not _rows(x) or not weight.is_contiguous():
        return None
    mod = _load()
    if mod is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    mod.rms_norm(out, x, weight, eps, MIN_PARALLEL_ELEMENTS)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[:, :I]) * x[:, I:] for the fused gate_up output x [T, 2I] -> [T, I]; None when it does not
    apply."""
    if not _fp32_cpu(x) or not _rows(x) or x.shape[1] % 2:
        return None
    mod = _load()
    if mod is None:
        return None
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    mod.silu_and_mul(out, x, MIN_PARALLEL_ELEMENTS)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Neox rotation of x [T, heads, D] in place with cos/sin [T, 1, D/2]; False when it does not apply."""
    if not (_fp32_cpu(x) and _fp32_cpu(cos) and _fp32_cpu(sin)):
        return False
    if x.dim() != 3 or x.stride(2) != 1 or cos.dim() != 3 or cos.stride(2) != 1 or sin.stride(2) != 1:
        return False
    mod = _load()
    if mod is None:
        return False
    mod.rotary_(x, cos, sin, MIN_PARALLEL_ELEMENTS)
    return True


def decoder_stack(*args) -> torch.Tensor:
    """A step's decoder layers in one call; see `DecoderStack` (loraplex.engine.models.llama) for the arguments'
    meaning, and the C++ above for their layout."""
    return _load().decoder_stack(*args)
