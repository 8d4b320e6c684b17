"""Triton shrink/expand against the torch path, on fresh random inputs (interpreter on CPU machines)."""

from __future__ import annotations

import pytest
import torch
from lora_kernel_cases import random_problem

from loraplex.kernels.lora import LoraBatch, add_lora_torch, lora_shrink_torch

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run_both(w, x, y, batch, split_k=1):
    from loraplex.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    ref = y.clone()
    add_lora_torch(ref, x, w, batch)
    dev_batch = LoraBatch.build(batch_slots(batch), device=DEVICE)
    _to_device(w)
    got = y.to(DEVICE)
    shrunk = lora_shrink_triton(x.to(DEVICE), w, dev_batch, split_k=split_k)
    lora_expand_triton(got, shrunk, w, dev_batch)
    return ref, got.cpu()


def _to_device(w) -> None:
    for name in ("a", "b", "ranks_t", "rank_offsets_t", "rank_totals_t", "out_sizes_t", "out_offsets_t"):
        setattr(w, name, getattr(w, name).to(DEVICE))


def batch_slots(batch: LoraBatch) -> list[int]:
    slots = [-1] * batch.num_tokens
    for slot, start, count in zip(batch.slot_ids, batch.starts, batch.counts, strict=True):
        for t in batch.sorted_token_ids[start : start + count].tolist():
            slots[t] = slot
    return slots


def _case(seed, *, hidden, out_slices, slot_ranks, token_slots, num_slots, split_k=1):
    gen = torch.Generator().manual_seed(seed)
    w, _, x, y, batch = random_problem(
        gen, num_tokens=len(token_slots), in_features=hidden, out_slices=out_slices,
        slot_ranks=slot_ranks, token_slots=token_slots, num_slots=num_slots,
    )
    ref, got = _run_both(w, x, y, batch, split_k)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_mixed_ranks_fused_qkv_with_base_rows():
    _case(
        1, hidden=576, out_slices=(64, 16, 16),
        slot_ranks={0: [1, 1, 1], 1: [17, 0, 17], 2: [64, 64, 64], 3: [8, 8, 0]},
        token_slots=[2, -1, 0, 3, 3, 1, -1, 2, 2, 0, 1, 3, 2, 2, 2, 2, 2, 2, 2, 2],
        num_slots=5,
    )


def test_lm_head_shape_vocab_wide_output():
    """LoRA on the LM head: one slice as wide as a vocabulary (not a multiple of any block), on the few sampled
    rows of a step, some without an adapter or with one that leaves the head alone (rank 0)."""
    _case(
        4, hidden=64, out_slices=(1003,),
        slot_ranks={0: [4], 1: [0], 2: [16]},
        token_slots=[2, -1, 0, 1, 2, 0],
        num_slots=3,
    )


def test_every_row_a_different_adapter():
    ranks = [1, 3, 8, 16, 31, 33, 64]
    _case(
        2, hidden=96, out_slices=(48,), slot_ranks={i: [r] for i, r in enumerate(ranks)},
        token_slots=list(reversed(range(len(ranks)))), num_slots=len(ranks),
    )


def test_one_adapter_only_prefill_segment_split_k():
    _case(
        3, hidden=576, out_slices=(40, 24), slot_ranks={1: [16, 16]}, token_slots=[1] * 37,
        num_slots=2, split_k=3,
    )


def test_empty_batch_and_no_lora_rows():
    from loraplex.kernels.lora_triton import lora_shrink_triton

    gen = torch.Generator().manual_seed(4)
    for token_slots in ([], [-1, -1]):
        w, _, x, y, batch = random_problem(
            gen, num_tokens=len(token_slots), in_features=32, out_slices=(32,), slot_ranks={0: [4]},
            token_slots=token_slots, num_slots=1,
        )
        ref, got = _run_both(w, x, y, batch)
        assert torch.equal(got, ref)
        assert lora_shrink_triton(x, w, batch).shape == (0, 64)


def test_shrink_matches_on_meaningful_columns():
    from loraplex.kernels.lora_triton import lora_shrink_triton

    gen = torch.Generator().manual_seed(5)
    w, _, x, _, batch = random_problem(
        gen, num_tokens=6, in_features=50, out_slices=(16, 16), slot_ranks={0: [5, 0], 1: [2, 7]},
        token_slots=[1, 0, 1, -1, 0, 0], num_slots=2,
    )
    ref = lora_shrink_torch(x, w, batch)
    _to_device(w)
    got = lora_shrink_triton(x.to(DEVICE), w, LoraBatch.build(batch_slots(batch), device=DEVICE)).cpu()
    for slot, start, count in zip(batch.slot_ids, batch.starts, batch.counts, strict=True):
        rt = w.rank_total(slot)
        torch.testing.assert_close(got[start : start + count, :rt], ref[start : start + count, :rt])


@pytest.mark.slow
@pytest.mark.parametrize("hidden,out_slices", [(576, (576, 192, 192)), (1536, (576,)), (576, (1536, 1536))])
def test_demo_model_shapes(hidden, out_slices):
    gen = torch.Generator().manual_seed(hidden)
    ranks = [1, 8, 16, 32, 64, 5]
    token_slots = torch.randint(-1, len(ranks), (48,), generator=gen).tolist()
    _case(
        6, hidden=hidden, out_slices=out_slices,
        slot_ranks={i: [r] * len(out_slices) for i, r in enumerate(ranks)},
        token_slots=token_slots, num_slots=len(ranks),
    )


# Shapes the cases above leave out: groups past 64 tokens (the 64-row tiles), K not a multiple of the 128-deep
# shrink step split over programs, half-precision activations and slots. bf16 is left to GPU runs: the
# interpreter multiplies bf16 tiles in tl.dot as raw integers (a plain bf16 load and store is exact there).
@pytest.mark.parametrize("dtype,split_k", [
    (torch.float32, 1), (torch.float32, 3), (torch.float16, 1), (torch.float16, 2),
])
def test_long_groups_uneven_k_and_half_precision(dtype, split_k):
    gen = torch.Generator().manual_seed(7)
    token_slots = [0] * 70 + [-1, 2, 1] * 5 + [2] * 66
    w, _, x, y, batch = random_problem(
        gen, num_tokens=len(token_slots), in_features=300, out_slices=(130, 17, 40),
        slot_ranks={0: [64, 1, 0], 1: [3, 3, 3], 2: [0, 0, 33]}, token_slots=token_slots, num_slots=3,
        dtype=dtype,
    )
    x, y = x.to(dtype), y.to(dtype)
    ref, got = _run_both(w, x, y, batch, split_k)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
