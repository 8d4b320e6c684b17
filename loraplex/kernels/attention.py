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


def decode_mask(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int | None = None
) -> torch.Tensor:
    """[1, batch, 1, max_blocks * block_size] bool: which gathered positions hold a sequence's tokens (with a
    sliding window, only its last `window` tokens). Built once per step (and window) and shared by the layers."""
    max_len = block_tables.shape[1] * block_size
    pos = torch.arange(max_len, device=block_tables.device).view(1, -1)
    lens = context_lens.view(-1, 1)
    valid = pos < lens
    if window is not None:
        valid &= pos >= lens - window
    return valid.view(1, -1, 1, max_len)


def window_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode block tables and context lengths cut to a sliding window: each row starts at the block holding
    its window's first position, so a decode reads no block the window has left behind. Attending over the
    cut rows with the same window gives the same result (the window's positions, counted from the row's end,
    are unchanged)."""
    width = min(block_tables.shape[1], (window + 2 * block_size - 2) // block_size)  # blocks a window can touch
    first = (context_lens - window).clamp(min=0) // block_size
    cols = (first.view(-1, 1) + torch.arange(width, device=block_tables.device)).clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, cols), context_lens - first * block_size


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence. q: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim].

    With a sliding `window`, the query (at position context_len - 1) attends to the last `window` tokens only.
    fp32 on CPU runs the fused kernel (ops_cpu), which reads K/V straight from the blocks; anything else
    (or no compiler) runs the torch path below, which is also the kernel's oracle. `mask` (decode_mask,
    made for the same window) is only used by the torch path.
    """
    out = ops_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window)
    if out is not None:
        return out
    return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, mask, window)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
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
        mask = decode_mask(block_tables, context_lens, block_size, window)
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
    window: int | None = None,
) -> torch.Tensor:
    """A chunk of `query_len` tokens at the end of a context of `context_len` tokens, causal; with a sliding
    `window`, query position p sees keys at positions p - window < k <= p only.

    q: [query_len, num_heads, head_dim]. When the chunk is the whole context (no cached prefix), the
    fresh k_new/v_new are used directly instead of reading them back from the cache.
    """
    query_len, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    first_query = context_len - query_len  # the chunk's first position
    # Keys before the first query's window are seen by no query of the chunk: never read (whole blocks).
    key_start = 0 if window is None else max(0, first_query - window + 1) // block_size * block_size
    if k_new is not None and query_len == context_len and key_start == 0:
        kh = k_new.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
        vh = v_new.transpose(0, 1).unsqueeze(0)
    else:
        blocks = block_table[key_start // block_size :].view(1, -1)
        kh = gather_kv(k_cache, blocks)[:, :, : context_len - key_start].transpose(0, 1)
        vh = gather_kv(v_cache, blocks)[:, :, : context_len - key_start].transpose(0, 1)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
    if query_len == context_len and window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=num_heads != num_kv_heads)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=prefill_mask(first_query, context_len, key_start,
                                                                                 window, q.device),
                                             scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out[0].transpose(0, 1)  # [Lq, H, D]


def prefill_mask(first_query: int, context_len: int, key_start: int, window: int | None,
                 device: torch.device | None = None) -> torch.Tensor:
    """[Lq, Lk] bool: query i (at position first_query + i) sees key j (at position key_start + j) when
    causal and, with a window, no more than window - 1 positions back."""
    q_pos = torch.arange(first_query, context_len, device=device).view(-1, 1)
    k_pos = torch.arange(key_start, context_len, device=device).view(1, -1)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Dense causal attention over one whole sequence, for tests: q [L, H, D], k/v [L, Hkv, D]; with a sliding
    window, position p sees keys p - window < k <= p (transformers' sliding-window mask)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
