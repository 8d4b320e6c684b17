"""The fused CPU kernel against the definition: decode-size groups, prefill-size groups, mixed."""

from __future__ import annotations

import pytest
import torch
from lora_kernel_cases import oracle, random_problem

from loraplex.kernels import lora_cpu
from loraplex.kernels.lora import add_lora_torch


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    if not lora_cpu.available():
        pytest.skip("no C++ compiler for the CPU kernel")


@pytest.mark.parametrize(
    "token_slots",
    [
        [0, 2, -1, 1, 0, 2, 3, -1],  # decode-like: a few tokens per adapter
        [1] * 20 + [-1] * 3 + [0] * 2,  # one prefill segment plus a small group
        [1] * 70 + [0] * 33 + [-1] * 4 + [3] * 3,  # long segments: cut into pieces spread over threads
        [3, 2, 1, 0],  # every row a different adapter, sorted order reversed
        [0] * 5 + [1] * 17,  # contiguous lora tokens
        [3, 0, 3, 3, 2, 3, 0, 3, 3, 0, 3, 0, 0, 3, 2],  # groups of 4-8 tokens: blocks of four plus a rest
    ],
)
# 1100 inputs: a prefill block's shrink runs in three blocks of the K columns (368, 368, 364: the last with a
# rest past its full vectors), each added to the sums of the ones before
@pytest.mark.parametrize("hidden,out_slices", [(576, (64, 16, 16)), (96, (40,)), (101, (24, 7)), (1100, (24, 8))])
@pytest.mark.parametrize("views", [False, True], ids=["slot-copies", "slot-views"])
def test_cpu_kernel_matches_definition(token_slots, hidden, out_slices, views):
    gen = torch.Generator().manual_seed(len(token_slots) + hidden)
    slot_ranks = {
        0: [1] * len(out_slices),
        1: [64] * len(out_slices),
        2: [17] + [0] * (len(out_slices) - 1),
        3: [8] * len(out_slices),
    }
    w, per_slot, x, y, batch = random_problem(
        gen, num_tokens=len(token_slots), in_features=hidden, out_slices=out_slices, slot_ranks=slot_ranks,
        token_slots=token_slots, num_slots=5, views=views,
    )
    expected = oracle(x, y, per_slot, token_slots, out_slices)
    lora_cpu.add_lora_cpu(y, x, w, batch)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


