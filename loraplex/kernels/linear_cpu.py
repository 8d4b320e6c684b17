"""Projections on the CPU with weights pre-packed once at load time (fp32).

Two packed forms, chosen per machine:

- loraplex's own GEMM (`loraplex_linear_cpu`, compiled on first use with `-march=native`), built for
  AVX-512 or for AVX2 with FMA. The weight [out, in] is stored as panels of two vector registers of
  output columns (32 with AVX-512, 16 with AVX2), each panel [in, width] contiguous, so a panel streams
  from memory as one sequential run. A decode step multiplies a few dozen rows by every weight once: the
  kernel keeps up to 12 rows (AVX-512; 6 with AVX2's 16 registers) x 2 registers of accumulators and
  walks each panel once per row block (the first pass from memory, the rest from cache), prefetching the
  next panel meanwhile. Larger batches (prefill) are cut into row chunks, packed so that a K step's rows
  sit together, and K blocks; or, where the BLAS GEMM measures faster at engine start (MKL on Intel
  processors: 15-28% at 1529 rows), the panels are copied out into a plain transposed weight for it.
  On a 2-core Zen 4 with 32 rows this ran the SmolLM2-135M decode step's projections and LM head in
  42-43 ms against oneDNN's 50-52 ms; on a 2-core Zen 3 (AVX2) in 53-57 ms against 90 ms
  (bench/RESULTS.md).
- oneDNN's inner product on its own blocked layout, where the build has neither AVX-512 nor AVX2 (its
  kernels pick the best ISA at run time) or no compiler exists.

The packed copy replaces the plain one for the forward pass; results agree with `F.linear` to fp32
rounding. Only fp32 CPU weights are packed; everything else keeps `F.linear`. `LORAPLEX_CPU_GEMM=onednn`
forces the oneDNN form (for comparisons).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from loraplex.kernels.cpp_build import InlineExtension

# oneDNN picks its blocking for this many rows; a decode batch is a few dozen, and larger prefill chunks
# run the same packed weight correctly (somewhat below their own best blocking).
BATCH_HINT = 32
# Below this many multiply-adds a call stays on one thread: waking the other costs more than it saves.
MIN_PARALLEL_COST = 200_000
# From this many rows (a prefill chunk) a call may instead copy the panels out into a plain transposed
# weight and run the BLAS GEMM (MKL), where that is faster on this machine: measured once per process
# (`large_batch_path`). The copy reads and writes the weight once, which a product of this many rows
# repays; a decode step never takes this path.
BLAS_MIN_ROWS = 512

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#define LP_GEMM 512
#elif defined(__AVX2__) && defined(__FMA__)
#define LP_GEMM 256
#endif
#ifdef LP_GEMM
#include <immintrin.h>
#endif

bool has_kernel() {
#ifdef LP_GEMM
  return true;
#else
  return false;
#endif
}

// The vector width decides the layout: a panel is two registers of output columns.
#if LP_GEMM == 512
typedef __m512 vec;
constexpr int VW = 16;
constexpr int MR = 12;                         // rows per register block at most: 12 x 2 accumulators
constexpr int MRB = 8;                         // rows per register block in larger batches (packed rows)
static inline __mmask16 lo_mask(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps(lo_mask(n), p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline void vstore_n(float* p, vec v, int n) { _mm512_mask_storeu_ps(p, lo_mask(n), v); }
static inline vec vset1(float f) { return _mm512_set1_ps(f); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
#elif LP_GEMM == 256
// 16 registers: 6 rows x 2 accumulators, two weight registers and the broadcast row value.
typedef __m256 vec;
constexpr int VW = 8;
constexpr int MR = 6;
constexpr int MRB = 6;
static inline __m256i lo_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vload_n(const float* p, int n) { return _mm256_maskload_ps(p, lo_mask(n)); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline void vstore_n(float* p, vec v, int n) { _mm256_maskstore_ps(p, lo_mask(n), v); }
static inline vec vset1(float f) { return _mm256_set1_ps(f); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
#else
constexpr int VW = 16;
#endif
constexpr int NR = 2 * VW;  // output columns per panel: 32 with AVX-512, 16 with AVX2

int64_t panel_width() { return NR; }

#ifdef LP_GEMM
// Where the next panel is prefetched: L2 with AVX-512 (on Zen 4 and a Xeon, L1 stalled the loads in use);
// L1 with AVX2, whose narrower steps leave more time per line (Zen 3: 61.9 -> 53.3-56.7 ms per step).
#if LP_GEMM == 512
#define LP_PANEL_HINT _MM_HINT_T1
#else
#define LP_PANEL_HINT _MM_HINT_T0
#endif
constexpr int PF_LINES = NR / 16;              // cache lines of a panel per K step
constexpr int64_t SMALL_M = 64;                // up to this many rows: whole K per pass, rows unpacked
constexpr int64_t KC = 576;                    // larger batches: K blocks
constexpr int64_t X_CHUNK_BYTES = 512 * 1024;  // and row chunks of the (packed) input that stay in L2

// y[R rows, ncols] (= or +=) x[R rows, kc] @ panel[kc, 32] (+ bias). XS 0: row r of x at x + r * ldx;
// XS > 0: x is a packed row block [kc][XS] (pack_rows), so one K step's R values are adjacent.
template <int R, int XS, int PF>  // PF: cache lines of `pf` prefetched per K step
static inline void micro(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t kc,
                         float* __restrict y, int64_t ldy, int ncols, const float* __restrict bias, bool accum,
                         const float* pf) {
  vec a0[R], a1[R];
  const int n0 = std::min(ncols, VW), n1 = std::max(ncols - VW, 0);
  if (accum) {
    for (int r = 0; r < R; ++r) {
      a0[r] = vload_n(y + r * ldy, n0);
      a1[r] = vload_n(y + r * ldy + VW, n1);
    }
  } else {
    for (int r = 0; r < R; ++r) {
      a0[r] = vzero();
      a1[r] = vzero();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const vec w0 = vload(w + k * NR), w1 = vload(w + k * NR + VW);
#pragma GCC unroll 4
    for (int l = 0; l < PF; ++l) _mm_prefetch(reinterpret_cast<const char*>(pf + (k * PF + l) * 16), LP_PANEL_HINT);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vec b = vset1(XS ? x[k * XS + r] : x[r * ldx + k]);
      a0[r] = vfma(b, w0, a0[r]);
      a1[r] = vfma(b, w1, a1[r]);
    }
  }
  if (bias) {
    const vec b0 = vload_n(bias, n0), b1 = vload_n(bias + VW, n1);
    for (int r = 0; r < R; ++r) {
      a0[r] = vadd(a0[r], b0);
      a1[r] = vadd(a1[r], b1);
    }
  }
  if (ncols == NR) {
    for (int r = 0; r < R; ++r) {
      vstore(y + r * ldy, a0[r]);
      vstore(y + r * ldy + VW, a1[r]);
    }
  } else {
    for (int r = 0; r < R; ++r) {
      vstore_n(y + r * ldy, a0[r], n0);
      vstore_n(y + r * ldy + VW, a1[r], n1);
    }
  }
}

// `ldx` 0: x is a packed row block [kc][MRB] (pack_rows).
static void block(int rows, const float* x, int64_t ldx, const float* w, int64_t kc, float* y, int64_t ldy,
                  int ncols, const float* bias, bool accum, const float* pf = nullptr, int pf_lines = 0) {
  switch (rows) {
#define LP_CASE(R)                                                   \
    case R:                                                          \
      if (pf && pf_lines == 1) micro<R, 0, 1>(x, ldx, w, kc, y, ldy, ncols, bias, accum, pf);  \
      else if (pf && pf_lines == PF_LINES) micro<R, 0, PF_LINES>(x, ldx, w, kc, y, ldy, ncols, bias, accum, pf);  \
      else if (ldx) micro<R, 0, 0>(x, ldx, w, kc, y, ldy, ncols, bias, accum, nullptr);  \
      else micro<R, MRB, 0>(x, 0, w, kc, y, ldy, ncols, bias, accum, nullptr);      \
      break;
    LP_CASE(1) LP_CASE(2) LP_CASE(3) LP_CASE(4) LP_CASE(5) LP_CASE(6)
#if LP_GEMM == 512
    LP_CASE(7) LP_CASE(8) LP_CASE(9) LP_CASE(10) LP_CASE(11) LP_CASE(12)
#endif
#undef LP_CASE
    default: TORCH_CHECK(false, "row block of ", rows);
  }
}

// rows of x [rows, K] -> blocks of MRB rows, each [K][MRB]; the last block's missing rows are zero.
static void pack_rows(const float* x, int64_t K, int64_t rows, float* out) {
  constexpr int MR = MRB;  // the block height `micro<R, MRB>` reads; not the decode path's MR
  const int64_t blocks = (rows + MR - 1) / MR;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* dst = out + b * K * MR;
      const int64_t n = std::min<int64_t>(MR, rows - b * MR);
      for (int64_t r = 0; r < MR; ++r) {
        const float* src = x + (b * MR + r) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * MR + r] = r < n ? src[k] : 0.0f;
      }
    }
  });
}
#endif

// fn(p, next) for every panel p < P on `threads` threads; `next` is the panel the same thread takes after
// p (P if none), for prefetching. Threads claim chunks of panels as they go rather than each taking a fixed
// half: on a 2-core VM the two threads seldom run at the same speed for long (the other vCPU's host
// neighbours, a late wake-up), and with fixed halves the faster one waited at every GEMM's end barrier:
// 16-33% of the main thread's samples over the engine benchmark's workload (py-spy, Zen 3). A thread
// claims its next chunk as it starts the last panel of the current one, so that it knows which panel to
// prefetch. Called from within another parallel region, the one call made takes every chunk itself.
template <typename Fn>
static void for_panels(int64_t P, int64_t threads, const Fn& fn) {
  if (threads <= 1) {
    for (int64_t p = 0; p < P; ++p) fn(p, p + 1);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, P / (threads * 8));
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t cur = claimed.fetch_add(chunk);
    while (cur < P) {
      const int64_t end = std::min(P, cur + chunk);
      int64_t next = P;
      for (int64_t p = cur; p < end; ++p) {
        if (p + 1 == end) next = std::min(P, claimed.fetch_add(chunk));
        fn(p, p + 1 < end ? p + 1 : next);
      }
      cur = next;
    }
  });
}

// weight [N, K] -> panels [ceil(N / 32), K, 32], the last one zero-padded.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack: fp32 [out, in] weight");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto out = torch::zeros({P, K, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
        const float* row = src + (p * NR + j) * K;
        float* col = dst + p * K * NR + j;
        for (int64_t k = 0; k < K; ++k) col[k * NR] = row[k];
      }
  });
  return out;
}

// panels [P, K, 32] -> out [K, P * 32], the weight transposed (for a BLAS product on large batches).
void unpack_t(torch::Tensor packed, torch::Tensor out) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous() &&
              packed.scalar_type() == torch::kFloat32, "unpack_t: packed panels");
  const int64_t P = packed.size(0), K = packed.size(1);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kFloat32 && out.dim() == 2 &&
              out.size(0) == K && out.size(1) == P * NR, "unpack_t: out must be fp32 [", K, ", ", P * NR, "]");
  const float* src = packed.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, K, 64, [&](int64_t k0, int64_t k1) {
    for (int64_t p = 0; p < P; ++p)
      for (int64_t k = k0; k < k1; ++k)
        std::memcpy(dst + k * P * NR + p * NR, src + (p * K + k) * NR, NR * sizeof(float));
  });
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     int64_t min_parallel_cost) {
#ifdef LP_GEMM
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32, "linear: fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous(), "linear: packed panels");
  const int64_t K = packed.size(1), P = packed.size(0);
  TORCH_CHECK(K > 0 && x.dim() >= 1 && x.size(-1) == K, "linear: input has ", x.size(-1), " features, weight ", K);
  TORCH_CHECK(P == (N + NR - 1) / NR, "linear: ", N, " outputs do not match ", P, " panels");
  auto xc = x.contiguous();
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = N;
  auto y = torch::empty(shape, xc.options());
  const int64_t M = xc.numel() / K;
  if (M == 0 || N == 0) return y;
  torch::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "linear: bias of ", N, " fp32 values");
    bp = b.data_ptr<float>();
  }
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t threads = M * N * K < min_parallel_cost ? 1 : std::min<int64_t>(at::get_num_threads(), P);
  if (M <= SMALL_M) {
    // A decode step: each panel streams from memory once and is reused from cache by the row blocks,
    // sized evenly (32 rows with AVX-512: 11 + 11 + 10; with AVX2: 6 + 6 + 5 + 5 + 5 + 5). While a panel
    // is multiplied, the next one of the thread's range is prefetched, one line per K step
    // spread over the first row blocks, or all of a K step's lines in the only one: the hardware
    // prefetcher alone left the first row block waiting on memory (a 2-core Xeon: 43-51 -> 34-35 ms for
    // the 120 projections of a 32-row SmolLM2 step).
    const int64_t passes = (M + MR - 1) / MR, base = M / passes, extra = M % passes;
    auto panel = [&](int64_t p, const float* next) {
      const int ncols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      for (int64_t m = 0, j = 0; j < passes; ++j) {
        const int64_t rows = base + (j < extra ? 1 : 0);
        const float* pf = next && j < PF_LINES ? next + (passes == 1 ? 0 : j * K * 16) : nullptr;
        block(static_cast<int>(rows), xp + m * K, K, wp + p * K * NR, K, yp + m * N + p * NR, N, ncols,
              bp ? bp + p * NR : nullptr, false, pf, passes == 1 ? PF_LINES : 1);
        m += rows;
      }
    };
    for_panels(P, threads, [&](int64_t p, int64_t next) { panel(p, next < P ? wp + next * K * NR : nullptr); });
  } else {
    // Larger batches: row chunks packed into MRB-row blocks, K in blocks of KC accumulated in y.
    const int64_t chunk = std::max<int64_t>(MRB, X_CHUNK_BYTES / (4 * K) / MRB * MRB);
    std::vector<float> xpk(static_cast<size_t>(chunk * K));
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t rows = std::min<int64_t>(chunk, M - c0);
      pack_rows(xp + c0 * K, K, rows, xpk.data());
      for_panels(P, threads, [&](int64_t p, int64_t) {
        const int ncols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min<int64_t>(KC, K - k0);
          const float* pb = bp && k0 + kc == K ? bp + p * NR : nullptr;
          for (int64_t m = 0; m < rows; m += MRB)
            block(static_cast<int>(std::min<int64_t>(MRB, rows - m)), xpk.data() + m * K + k0 * MRB, 0,
                  wp + p * K * NR + k0 * NR, kc, yp + (c0 + m) * N + p * NR, N, ncols, pb, k0 > 0);
        }
      });
    }
  }
  return y;
#else
  TORCH_CHECK(false, "linear: built without AVX-512 or AVX2/FMA");
#endif
}

// The address of `linear`, for other extensions that run whole layers in C++ (ops_cpu's decoder_stack).
int64_t linear_address() { return reinterpret_cast<int64_t>(&linear); }
"""

