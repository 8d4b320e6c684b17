"""A fused CPU kernel for batched multi-LoRA (fp32), compiled once per machine with the system C++ compiler.

Why: on a CPU each torch matmul call costs ~10-20 us however small it is, and the torch path issues
(1 + slices) of them per adapter per projection. A decode step with 8 adapters over 30 layers is
thousands of calls, more than the arithmetic. Decode groups are a few tokens each, so the work is
memory-bound on reading each adapter's A and B once: this kernel reads every weight row once per group,
reuses it for the group's tokens, and runs all groups of a projection in one call split over threads.
Groups of many tokens (prefill) are handed to MKL, where one matmul call amortises well.

When no compiler is available the torch path is used (same results).
"""

from __future__ import annotations

import logging

import torch

from loraplex.kernels.cpp_build import InlineExtension
from loraplex.kernels.lora import LoraBatch, LoraSlotWeights, add_lora_torch

log = logging.getLogger(__name__)

# Groups larger than this go through MKL matmuls; below it the hand loop wins on overhead.
DENSE_GROUP_MIN = 16
# Below this many multiply-adds a call stays on one thread: waking the other costs more than it saves.
MIN_PARALLEL_COST = 200_000

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
  #pragma omp simd reduction(+:acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// groups: int64 [G, 3] (slot, start, count); ranks / rank_offsets: int32 [num_slots, S]
