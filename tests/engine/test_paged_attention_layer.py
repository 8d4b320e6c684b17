"""PagedAttention's one-call path for steps with short prefill chunks against the per-chunk path."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import forward_context as fctx
from loraplex.engine.models import layers
from loraplex.kernels import ops_cpu


@pytest.fixture(autouse=True)
def _compiled():
    if not ops_cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")


def _step(gen, block_size=4, num_blocks=40, heads=6, kv_heads=2, head_dim=16):
    """Two decodes, a whole-prompt chunk, and a chunk after a cached prefix of 9 tokens, with their blocks
    scattered through the cache."""
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()

    def table(context):
        return torch.tensor([free.pop() for _ in range(-(-context // block_size))], dtype=torch.int64)

    decode_lens = [7, 13]
    decode_tables = [table(n) for n in decode_lens]
    width = max(t.numel() for t in decode_tables)
    padded = torch.zeros(len(decode_lens), width, dtype=torch.int64)
    for i, t in enumerate(decode_tables):
        padded[i, : t.numel()] = t
    prefills, start, slots = [], len(decode_lens), []
    for query_len, context_len in ((5, 5), (6, 15)):
        t = table(context_len)
        prefills.append(fctx.PrefillSegment(start, query_len, context_len, t))
        start += query_len
    for t, n in zip(decode_tables, decode_lens, strict=True):
        slots.append(int(t[(n - 1) // block_size]) * block_size + (n - 1) % block_size)
    for seg in prefills:
        for pos in range(seg.context_len - seg.query_len, seg.context_len):
            slots.append(int(seg.block_table[pos // block_size]) * block_size + pos % block_size)
    meta = fctx.AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decode_tokens=len(decode_lens),
        decode_block_tables=padded, decode_context_lens=torch.tensor(decode_lens, dtype=torch.int64),
        decode_max_context_len=max(decode_lens), prefills=prefills,
    )
    attn = layers.PagedAttention(heads, kv_heads, head_dim)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    t = len(slots)
    q = torch.randn(t, heads, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    return attn, meta, q, k, v


def test_short_prefills_in_one_call_match_the_per_chunk_path(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    attn, meta, q, k, v = _step(gen)
    caches = attn.k_cache.clone(), attn.v_cache.clone()
    calls = []
    real = ops_cpu.paged_decode_attention
    monkeypatch.setattr(ops_cpu, "paged_decode_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with fctx.forward_context(fctx.ForwardContext(attn=meta)):
        fast = attn(q, k, v)
    assert calls == [q.shape[0]]  # every row, decodes and both chunks, in one call
    assert meta.token_tables[1].tolist() == [7, 13, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]

    attn.k_cache, attn.v_cache = caches
    meta.token_tables = None
    monkeypatch.setattr(layers, "SHORT_PREFILL_CONTEXT", 0)  # every chunk through the per-chunk path
    calls.clear()
    with fctx.forward_context(fctx.ForwardContext(attn=meta)):
        slow = attn(q, k, v)
    assert calls == [2]  # the decodes alone
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