EXTENSION_NAME = "loraplex_linear_cpu_v10"  # bump the suffix when the C++ source changes incompatibly
_EXTENSION = InlineExtension(EXTENSION_NAME, _SOURCE, ["has_kernel", "panel_width", "pack", "linear", "unpack_t",
                                                              "linear_address"],
                             what="CPU GEMM kernel")


def _kernel():
    """The compiled module when this machine's build has the GEMM (AVX-512 or AVX2), else None."""
    if os.environ.get("LORAPLEX_CPU_GEMM", "").lower() == "onednn":
        return None
    mod = _EXTENSION.load()
    return mod if mod is not None and mod.has_kernel() else None


def linear_address() -> int | None:
    """The C address of the panel GEMM (`linear`), for C++ that calls it directly; None without it."""
    mod = _kernel()
    return None if mod is None else mod.linear_address()


@dataclass(frozen=True)
class PackedWeight:
    """A projection weight [out_features, in_features] in a packed form: `kind` "panels" (loraplex's
    kernel) or "onednn"."""

    kind: str
    data: torch.Tensor
    out_features: int
    in_features: int


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def _agrees(packed: PackedWeight, weight: torch.Tensor) -> bool:
    probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
    got = packed_linear(probe, packed, None)
    want = torch.nn.functional.linear(probe, weight)
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max().clamp_min(1.0)))


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The weight [out, in] packed for this machine, or None when it cannot be (the caller keeps F.linear)."""
    if not can_pack(weight) or weight.shape[0] == 0 or weight.shape[1] == 0:
        return None
    out_features, in_features = weight.shape
    mod = _kernel()
    if mod is not None:
        packed = PackedWeight("panels", mod.pack(weight.detach()), out_features, in_features)
        if _agrees(packed, weight):
            return packed
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        data = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        packed = PackedWeight("onednn", data, out_features, in_features)
        ok = _agrees(packed, weight)
    except (RuntimeError, AttributeError):  # a build without these ops, or a shape oneDNN refuses
        return None
    return packed if ok else None


_scratch = threading.local()  # per thread: the transposed weight of the BLAS path, reused call to call
_large_path: str | None = None
_large_path_lock = threading.Lock()


def _blas_linear(x: torch.Tensor, data: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias via the BLAS GEMM: the panels copied out to W^T [in, padded out] first."""
    panels, in_features, width = data.shape
    need = in_features * panels * width
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratch.buf = torch.empty(need, dtype=torch.float32)
    wt = buf[:need].view(in_features, panels * width)
    _EXTENSION.load().unpack_t(data, wt)
    x2 = x.reshape(-1, in_features)
    w = wt[:, :out_features]
    y = torch.addmm(bias, x2, w) if bias is not None else torch.mm(x2, w)
    return y.view(*x.shape[:-1], out_features)


