"""Paged attention in plain torch: the CPU path and the oracle for other kernels.

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for keys and for values, so a
token's slot (block * block_size + offset) indexes a flat [num_slots, num_kv_heads, head_dim] view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] at their slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, max_blocks * block_size, num_kv_heads, head_dim]."""
    batch, max_blocks = block_tables.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    return cache[block_tables].view(batch, max_blocks * block_size, num_kv_heads, head_dim)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence. q: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim].

    All sequences are handled by one batched matmul over K/V gathered through the block tables and
    padded to the longest context; padding is masked out.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = gather_kv(k_cache, block_tables)  # [B, L, Hkv, D]
    values = gather_kv(v_cache, block_tables)
    max_len = keys.shape[1]
    # Grouped queries: each KV head serves `group` query heads, so no K/V expansion is needed.
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, L]
    pad = torch.arange(max_len, device=q.device).view(1, -1) >= context_lens.view(-1, 1)
    scores.masked_fill_(pad.view(batch, 1, 1, max_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk of `query_len` tokens at the end of a context of `context_len` tokens, causal.

    q: [query_len, num_heads, head_dim]. When the chunk is the whole context (no cached prefix), the
    fresh k_new/v_new are used directly instead of reading them back from the cache.
    """
    query_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_new is not None and query_len == context_len:
        keys, values = k_new, v_new
    else:
        keys = gather_kv(k_cache, block_table.view(1, -1))[0, :context_len]
        values = gather_kv(v_cache, block_table.view(1, -1))[0, :context_len]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
    kh = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
    vh = values.transpose(0, 1).unsqueeze(0)
    if query_len == context_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=num_heads != num_kv_heads)
    else:
        # Query i sits at position context_len - query_len + i and sees keys up to that position.
        q_pos = torch.arange(context_len - query_len, context_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(context_len, device=q.device).view(1, -1)
        mask = k_pos <= q_pos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=num_heads != num_kv_heads)
    return out[0].transpose(0, 1)  # [Lq, H, D]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention over one whole sequence, for tests: q [L, H, D], k/v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
