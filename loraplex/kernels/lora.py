"""Batched multi-LoRA: per-step token grouping, per-projection slot weights, shrink and expand.

Every token of a step may use a different adapter slot (or none, slot -1). `LoraBatch` sorts the tokens
by slot once per step; every LoRA-aware projection of every layer reuses it.

`LoraSlotWeights` holds one projection's weights for all device slots. A projection may be fused from
several PEFT modules (qkv, gate_up): each is a *slice* with its own output columns and its own A/B.
Per slot, the A rows of the slices are packed back to back (rank_offsets), so one matmul shrinks every
slice at once and an adapter of rank 8 costs rank 8, not the largest rank a slot could hold. B is kept
transposed, rank-major ([rank, out]): expanding is then a sum of contiguous output rows scaled by the
token's shrunk values, and a slice's rows beyond its rank are never read.

The torch path (the oracle for the Triton and CPU kernels, and the fallback) loops over the adapters
present in the step, never over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class LoraBatch:
    """Token-to-adapter mapping for one step, built once and shared by every layer."""

    num_tokens: int
    sorted_token_ids: torch.Tensor  # [num_lora_tokens] int64: tokens that use an adapter, grouped by slot
    slot_ids: list[int]  # active slots, in the order of their groups
    starts: list[int]  # start of each group in sorted_token_ids
    counts: list[int]  # number of tokens in each group
    contiguous: bool  # sorted_token_ids == arange(num_lora_tokens): no gather/scatter needed
    # the same group description as device tensors, for the Triton kernels
    slot_ids_t: torch.Tensor
    starts_t: torch.Tensor
    counts_t: torch.Tensor
    # per-step values a kernel derives from the grouping, computed by the first layer that needs them
    scratch: dict = field(default_factory=dict)
    token_slots: tuple[int, ...] = ()  # every token's slot (-1: none), in the step's order

    @property
    def num_lora_tokens(self) -> int:
        return int(self.sorted_token_ids.numel())

    @property
    def max_count(self) -> int:
        return max(self.counts, default=0)

    @property
    def empty(self) -> bool:
        return not self.slot_ids

    @classmethod
    def build(cls, token_slots: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu") -> LoraBatch:
        """token_slots: the adapter slot of every token in the step, -1 for the base model.

        Grouped in Python: a decode step has a few dozen tokens, and the dozen small torch calls that a
        tensor grouping takes (nonzero, argsort, unique, cumsum, ...) cost about 0.2 ms a step on a CPU."""
        slots = token_slots.reshape(-1).tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot >= 0:
                groups.setdefault(int(slot), []).append(i)
        slot_ids = sorted(groups)
        sorted_ids: list[int] = []
        starts, counts = [], []
        for slot in slot_ids:
            starts.append(len(sorted_ids))
            counts.append(len(groups[slot]))
            sorted_ids += groups[slot]
        dev = torch.device(device)
        table = torch.tensor([slot_ids, starts, counts], dtype=torch.int32, device=dev).reshape(3, -1)
        return cls(
            num_tokens=len(slots),
            sorted_token_ids=torch.tensor(sorted_ids, dtype=torch.int64, device=dev),
            slot_ids=slot_ids,
            starts=starts,
            counts=counts,
            contiguous=sorted_ids == list(range(len(sorted_ids))),
            slot_ids_t=table[0],
            starts_t=table[1],
            counts_t=table[2],
            token_slots=tuple(int(s) for s in slots),
        )


class LoraSlotWeights:
    """One projection's LoRA weights for every device slot.

    Per slot, the A rows of all slices packed back to back ([rank_total, in_features]) and B transposed
    ([rank, sum(out_slices)], column n belonging to the slice that owns it). Two ways to hold them:

    - copies (the default, and what a GPU uses): allocated once for every slot at full capacity,
        a: [num_slots, num_slices * max_rank, in_features], b: [num_slots, max_rank, sum(out_slices)];
      a slot load copies the adapter in.
    - views (`views=True`, CPU only): a slot refers to the adapter's own host tensors, already in that
      layout (`set_slot_fused`). Host memory is the device memory there: loading into a slot copies
      nothing, and the slots take no memory of their own.

    `slot_a(slot)` / `slot_b(slot)` give a slot's tensors either way; `a_ptrs` / `b_ptrs` (CPU) hold their
    addresses for the C++ kernel.
    """

    def __init__(
        self,
        num_slots: int,
        in_features: int,
        out_slices: tuple[int, ...],
        max_rank: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        views: bool = False,
    ) -> None:
        if num_slots <= 0 or max_rank <= 0 or not out_slices:
            raise ValueError("LoraSlotWeights needs at least one slot, one slice and rank >= 1")
        if views and torch.device(device).type != "cpu":
            raise ValueError("slots as views of host tensors exist on the CPU only")
        self.num_slots = num_slots
        self.in_features = in_features
        self.out_slices = tuple(out_slices)
        self.out_offsets = tuple(sum(out_slices[:i]) for i in range(len(out_slices)))
        self.out_features = sum(out_slices)
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.views = views
        num_slices = len(out_slices)
        self.a_rows = num_slices * max_rank  # the most A rows a slot can hold (the shrunk values' width)
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self._a_views: list[torch.Tensor | None] = [None] * num_slots
        self._b_views: list[torch.Tensor | None] = [None] * num_slots
        if not views:
            self.a = torch.zeros(num_slots, self.a_rows, in_features, dtype=dtype, device=device)
            self.b = torch.zeros(num_slots, max_rank, self.out_features, dtype=dtype, device=device)
        self.a_ptrs = self.b_ptrs = None
        if self.device.type == "cpu":
            # every slot's A and B address, for the C++ kernel (0: nothing there; ranks are then zero)
            self.a_ptrs = torch.zeros(num_slots, dtype=torch.int64)
            self.b_ptrs = torch.zeros(num_slots, dtype=torch.int64)
            if not views:
                self.a_ptrs.copy_(torch.tensor([self.a[i].data_ptr() for i in range(num_slots)]))
                self.b_ptrs.copy_(torch.tensor([self.b[i].data_ptr() for i in range(num_slots)]))
        # host copies drive the torch path's loop; device copies drive the Triton kernels
        self.ranks: list[list[int]] = [[0] * num_slices for _ in range(num_slots)]
        self.rank_offsets: list[list[int]] = [[0] * num_slices for _ in range(num_slots)]
        self.ranks_t = torch.zeros(num_slots, num_slices, dtype=torch.int32, device=device)
        self.rank_offsets_t = torch.zeros(num_slots, num_slices, dtype=torch.int32, device=device)
        self.rank_totals_t = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.out_sizes_t = torch.tensor(self.out_slices, dtype=torch.int32, device=device)
        self.out_offsets_t = torch.tensor(self.out_offsets, dtype=torch.int32, device=device)
        self.out_meta = torch.tensor(list(zip(self.out_offsets, self.out_slices, strict=True)), dtype=torch.int64)
        # numpy views of the CPU tables, made once: a slot load or eviction writes all of a model's projections
        # (120 for SmolLM2) between two steps, and a fresh view per write was most of that time
        self._np = None
        if self.device.type == "cpu":
            self._np = (self.ranks_t.numpy(), self.rank_offsets_t.numpy(), self.rank_totals_t.numpy(),
                        self.a_ptrs.numpy(), self.b_ptrs.numpy())

    @property
    def num_slices(self) -> int:
        return len(self.out_slices)

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """weights: per slice, (A [r, in], B [out_slice, r]) with the scaling folded into B, or None when
        the adapter does not target that slice."""
        if len(weights) != self.num_slices:
            raise ValueError(f"expected {self.num_slices} slices, got {len(weights)}")
        offset = 0
        ranks, offsets = [], []
        for i, pair in enumerate(weights):
            if pair is None:
                ranks.append(0)
                offsets.append(offset)
                continue
            a, b = pair
            r = a.shape[0]
            if a.shape != (r, self.in_features) or b.shape != (self.out_slices[i], r):
                raise ValueError(
                    f"slice {i}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                    f"in={self.in_features}, out={self.out_slices[i]}"
                )
            if r > self.max_rank:
                raise ValueError(f"rank {r} exceeds the slot capacity max_rank={self.max_rank}")
            ranks.append(r)
            offsets.append(offset)
            offset += r
        if self.views:
            a_fused, b_fused = fuse_slices(weights, self.in_features, self.out_slices, dtype=self.dtype)
            self.set_slot_fused(slot, a_fused, b_fused, ranks)
            return
        for i, pair in enumerate(weights):
            if pair is None:
                continue
            a, b = pair
            r, offset = ranks[i], offsets[i]
            self.a[slot, offset : offset + r].copy_(a, non_blocking=True)
            o = self.out_offsets[i]
            self.b[slot, :r, o : o + self.out_slices[i]].copy_(b.t(), non_blocking=True)
        self._write_meta(slot, ranks, offsets)

    def set_slot_fused(self, slot: int, a: torch.Tensor, b: torch.Tensor, ranks: list[int]) -> None:
        """Place an adapter already in the slot layout (`fuse_slices`): a [sum(ranks), in] and b
        [max(ranks), out_features], both contiguous. With views the slot refers to these very tensors
        (they must not be written while it does); with copies they are copied in."""
        if len(ranks) != self.num_slices or any(r < 0 or r > self.max_rank for r in ranks):
            raise ValueError(f"ranks {ranks} do not fit {self.num_slices} slices of rank <= {self.max_rank}")
        total, rmax = sum(ranks), max(ranks, default=0)
        if (a.shape != (total, self.in_features) or b.shape != (rmax, self.out_features)
                or a.dtype != self.dtype or b.dtype != self.dtype):
            raise ValueError(
                f"fused A {tuple(a.shape)} / B {tuple(b.shape)} ({a.dtype}) do not fit ranks {ranks}, "
                f"in={self.in_features}, out={self.out_features} ({self.dtype})"
            )
        offsets = [sum(ranks[:i]) for i in range(len(ranks))]
        if not self.views:
            self.a[slot, :total].copy_(a, non_blocking=True)
            self.b[slot, :rmax].copy_(b, non_blocking=True)
            self._write_meta(slot, ranks, offsets)
            return
        if a.device.type != "cpu" or not a.is_contiguous() or not b.is_contiguous():
            raise ValueError("a slot view needs contiguous CPU tensors")
        # No step reads a slot while it changes: the engine places adapters between steps, or (prefetch)
        # into a free slot that no running request uses.
        self._a_views[slot], self._b_views[slot] = a, b
        _, _, _, a_ptrs, b_ptrs = self._np
        a_ptrs[slot] = a.data_ptr() if total else 0
        b_ptrs[slot] = b.data_ptr() if rmax else 0
        self._write_meta(slot, list(ranks), offsets)

    def slot_a(self, slot: int) -> torch.Tensor:
        """The slot's A rows of every slice, [at least rank_total(slot), in_features]."""
        return self._a_views[slot] if self.views else self.a[slot]

    def slot_b(self, slot: int) -> torch.Tensor:
        """The slot's B, transposed: [at least its largest rank, out_features]."""
        return self._b_views[slot] if self.views else self.b[slot]

    def _write_meta(self, slot: int, ranks: list[int], offsets: list[int]) -> None:
        self.ranks[slot] = ranks
        self.rank_offsets[slot] = offsets
        if self._np is not None:
            # through numpy views: a slot load touches every projection, and torch dispatch adds up
            ranks_n, offsets_n, totals_n, _, _ = self._np
            ranks_n[slot] = ranks
            offsets_n[slot] = offsets
            totals_n[slot] = sum(ranks)
        else:
            self.ranks_t[slot] = torch.tensor(ranks, dtype=torch.int32)
            self.rank_offsets_t[slot] = torch.tensor(offsets, dtype=torch.int32)
            self.rank_totals_t[slot] = sum(ranks)

    def clear_slot(self, slot: int) -> None:
        # Stale A/B values are harmless once the ranks say zero: nothing reads past a slice's rank.
        self._write_meta(slot, [0] * self.num_slices, [0] * self.num_slices)
        if self.views:
            self._np[3][slot] = self._np[4][slot] = 0
            self._a_views[slot] = self._b_views[slot] = None

    def rank_total(self, slot: int) -> int:
        return sum(self.ranks[slot])