def _calibrate() -> str:
    """"blas" when copying out + BLAS beats the panel kernel by 5% on prefill-sized products (1024 rows,
    576 -> 1536 and 1536 -> 576; best of five each, alternated), else "panels"."""
    mod = _EXTENSION.load()
    gen = torch.Generator().manual_seed(0)
    cases = []
    for out_features, in_features in ((1536, 576), (576, 1536)):
        data = mod.pack(torch.randn(out_features, in_features, generator=gen))
        cases.append((torch.randn(1024, in_features, generator=gen), data, out_features))
    ways = {
        "panels": lambda x, data, n: mod.linear(x, data, n, None, MIN_PARALLEL_COST),
        "blas": lambda x, data, n: _blas_linear(x, data, n, None),
    }
    best = {name: float("inf") for name in ways}
    for _ in range(5):
        for name, run in ways.items():
            start = time.perf_counter()
            for case in cases:
                run(*case)
            best[name] = min(best[name], time.perf_counter() - start)
    return "blas" if best["blas"] < 0.95 * best["panels"] else "panels"


def large_batch_path() -> str:
    """How the panel form runs calls of BLAS_MIN_ROWS rows or more in this process: "panels" or "blas"
    (`LORAPLEX_CPU_PREFILL_GEMM=panels|blas` decides instead of the measurement)."""
    global _large_path
    if _large_path is None:
        with _large_path_lock:
            if _large_path is None:
                forced = os.environ.get("LORAPLEX_CPU_PREFILL_GEMM", "").lower()
                if forced in ("panels", "blas"):
                    _large_path = forced
                else:
                    _large_path = _calibrate() if _kernel() is not None else "panels"
    return _large_path


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias with the packed weight (zero rows give an empty result)."""
    if packed.kind == "panels":
        if x.numel() >= BLAS_MIN_ROWS * packed.in_features and large_batch_path() == "blas":
            return _blas_linear(x, packed.data, packed.out_features, bias)
        return _EXTENSION.load().linear(x, packed.data, packed.out_features, bias, MIN_PARALLEL_COST)
    return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
