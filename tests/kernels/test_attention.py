"""Paged attention in plain torch against dense causal attention."""

from __future__ import annotations

import torch

from loraplex.kernels.attention import decode_attention, prefill_attention, reference_attention, write_kv


def _paged(k, v, block_size, num_blocks, gen):
    """Scatter a sequence's K/V into randomly chosen blocks; returns caches and the block table."""
    length, heads, dim = k.shape
    k_cache = torch.zeros(heads, num_blocks, block_size, dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_blocks, generator=gen)[: -(-length // block_size)]
    pos = torch.arange(length)
    slots = table[pos // block_size] * block_size + pos % block_size
    write_kv(k_cache, v_cache, k, v, slots)
    return k_cache, v_cache, table


def test_prefill_with_cached_prefix_and_decode_match_dense():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    for length in (1, 5, 13, 32):
        q = torch.randn(length, heads, dim, generator=gen)
        k = torch.randn(length, kv_heads, dim, generator=gen)
        v = torch.randn(length, kv_heads, dim, generator=gen)
        ref = reference_attention(q, k, v, dim**-0.5)
        k_cache, v_cache, table = _paged(k, v, block_size, 16, gen)
        for chunk in {1, max(1, length // 2), length}:
            got = prefill_attention(q[-chunk:], k_cache, v_cache, table, length, dim**-0.5)
            torch.testing.assert_close(got, ref[-chunk:], rtol=1e-5, atol=1e-5)
        got = decode_attention(q[-1:], k_cache, v_cache, table.view(1, -1), torch.tensor([length]), dim**-0.5)
        torch.testing.assert_close(got, ref[-1:], rtol=1e-5, atol=1e-5)


def test_batched_decode_pads_and_masks_each_context():
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size, num_blocks = 4, 4, 8, 4, 32
    k_cache = torch.zeros(kv_heads, num_blocks, block_size, dim)
    v_cache = torch.zeros_like(k_cache)
    k_cache.normal_(generator=gen)  # garbage everywhere: padding must never leak into a result
    v_cache.normal_(generator=gen)
    lengths = [3, 9, 1, 16]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, qs, refs = [], [], []
    for length in lengths:
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        pos = torch.arange(length)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        k = k_cache.view(kv_heads, -1, dim)[:, slots].transpose(0, 1)
        v = v_cache.view(kv_heads, -1, dim)[:, slots].transpose(0, 1)
        q = torch.randn(length, heads, dim, generator=gen)
        refs.append(reference_attention(q, k, v, 0.3)[-1])
        qs.append(q[-1])
    got = decode_attention(torch.stack(qs), k_cache, v_cache, torch.tensor(tables), torch.tensor(lengths), 0.3)
    torch.testing.assert_close(got, torch.stack(refs), rtol=1e-5, atol=1e-5)