// out_meta: int64 [S, 2] (offset, size). y += expand(shrink(x)) for groups with count < dense_min.
void lora_small_groups(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b,
                       torch::Tensor sorted_ids, torch::Tensor groups, torch::Tensor ranks,
                       torch::Tensor rank_offsets, torch::Tensor out_meta, torch::Tensor shrunk,
                       int64_t min_parallel_cost) {
  const int64_t G = groups.size(0), S = ranks.size(1), in = x.size(1);
  const int64_t* g = groups.data_ptr<int64_t>();
  const int64_t* ids = sorted_ids.data_ptr<int64_t>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  const int32_t* ro = rank_offsets.data_ptr<int32_t>();
  const int64_t* om = out_meta.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = shrunk.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0), ss = shrunk.stride(0);
  const int64_t as0 = a.stride(0), as1 = a.stride(1), bs0 = b.stride(0), bs1 = b.stride(1);

  constexpr int64_t CHUNK = 128;
  // One group (an adapter's tokens): shrink, then expand. B is rank-major, so the expand is AXPYs over
  // contiguous output columns; every weight row is read once and reused for the group's tokens.
  auto run_group = [&](int64_t i) {
    const int64_t slot = g[3 * i], start = g[3 * i + 1], count = g[3 * i + 2];
    int64_t total = 0;
    for (int64_t s = 0; s < S; ++s) total += rk[slot * S + s];
    for (int64_t j = 0; j < total; ++j) {
      const float* arow = ap + slot * as0 + j * as1;
      for (int64_t t = 0; t < count; ++t)
        sp[(start + t) * ss + j] = dot(arow, xp + ids[start + t] * xs, in);
    }
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r = rk[slot * S + s], roff = ro[slot * S + s];
      if (r == 0) continue;
      for (int64_t c0 = 0; c0 < om[2 * s + 1]; c0 += CHUNK) {
        const int64_t width = std::min(CHUNK, om[2 * s + 1] - c0);
        const int64_t col = om[2 * s] + c0;
        for (int64_t t = 0; t < count; ++t) {
          float* __restrict yrow = yp + ids[start + t] * ys + col;
          const float* srow = sp + (start + t) * ss + roff;
          float acc[CHUNK];
          for (int64_t c = 0; c < width; ++c) acc[c] = 0.f;
          for (int64_t q = 0; q < r; ++q) {
            const float sv = srow[q];
            const float* __restrict brow = bp + slot * bs0 + q * bs1 + col;
            #pragma omp simd
            for (int64_t c = 0; c < width; ++c) acc[c] += sv * brow[c];
          }
          #pragma omp simd
          for (int64_t c = 0; c < width; ++c) yrow[c] += acc[c];
        }
      }
    }
  };

  // Groups never share output rows, so threads take whole groups: one parallel region per call and no
  // barrier between shrink and expand (barriers are what hurts on a busy 2-core machine). Groups are
  // dealt to threads by cost, largest first.
  const int64_t out_total = om[2 * (S - 1)] + om[2 * (S - 1) + 1];
  std::vector<std::pair<int64_t, int64_t>> cost(G);
  int64_t total_cost = 0;
  for (int64_t i = 0; i < G; ++i) {
    int64_t slot = g[3 * i], r = 0;
    for (int64_t s = 0; s < S; ++s) r += rk[slot * S + s];
    cost[i] = {g[3 * i + 2] * r * (in + out_total), i};
    total_cost += cost[i].first;
  }
  const int64_t bins = total_cost < min_parallel_cost ? 1 : std::min<int64_t>(at::get_num_threads(), G);
  if (bins <= 1) {
    for (int64_t i = 0; i < G; ++i) run_group(i);
    return;
  }
  std::sort(cost.begin(), cost.end(), std::greater<>());
  std::vector<std::vector<int64_t>> assigned(bins);
  std::vector<int64_t> load(bins, 0);
  for (auto& [c, i] : cost) {
    int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    assigned[b].push_back(i);
    load[b] += c;
  }
  at::parallel_for(0, bins, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t i : assigned[b]) run_group(i);
  });
}
"""

EXTENSION_NAME = "loraplex_lora_cpu_v3"  # bump the suffix when the C++ source changes incompatibly
_EXTENSION = InlineExtension(
    EXTENSION_NAME, _SOURCE, ["lora_small_groups"], what="CPU LoRA kernel",
)


def _load():
    return _EXTENSION.load()


def available() -> bool:
    return _load() is not None


class _GroupTensors:
    """The step's groups split in two: small ones for the kernel, large ones (prefill) as a batch of their
    own for the torch path, which then gathers and scatters once per projection, not once per group."""

    __slots__ = ("small", "large")

    def __init__(self, batch: LoraBatch):
        groups = list(zip(batch.slot_ids, batch.starts, batch.counts, strict=True))
        small = [g for g in groups if g[2] < DENSE_GROUP_MIN]
        self.small = torch.tensor(small, dtype=torch.int64).reshape(-1, 3)
        large = [g for g in groups if g[2] >= DENSE_GROUP_MIN]
        self.large = None
        if large:
            ids = torch.cat([batch.sorted_token_ids[st : st + c] for _, st, c in large])
            slots = torch.full((batch.num_tokens,), -1, dtype=torch.int64)
            slots[ids] = torch.cat([torch.full((c,), s, dtype=torch.int64) for s, _, c in large])
            self.large = LoraBatch.build(slots)


def _groups(batch: LoraBatch) -> _GroupTensors:
    cached = batch.scratch.get("cpu_groups")
    if cached is None:
        cached = batch.scratch["cpu_groups"] = _GroupTensors(batch)
    return cached


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch) -> None:
    """y += each token's adapter delta; fp32 contiguous rows via the kernel, anything else via torch."""
    mod = _load()
    if (
        mod is None
        or x.dtype != torch.float32
        or y.dtype != torch.float32
        or w.a.dtype != torch.float32
        or x.stride(-1) != 1
        or y.stride(-1) != 1
    ):
        add_lora_torch(y, x, w, batch)
        return
    groups = _groups(batch)
    if groups.small.shape[0]:
        shrunk = torch.empty(batch.num_lora_tokens, w.a.shape[1], dtype=torch.float32)
        mod.lora_small_groups(
            y, x, w.a, w.b, batch.sorted_token_ids, groups.small, w.ranks_t, w.rank_offsets_t, w.out_meta,
            shrunk, MIN_PARALLEL_COST,
        )
    if groups.large is not None:
        add_lora_torch(y, x, w, groups.large)
