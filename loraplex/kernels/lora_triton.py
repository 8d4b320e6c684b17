"""Triton shrink/expand for batched multi-LoRA (segmented GEMM in the spirit of Punica's SGMV).

Tokens arrive grouped by adapter slot (`LoraBatch`). The grid's last axis walks the groups; a program
whose tile lies past its group's token count, or past its adapter's rank, returns at once, so a rank-8
adapter in a batch with a rank-64 one costs rank 8 (up to one block of rounding).

Shrink: out[g_row, :rank_total] = x[token] @ A[slot, :rank_total]^T, optionally split over K with atomics.
Expand: y[token, slice] += out[g_row, roff:roff+r] @ B[slot, slice rows, :r]^T, one program per
(token tile, output tile, slice, group); every (token, column) has exactly one writer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora import LoraBatch, LoraSlotWeights


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, sorted_ids_ptr, slot_ids_ptr, starts_ptr, counts_ptr, rank_totals_ptr,
    K, max_n,
    stride_xm, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    group = tl.program_id(2)
    slot = tl.load(slot_ids_ptr + group)
    count = tl.load(counts_ptr + group)
    rank_total = tl.load(rank_totals_ptr + slot)
    num_n = tl.cdiv(max_n, BLOCK_N)
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n
    # The grid is sized for the largest group and rank; other groups end early.
    if pid_m * BLOCK_M >= count:
        return
    if pid_n * BLOCK_N >= rank_total:
        return
    start = tl.load(starts_ptr + group)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_mask = offs_m < count
    n_mask = offs_n < rank_total
    tokens = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_n[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k_mask = (k - pid_k * BLOCK_K + offs_k) < K
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(xt, at, input_precision=PRECISION)
        x_ptrs += BLOCK_K * SPLIT_K * stride_xk
        a_ptrs += BLOCK_K * SPLIT_K * stride_ak
    o_ptrs = out_ptr + (start + offs_m)[:, None] * stride_om + offs_n[None, :] * stride_on
    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, sorted_ids_ptr, slot_ids_ptr, starts_ptr, counts_ptr,
    ranks_ptr, rank_offsets_ptr, out_sizes_ptr, out_offsets_ptr,
    num_slices, max_out,
    stride_sm, stride_sn,
    stride_bs, stride_bn, stride_bk,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    sl = tl.program_id(1)
    group = tl.program_id(2)
    slot = tl.load(slot_ids_ptr + group)
    count = tl.load(counts_ptr + group)
    rank = tl.load(ranks_ptr + slot * num_slices + sl)
    out_size = tl.load(out_sizes_ptr + sl)
    num_n = tl.cdiv(max_out, BLOCK_N)
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n
    if rank == 0:
        return
    if pid_m * BLOCK_M >= count:
        return
    if pid_n * BLOCK_N >= out_size:
        return
    start = tl.load(starts_ptr + group)
    roff = tl.load(rank_offsets_ptr + slot * num_slices + sl)
    out_off = tl.load(out_offsets_ptr + sl)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < count
    n_mask = offs_n < out_size
    s_ptrs = s_ptr + (start + offs_m)[:, None] * stride_sm + (roff + offs_k)[None, :] * stride_sn
    b_ptrs = (
        b_ptr + slot.to(tl.int64) * stride_bs + (out_off + offs_n)[None, :] * stride_bn
        + offs_k[:, None] * stride_bk
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The loop stops at this adapter's rank: no work for the padding up to the slot's max_rank.
    for k in range(0, rank, BLOCK_K):
        k_mask = (k + offs_k) < rank
        st = tl.load(s_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(st.to(bt.dtype), bt, input_precision=PRECISION)
        s_ptrs += BLOCK_K * stride_sn
        b_ptrs += BLOCK_K * stride_bk
    tokens = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0)
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + (out_off + offs_n)[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 models expect fp32 results; TF32 would drift from the torch path by ~1e-3.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_m(max_count: int) -> int:
    # tl.dot needs every dimension >= 16; decode groups are usually a handful of tokens.
    return 16 if max_count <= 16 else 32 if max_count <= 64 else 64


def lora_shrink_triton(
    x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch, *, split_k: int = 1,
    block_n: int = 16, block_k: int = 128, num_warps: int = 4,
) -> torch.Tensor:
    """Same contract as `lora_shrink_torch`; the buffer is fp32. The tile sizes are open for tuning."""
    n = batch.num_lora_tokens
    zero = split_k > 1
    out = (torch.zeros if zero else torch.empty)(n, w.a.shape[1], dtype=torch.float32, device=x.device)
    if batch.empty:
        return out
    block_m = _block_m(batch.max_count)
    max_rank_total = w.a.shape[1]
    grid = (
        triton.cdiv(batch.max_count, block_m) * triton.cdiv(max_rank_total, block_n),
        split_k,
        len(batch.slot_ids),
    )
    _shrink_kernel[grid](
        x, w.a, out, batch.sorted_token_ids, batch.slot_ids_t, batch.starts_t, batch.counts_t, w.rank_totals_t,
        x.shape[1], max_rank_total,
        x.stride(0), x.stride(1),
        w.a.stride(0), w.a.stride(1), w.a.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        PRECISION=_precision(x.dtype), num_warps=num_warps,
    )
    return out


def lora_expand_triton(
    y: torch.Tensor, shrunk: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch, *,
    block_n: int = 128, block_k: int | None = None, num_warps: int = 4,
) -> None:
    if batch.empty:
        return
    block_m = _block_m(batch.max_count)
    if block_k is None:
        # tile sweep on an H200 (bench/bench_lora_kernels.py --sweep): 128-wide output tiles won every
        # shape; a 32-deep rank step helped prefill-sized groups, 16 decode-sized ones
        block_k = 32 if block_m == 64 else 16
    max_out = max(w.out_slices)
    grid = (
        triton.cdiv(batch.max_count, block_m) * triton.cdiv(max_out, block_n),
        w.num_slices,
        len(batch.slot_ids),
    )
    _expand_kernel[grid](
        shrunk, w.b, y, batch.sorted_token_ids, batch.slot_ids_t, batch.starts_t, batch.counts_t,
        w.ranks_t, w.rank_offsets_t, w.out_sizes_t, w.out_offsets_t,
        w.num_slices, max_out,
        shrunk.stride(0), shrunk.stride(1),
        w.b.stride(0), w.b.stride(2), w.b.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=_precision(w.b.dtype), num_warps=num_warps,
    )


_SM_COUNT: dict[int, int] = {}


def auto_split_k(x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch) -> int:
    """Split the shrink's K loop when its grid would leave most of the GPU idle (decode: a few tokens per
    adapter, a long K), so that every multiprocessor streams a share of the A rows."""
    if not x.is_cuda or batch.empty:
        return 1
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = (
        triton.cdiv(batch.max_count, _block_m(batch.max_count)) * triton.cdiv(w.a.shape[1], 16) * len(batch.slot_ids)
    )
    k_blocks = triton.cdiv(x.shape[1], 128)
    # Measured on an H200 (bench/bench_lora_kernels.py): below K = 8192 the zeroed buffer and the atomics
    # cost more than the extra parallelism gives (Llama-7B qkv/gate_up decode got slower split); at
    # K = 11008 (Llama-7B down) splitting 8 ways took a 32-token decode from 74 to 45 us.
    if k_blocks < 64:
        return 1
    split = (2 * _SM_COUNT[dev]) // max(programs, 1)
    # each split keeps at least 4 K blocks of work; atomics beyond 16 partial sums cost more than they save
    return max(1, min(split, k_blocks // 4, 16))


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, w: LoraSlotWeights, batch: LoraBatch, *, split_k: int | None = None
) -> None:
    if batch.empty:
        return
    if split_k is None:
        split_k = auto_split_k(x, w, batch)
    lora_expand_triton(y, lora_shrink_triton(x, w, batch, split_k=split_k), w, batch)