def fuse_slices(
    weights: list[tuple[torch.Tensor, torch.Tensor] | None], in_features: int, out_slices: tuple[int, ...],
    *, dtype: torch.dtype = torch.float32, alloc=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slice (A [r, in], B [out_slice, r]) or None -> the slot layout of one projection: A of every
    slice back to back [sum r, in], and B transposed [max r, sum(out_slices)] (zero where a slice's rank
    is below the largest), in `dtype`. Copies made with numpy where it has the dtypes (fp32 and fp16): a
    torch copy would start an OpenMP team in the calling thread (an adapter loader), beside the step's own
    on the same cores. `alloc(shape, dtype)`, when given, supplies the two tensors (uninitialised), e.g.
    from a pool of recycled ones."""
    ranks = [0 if p is None else p[0].shape[0] for p in weights]
    new = alloc or (lambda shape, dt: torch.empty(shape, dtype=dt))
    a = new((sum(ranks), in_features), dtype)
    b = new((max(ranks, default=0), sum(out_slices)), dtype)
    an, bn = (a.numpy(), b.numpy()) if dtype in (torch.float32, torch.float16) else (None, None)
    rmax = b.shape[0]
    row = col = 0
    for pair, r, size in zip(weights, ranks, out_slices, strict=True):
        if pair is not None:
            pa, pb = pair[0].detach().cpu(), pair[1].detach().cpu()
            if an is not None and pa.dtype == torch.float32 and pb.dtype == torch.float32:
                an[row : row + r] = pa.numpy()
                bn[:r, col : col + size] = pb.numpy().T
            else:
                a[row : row + r] = pa
                b[:r, col : col + size] = pb.t()
            row += r
        if r < rmax:  # rows past this slice's rank (never read; zero, not stale values, all the same)
            if bn is not None:
                bn[r:, col : col + size] = 0
            else:
                b[r:, col : col + size] = 0
        col += size
    return a, b


def lora_shrink_torch(x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch) -> torch.Tensor:
    """x [num_tokens, in] -> [num_lora_tokens, num_slices * max_rank] in sorted order; per group only the
    first rank_total(slot) columns are meaningful."""
    out = x.new_empty(batch.num_lora_tokens, w.a_rows)
    xs = x[: batch.num_lora_tokens] if batch.contiguous else x.index_select(0, batch.sorted_token_ids)
    for slot, start, count in zip(batch.slot_ids, batch.starts, batch.counts, strict=True):
        rt = w.rank_total(slot)
        if rt == 0:
            continue
        a = w.slot_a(slot)[:rt]
        torch.mm(xs[start : start + count], a.to(x.dtype).t(), out=out[start : start + count, :rt])
    return out


def lora_expand_torch(y: torch.Tensor, shrunk: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch) -> None:
    """y [num_tokens, out] += per-slice shrunk @ B^T for every token's adapter."""
    if batch.contiguous:
        ys = y[: batch.num_lora_tokens]
        delta = None
    else:
        delta = y.new_zeros(batch.num_lora_tokens, w.out_features)
        ys = delta
    for slot, start, count in zip(batch.slot_ids, batch.starts, batch.counts, strict=True):
        rows = slice(start, start + count)
        b = w.slot_b(slot)
        for r, roff, o, size in zip(w.ranks[slot], w.rank_offsets[slot], w.out_offsets, w.out_slices, strict=True):
            if r == 0:
                continue
            ys[rows, o : o + size].addmm_(shrunk[rows, roff : roff + r], b[:r, o : o + size].to(ys.dtype))
    if delta is not None:
        y.index_add_(0, batch.sorted_token_ids, delta)


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch) -> None:
    if batch.empty:
        return
    lora_expand_torch(y, lora_shrink_torch(x, w, batch), w, batch)


def add_lora(y: torch.Tensor, x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch) -> None:
    """y += LoRA delta of each token's adapter: Triton on CUDA; on the CPU the fused kernel of `lora_cpu`
    (the torch path where it cannot be compiled)."""
    if batch.empty:
        return
    if y.is_cuda:
        from loraplex.kernels.lora_triton import add_lora_triton

        add_lora_triton(y, x, w, batch)
    else:
        from loraplex.kernels.lora_cpu import add_lora_cpu

        add_lora_cpu(y, x, w, batch)
