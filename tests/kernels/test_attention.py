"""Paged attention in plain torch (and the CPU kernel where it applies) against dense causal attention, with
and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.attention import (
    decode_attention,
    decode_attention_torch,
    decode_mask,
    prefill_attention,
    reference_attention,
    window_tables,
    write_kv,
)


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


def _dense(length, heads, kv_heads, dim, gen):
    return (torch.randn(length, heads, dim, generator=gen), torch.randn(length, kv_heads, dim, generator=gen),
            torch.randn(length, kv_heads, dim, generator=gen))


def test_reference_window_is_transformers_boundary():
    # position p sees keys p - window < k <= p: the last `window` positions, itself included
    gen = torch.Generator().manual_seed(2)
    q, k, v = _dense(6, 2, 2, 4, gen)
    v = torch.eye(6).view(6, 1, 6).expand(6, 2, 6).contiguous()[..., :4]  # value of key j: one-hot j (j < 4)
    q, k = q.zero_(), k.zero_()  # equal scores: each query spreads evenly over the keys it sees
    got = reference_attention(q, k, v, 1.0, window=3)
    assert torch.allclose(got[5, 0], torch.tensor([0.0, 0.0, 0.0, 1 / 3]))  # keys 3, 4, 5 (4 and 5 past D)
    assert torch.allclose(got[2, 0], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
    assert torch.allclose(got[1, 0], torch.tensor([0.5, 0.5, 0.0, 0.0]))


@pytest.mark.parametrize("window", [1, 3, 4, 7, 9, 64])
def test_windowed_prefill_chunks_and_decode_match_dense(window):
    gen = torch.Generator().manual_seed(window)
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    for length in (1, 5, 13, 32, 45):
        q, k, v = _dense(length, heads, kv_heads, dim, gen)
        ref = reference_attention(q, k, v, dim**-0.5, window=window)
        k_cache, v_cache, table = _paged(k, v, block_size, 16, gen)
        # chunks that start at an offset (a cached prefix or an earlier chunk), inside and past the window
        for chunk in {1, 2, max(1, length // 2), length - 3, length}:
            if chunk < 1:
                continue
            got = prefill_attention(q[-chunk:], k_cache, v_cache, table, length, dim**-0.5,
                                    k_new=k[-chunk:], v_new=v[-chunk:], window=window)
            torch.testing.assert_close(got, ref[-chunk:], rtol=1e-5, atol=1e-5)
        lens = torch.tensor([length])
        got = decode_attention(q[-1:], k_cache, v_cache, table.view(1, -1), lens, dim**-0.5, window=window)
        torch.testing.assert_close(got, ref[-1:], rtol=1e-5, atol=1e-5)
        got = decode_attention_torch(q[-1:], k_cache, v_cache, table.view(1, -1), lens, dim**-0.5, window=window)
        torch.testing.assert_close(got, ref[-1:], rtol=1e-5, atol=1e-5)


def test_windowed_prefill_never_reads_blocks_before_the_window():
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block_size, window = 4, 2, 8, 4, 6
    length = 30
    q, k, v = _dense(length, heads, kv_heads, dim, gen)
    ref = reference_attention(q, k, v, 0.4, window=window)
    k_cache, v_cache, table = _paged(k, v, block_size, 16, gen)
    # the chunk's first query (position 26) sees positions 21.. (block 5 on): earlier blocks hold NaN
    for blk in table[:5]:
        k_cache[:, blk] = float("nan")
        v_cache[:, blk] = float("nan")
    got = prefill_attention(q[-4:], k_cache, v_cache, table, length, 0.4, window=window)
    torch.testing.assert_close(got, ref[-4:], rtol=1e-5, atol=1e-5)


def test_batched_windowed_decode_of_mixed_lengths():
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block_size, num_blocks, window = 8, 2, 16, 4, 64, 10
    k_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen)  # garbage outside the sequences
    v_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen)
    lengths = [1, 9, 10, 11, 23, 40]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, qs, refs = [], [], []
    for length in lengths:
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks + [0] * (10 - len(blocks)))
        pos = torch.arange(length)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        k = k_cache.view(kv_heads, -1, dim)[:, slots].transpose(0, 1)
        v = v_cache.view(kv_heads, -1, dim)[:, slots].transpose(0, 1)
        q = torch.randn(length, heads, dim, generator=gen)
        refs.append(reference_attention(q, k, v, 0.3, window=window)[-1])
        qs.append(q[-1])
    args = (torch.stack(qs), k_cache, v_cache, torch.tensor(tables), torch.tensor(lengths), 0.3)
    expected = torch.stack(refs)
    torch.testing.assert_close(decode_attention(*args, window=window), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_attention_torch(*args, window=window), expected, rtol=1e-5, atol=1e-5)
    mask = decode_mask(args[3], args[4], block_size, window)
    assert mask[0, :, 0].sum(-1).tolist() == [min(n, window) for n in lengths]
    torch.testing.assert_close(decode_attention_torch(*args, mask=mask, window=window), expected,
                               rtol=1e-5, atol=1e-5)
    # without the window every longer row attends further back and comes out different
    whole = decode_attention(*args)
    assert not torch.allclose(whole[3:], expected[3:], atol=1e-3)
    torch.testing.assert_close(whole[:3], expected[:3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,window", [(4, 10), (4, 8), (4, 1), (16, 5), (3, 200)])
def test_decode_over_tables_cut_to_the_window(block_size, window):
    """Tables cut to the window give the uncut results, and the torch path then reads no block before it."""
    gen = torch.Generator().manual_seed(block_size * window)
    heads, kv_heads, dim, num_blocks = 4, 2, 8, 80
    lengths = [1, window, window + 1, 23, 61, 2]
    k_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen)
    width = -(-max(lengths) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lengths])
    lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, 0.3, window=window)
    cut_tables, cut_lens = window_tables(tables, lens, block_size, window)
    assert cut_tables.shape[1] <= min(width, -(-(window + block_size - 1) // block_size))
    assert all(0 < n <= window + block_size - 1 for n in cut_lens.tolist())
    mask = decode_mask(cut_tables, cut_lens, block_size, window)
    for fn in (decode_attention, decode_attention_torch):
        got = fn(q, k_cache, v_cache, cut_tables, cut_lens, 0.3, mask, window)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # blocks no row's cut table names hold NaN: nothing reads them
    unused = sorted(set(tables.flatten().tolist()) - set(cut_tables.flatten().tolist()))
    k_cache[:, unused] = float("nan")
    v_cache[:, unused] = float("nan")
    got = decode_attention_torch(q, k_cache, v_cache, cut_tables, cut_lens, 0.3, mask, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
