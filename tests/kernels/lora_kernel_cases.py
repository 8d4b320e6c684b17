"""Random multi-LoRA problems and a per-token oracle for the kernel tests."""

from __future__ import annotations

import torch

from loraplex.kernels.lora import LoraBatch, LoraSlotWeights


def random_problem(
    gen: torch.Generator,
    *,
    num_tokens: int,
    in_features: int,
    out_slices: tuple[int, ...],
    slot_ranks: dict[int, list[int]],
    token_slots: list[int],
    num_slots: int,
    max_rank: int = 64,
    views: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """slot_ranks: slot -> rank per slice (0 = slice not targeted). `views`: slots refer to host tensors
    (the CPU adapter cache's way) instead of holding copies. `dtype`: how the slots hold the weights; the
    pairs returned (the oracle's) are the weights as rounded to it."""
    w = LoraSlotWeights(num_slots, in_features, out_slices, max_rank, views=views, dtype=dtype)
    if not views:
        # Fill every slot's full capacity with noise first so reading past a rank would show up as an error.
        w.a.normal_(generator=gen)
        w.b.normal_(generator=gen)
    per_slot = {}
    for slot, ranks in slot_ranks.items():
        pairs = []
        for r, out in zip(ranks, out_slices, strict=True):
            if r == 0:
                pairs.append(None)
            else:
                a = torch.randn(r, in_features, generator=gen) / in_features**0.5
                b = torch.randn(out, r, generator=gen) / r**0.5
                pairs.append((a.to(dtype).float(), b.to(dtype).float()))
        w.set_slot(slot, pairs)
        per_slot[slot] = pairs
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = torch.randn(num_tokens, sum(out_slices), generator=gen)
    batch = LoraBatch.build(token_slots)
    return w, per_slot, x, y, batch


def oracle(x, y, per_slot, token_slots, out_slices):
    """Token by token, slice by slice: the definition of the result."""
    expected = y.clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        o = 0
        for pair, size in zip(per_slot[slot], out_slices, strict=True):
            if pair is not None:
                a, b = pair
                expected[t, o : o + size] += (x[t] @ a.t()) @ b.t()
            o += size
    return expected
