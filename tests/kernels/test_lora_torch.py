"""The torch multi-LoRA path (the CPU path and the Triton oracle) against a per-token definition."""

from __future__ import annotations

import pytest
import torch
from lora_kernel_cases import oracle, random_problem

from loraplex.kernels.lora import LoraBatch, LoraSlotWeights, add_lora, add_lora_torch, fuse_slices

QKV = (96, 32, 32)


@pytest.mark.parametrize(
    "token_slots",
    [
        [0, 0, 0, 0],  # one adapter only, already grouped
        [2, -1, 0, 2, -1, 1, 0, 0, 1, -1],  # mixed with base rows
        [-1, -1, 3],  # lora tokens not at the front
        [3, 2, 1, 0],  # every row a different adapter
    ],
)
@pytest.mark.parametrize("views", [False, True], ids=["slot-copies", "slot-views"])
def test_matches_per_token_definition(token_slots, views):
    gen = torch.Generator().manual_seed(len(token_slots))
    slot_ranks = {0: [4, 4, 4], 1: [1, 0, 1], 2: [64, 64, 0], 3: [16, 8, 2]}
    w, per_slot, x, y, batch = random_problem(
        gen, num_tokens=len(token_slots), in_features=80, out_slices=QKV, slot_ranks=slot_ranks,
        token_slots=token_slots, num_slots=4, views=views,
    )
    expected = oracle(x, y, per_slot, token_slots, QKV)
    add_lora_torch(y, x, w, batch)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_no_lora_rows_and_empty_batch_leave_y_untouched():
    w = LoraSlotWeights(2, 8, (8,), 4)
    w.a.normal_()
    w.b.normal_()
    for slots in ([-1, -1, -1], []):
        x = torch.randn(len(slots), 8)
        y = torch.randn(len(slots), 8)
        before = y.clone()
        add_lora(y, x, w, LoraBatch.build(slots))
        assert torch.equal(y, before)


def test_batch_groups_tokens_by_slot():
    batch = LoraBatch.build([5, -1, 2, 5, 2, -1, 0])
    assert batch.slot_ids == [0, 2, 5]
    assert batch.counts == [1, 2, 2]
    assert batch.starts == [0, 1, 3]
    assert batch.sorted_token_ids.tolist() == [6, 2, 4, 0, 3]
    assert not batch.contiguous
    assert LoraBatch.build([1, 1, 4, -1]).contiguous
    # the same grouping from a tensor of slots (any shape), with the group table as int32 tensors
    for given in (torch.tensor([5, -1, 2, 5, 2, -1, 0]), torch.tensor([[5, -1, 2, 5, 2, -1, 0]])):
        same = LoraBatch.build(given)
        assert (same.num_tokens, same.slot_ids, same.starts, same.counts) == (7, [0, 2, 5], [0, 1, 3], [1, 2, 2])
        assert same.sorted_token_ids.dtype == torch.int64 and same.sorted_token_ids.tolist() == [6, 2, 4, 0, 3]
    assert [t.tolist() for t in (batch.slot_ids_t, batch.starts_t, batch.counts_t)] == [[0, 2, 5], [0, 1, 3], [1, 2, 2]]
    assert batch.slot_ids_t.dtype == torch.int32
    empty = LoraBatch.build([-1, -1])
    assert empty.empty and empty.num_tokens == 2 and empty.num_lora_tokens == 0 and empty.slot_ids_t.numel() == 0


@pytest.mark.parametrize("views", [False, True], ids=["slot-copies", "slot-views"])
def test_cleared_slot_contributes_nothing(views):
    gen = torch.Generator().manual_seed(0)
    w, _, x, y, batch = random_problem(
        gen, num_tokens=3, in_features=16, out_slices=(16,), slot_ranks={1: [8]}, token_slots=[1, 1, 1],
        num_slots=2, views=views,
    )
    w.clear_slot(1)
    before = y.clone()
    add_lora_torch(y, x, w, batch)
    assert torch.equal(y, before)
    add_lora(y, x, w, batch)  # the CPU kernel where it is built: an empty slot is never read
    assert torch.equal(y, before)


def test_slot_views_refer_to_the_host_tensors_without_copying():
    """With views, placing an adapter in a slot copies nothing: the slot reads the fused host tensors, and
    clearing it drops them. Copies mode copies the same tensors in; both give the same result."""
    gen = torch.Generator().manual_seed(1)
    pairs = [(torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen)), None,
             (torch.randn(2, 16, generator=gen), torch.randn(4, 2, generator=gen))]
    a, b = fuse_slices(pairs, 16, (8, 6, 4))
    assert a.shape == (6, 16) and b.shape == (4, 18)
    torch.testing.assert_close(b[:2, 14:], pairs[2][1].t())
    assert torch.equal(b[2:, 14:], torch.zeros(2, 4))  # below the largest rank: zero, never read
    views, copies = LoraSlotWeights(2, 16, (8, 6, 4), 8, views=True), LoraSlotWeights(2, 16, (8, 6, 4), 8)
    for w in (views, copies):
        w.set_slot_fused(1, a, b, [4, 0, 2])
    assert views.slot_a(1).data_ptr() == a.data_ptr() and views.a_ptrs[1] == a.data_ptr()
    assert copies.slot_a(1).data_ptr() != a.data_ptr()
    x, batch = torch.randn(3, 16, generator=gen), LoraBatch.build([1, -1, 1])
    y1, y2 = torch.zeros(3, 18), torch.zeros(3, 18)
    add_lora_torch(y1, x, views, batch)
    add_lora(y2, x, copies, batch)
    torch.testing.assert_close(y1, y2)
    assert y1[1].abs().sum() == 0 and y1[0].abs().sum() > 0
    views.clear_slot(1)
    assert views.slot_a(1) is None and int(views.a_ptrs[1]) == 0
    with pytest.raises(ValueError, match="do not fit"):
        views.set_slot_fused(0, a, b, [4, 0, 3])
    with pytest.raises(ValueError, match="CPU only"):
        LoraSlotWeights(1, 16, (8,), 4, device="meta", views=True)


def test_set_slot_refuses_wrong_shapes_and_ranks():
    w = LoraSlotWeights(1, 8, (8, 4), 4)
    with pytest.raises(ValueError, match="slices"):
        w.set_slot(0, [None])
    with pytest.raises(ValueError, match="do not fit"):
        w.set_slot(0, [(torch.zeros(2, 8), torch.zeros(4, 2)), None])
    with pytest.raises(ValueError, match="max_rank"):
        w.set_slot(0, [(torch.zeros(8, 8), torch.zeros(8, 8)), None])