def _mixed_problem(token_slots, hidden, out_slices, **kw):
    """Five slots: rank 1, rank 64, one slice of rank 17 only, rank 8 (and one empty), over `token_slots`."""
    gen = torch.Generator().manual_seed(len(token_slots) + hidden)
    slot_ranks = {0: [1] * len(out_slices), 1: [64] * len(out_slices),
                  2: [17] + [0] * (len(out_slices) - 1), 3: [8] * len(out_slices)}
    return random_problem(gen, num_tokens=len(token_slots), in_features=hidden, out_slices=out_slices,
                          slot_ranks=slot_ranks, token_slots=token_slots, num_slots=5, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("views", [False, True], ids=["slot-copies", "slot-views"])
def test_cpu_kernel_reads_half_precision_slots(dtype, views):
    """Slots in fp16/bf16 (`lora_dtype`): the kernel widens the weights as it reads them and matches the
    definition computed in fp32 on the same rounded weights, for decode groups, prefill pieces and rows
    that are no multiple of the vector width; the torch path agrees too."""
    for token_slots in ([0, 2, -1, 1, 0, 2, 3, -1], [1] * 70 + [0] * 33 + [-1] * 4 + [3] * 3):
        for hidden, out_slices in ((576, (64, 16, 16)), (101, (24, 7)), (1100, (24, 8))):
            w, per_slot, x, y, batch = _mixed_problem(token_slots, hidden, out_slices, views=views, dtype=dtype)
            assert w.slot_a(1).dtype == dtype
            expected = oracle(x, y, per_slot, token_slots, out_slices)
            y_torch = y.clone()
            lora_cpu.add_lora_cpu(y, x, w, batch)
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
            add_lora_torch(y_torch, x, w, batch)
            torch.testing.assert_close(y_torch, expected, rtol=1e-4, atol=1e-4)


def test_cpu_kernel_empty_and_base_only():
    gen = torch.Generator().manual_seed(0)
    for token_slots in ([], [-1, -1, -1]):
        w, _, x, y, batch = random_problem(
            gen, num_tokens=len(token_slots), in_features=32, out_slices=(32,), slot_ranks={0: [4]},
            token_slots=token_slots, num_slots=1,
        )
        before = y.clone()
        lora_cpu.add_lora_cpu(y, x, w, batch)
        assert torch.equal(y, before)


def test_step_fast_path_shares_one_buffer_across_projections_of_different_widths():
    """A step's calls share one shrunk buffer as wide as the widest projection: every projection, narrow
    or wide, still gets its own adapter's delta; calls the kernel cannot take are left to the caller."""
    from loraplex.engine.lora_layers import LoraStep

    gen = torch.Generator().manual_seed(7)
    token_slots = [0, 2, -1, 1, 0, 2, 1, 1, 0]
    problems = {}
    for key, (hidden, out_slices, ranks) in {
        (0, "q_proj"): (96, (64, 16, 16), {0: [4, 4, 4], 1: [32, 32, 32], 2: [8, 0, 8]}),
        (0, "o_proj"): (64, (96,), {0: [2], 1: [16], 2: [5]}),
    }.items():
        problems[key] = random_problem(
            gen, num_tokens=len(token_slots), in_features=hidden, out_slices=out_slices, slot_ranks=ranks,
            token_slots=token_slots, num_slots=3,
        ) + (out_slices,)
    batch = problems[(0, "q_proj")][4]
    step = LoraStep(batch, {k: p[0] for k, p in problems.items()})
    assert step._cpu is not None
    for (layer, name), (_w, per_slot, x, y, _, out_slices) in problems.items():
        expected = oracle(x, y, per_slot, token_slots, out_slices)
        step.apply(layer, (name,), x, y, out_slices)
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    w, _, x, y, _, _ = problems[(0, "o_proj")]
    assert step._cpu(y, x.double(), w) is False  # not fp32: the caller's general path runs instead


@pytest.mark.slow
def test_cpu_kernel_built_without_avx512_matches_definition():
    """The kernel's 8-wide build (machines without AVX-512) and its portable build are checked here too,
    whatever this machine has."""
    import platform

    from loraplex.kernels.cpp_build import InlineExtension

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    mod = InlineExtension(
        f"{lora_cpu.EXTENSION_NAME}_noavx512", lora_cpu._SOURCE, ["lora_groups"], what="CPU LoRA kernel (AVX2)",
        extra_cflags=["-mno-avx512f"],
    ).load()
    # and the portable build (no AVX2, no F16C: half-precision weights widened one at a time in C++)
    generic = InlineExtension(
        f"{lora_cpu.EXTENSION_NAME}_generic", lora_cpu._SOURCE, ["lora_groups"], what="CPU LoRA kernel (generic)",
        extra_cflags=["-mno-avx512f", "-mno-avx2", "-mno-f16c"],
    ).load()
    if mod is None or generic is None:
        pytest.skip("no C++ compiler")
    cases = [([0, 2, -1, 1, 0, 2, 3, -1], torch.float32, mod),
             ([1] * 70 + [0] * 33 + [-1] * 4 + [3] * 3, torch.float32, mod),
             ([0, 2, -1, 1, 0, 2, 3, -1], torch.float16, mod), ([1] * 40 + [2] * 3 + [0], torch.bfloat16, mod),
             ([0, 2, -1, 1, 0, 2, 3, -1], torch.float16, generic), ([1] * 40 + [2] * 3 + [0], torch.float16, generic),
             ([1] * 40 + [2] * 3 + [0], torch.bfloat16, generic)]
    for token_slots, dtype, mod in cases:
        for hidden, out_slices in ((576, (64, 16, 16)), (101, (24, 7)), (1100, (24, 8))):
            w, per_slot, x, y, batch = _mixed_problem(token_slots, hidden, out_slices, dtype=dtype)
            expected = oracle(x, y, per_slot, token_slots, out_slices)
            groups = lora_cpu._groups(batch)
            shrunk = torch.empty(batch.num_lora_tokens, w.a_rows)
            mod.lora_groups(y, x, w.a_ptrs, w.b_ptrs, w.in_features, w.out_features, lora_cpu._WEIGHT_DTYPES[dtype],
                            batch.sorted_token_ids, groups, w.ranks_t, w.rank_offsets_t, w.out_meta, shrunk, 0)
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
