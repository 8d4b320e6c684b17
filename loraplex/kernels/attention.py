"""Paged attention in plain torch: the CPU path and the oracle for other kernels.

KV cache layout per layer, for keys and for values: [num_kv_heads, num_blocks, block_size, head_dim], so a
token's slot (block * block_size + offset) indexes a flat [num_kv_heads, num_slots, head_dim] view, and
gathering a batch's blocks yields [num_kv_heads, batch, tokens, head_dim] ready for batched matmuls with
no transposing copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels import ops_cpu


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] at their slots."""
    if ops_cpu.write_kv_(k_cache, v_cache, k, v, slot_mapping):
        return
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [num_kv_heads, batch, max_blocks * block_size, head_dim]."""
    batch, max_blocks = block_tables.shape
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    # index_select copies whole blocks (contiguous rows); advanced indexing is several times slower here.
    flat = cache.view(num_kv_heads, num_blocks, block_size * head_dim)
    gathered = flat.index_select(1, block_tables.reshape(-1))
    return gathered.view(num_kv_heads, batch, max_blocks * block_size, head_dim)


def decode_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """[1, batch, 1, max_blocks * block_size] bool: which gathered positions hold a sequence's tokens.
    Built once per step and shared by every layer."""
    max_len = block_tables.shape[1] * block_size
    valid = torch.arange(max_len, device=block_tables.device).view(1, -1) < context_lens.view(-1, 1)
    return valid.view(1, -1, 1, max_len)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence. q: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim].

    fp32 on CPU runs the fused kernel (ops_cpu), which reads K/V straight from the blocks; anything else
    (or no compiler) runs the torch path below, which is also the kernel's oracle. `mask` (decode_mask)
    is only used by the torch path.
    """
    out = ops_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if out is not None:
        return out
    return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, mask)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """decode_attention in plain torch.

    All sequences are handled by one fused attention call over K/V gathered through the block tables and
    padded to the longest context; padding is masked out. The gathered layout puts KV heads first, so the
    call sees them as the batch and the sequences as heads, and each KV head serves its group of query
    heads as that head's queries: no K/V expansion for grouped-query attention.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if mask is None:
        mask = decode_mask(block_tables, context_lens, block_size)
    keys = gather_kv(k_cache, block_tables)  # [Hkv, B, L, D]
    values = gather_kv(v_cache, block_tables)
    qg = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


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
    num_kv_heads = k_cache.shape[0]
    if k_new is not None and query_len == context_len:
        kh = k_new.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
        vh = v_new.transpose(0, 1).unsqueeze(0)
    else:
        kh = gather_kv(k_cache, block_table.view(1, -1))[:, :, :context_len].transpose(0, 1)
        vh = gather_kv(v_cache, block_table.view(1, -1))[:, :, :context_len].transpose(0, 1)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
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
