"""The CPU kernels share a call's work between threads as the threads free up (panels of a GEMM, attention
items, LoRA pieces). Which thread computes what must never change a result: every piece of work is computed
by the same code whoever takes it, so 1, 2 or 3 threads give the same bits, also when the work is smaller
than a chunk per thread or not a multiple of one."""

from __future__ import annotations

import pytest
import torch
from lora_kernel_cases import oracle, random_problem
from test_ops_cpu import _decode_problem

from loraplex.kernels import linear_cpu, lora_cpu, ops_cpu
from loraplex.kernels.attention import decode_attention_torch


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _per_thread_count(fn) -> list[torch.Tensor]:
    results = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        results.append(fn())
    return results


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("rows", [1, 5, 32, 64, 65, 700])
@pytest.mark.parametrize("out_features", [16, 40, 577, 3072])
def test_gemm_same_bits_on_any_thread_count(rows, out_features):
    mod = linear_cpu._kernel()
    if mod is None:
        pytest.skip("no panel GEMM on this machine")
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, 96, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    packed = mod.pack(weight)
    results = _per_thread_count(lambda: mod.linear(x, packed, out_features, bias, 0))
    for got in results[1:]:
        assert torch.equal(got, results[0])
    torch.testing.assert_close(results[0], (x.double() @ weight.double().T + bias.double()).float(),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("lengths", [[3], [40, 1, 17], [9] * 31 + [200]])
def test_decode_attention_same_bits_on_any_thread_count(lengths):
    if not ops_cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    gen = torch.Generator().manual_seed(len(lengths))
    q, k_cache, v_cache, tables, lens = _decode_problem(gen, lengths=lengths, num_kv_heads=3, group=3, head_dim=64)
    results = _per_thread_count(
        lambda: ops_cpu._load().paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 0, 0))
    for got in results[1:]:
        assert torch.equal(got, results[0])
    expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("token_slots", [[0, 1, 2, 3, 0, 1, 2, 3, -1], [1] * 90 + [0] * 3 + [3] * 40])
def test_lora_kernel_same_bits_on_any_thread_count(token_slots, monkeypatch):
    if not lora_cpu.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    monkeypatch.setattr(lora_cpu, "MIN_PARALLEL_COST", 0)  # share even these small calls
    gen = torch.Generator().manual_seed(len(token_slots))
    slot_ranks = {0: [4, 4], 1: [64, 64], 2: [16, 0], 3: [8, 32]}
    w, per_slot, x, y, batch = random_problem(
        gen, num_tokens=len(token_slots), in_features=128, out_slices=(96, 40), slot_ranks=slot_ranks,
        token_slots=token_slots, num_slots=4,
    )

    def run():
        out = y.clone()
        lora_cpu.add_lora_cpu(out, x, w, batch)
        return out

    results = _per_thread_count(run)
    for got in results[1:]:
        assert torch.equal(got, results[0])
    torch.testing.assert_close(results[0], oracle(x, y, per_slot, token_slots, (96, 40)), rtol=1e-4, atol=1e-4)
