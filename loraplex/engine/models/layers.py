"""Building blocks of the Llama family: LoRA-aware projections, RMSNorm, rotary embeddings, paged attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine import forward_context as fctx
from loraplex.kernels import ops_cpu
from loraplex.kernels.attention import (
    decode_attention,
    decode_mask,
    prefill_attention,
    window_tables,
    write_kv,
)
from loraplex.kernels.linear_cpu import PackedWeight, packed_linear


class LoraLinear(nn.Module):
    """A projection PEFT may target, possibly several fused along the output (qkv, gate_up).

    After the base matmul it hands the output to the step's LoRA state, if the step has one, with the
    layer index, the PEFT module names and their output widths. Steps without adapters pay one attribute
    read.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: tuple[int, ...],
        *,
        bias: bool,
        layer_idx: int,
        module_names: tuple[str, ...],
        dtype: torch.dtype,
    ):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.layer_idx = layer_idx
        self.module_names = tuple(module_names)
        out = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self._packed: PackedWeight | None = None  # the weight in its packed CPU layout, once packed

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        if self._packed is not None:
            raise ValueError(f"{self.module_names[shard]}: weights are packed for inference; load a new model")
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"{self.module_names[shard]} has no {name}")
        if tuple(tensor.shape) != (size, *target.shape[1:]):
            raise ValueError(
                f"{self.module_names[shard]}.{name}: expected shape {(size, *target.shape[1:])}, "
                f"got {tuple(tensor.shape)}"
            )
        target.data[start : start + size].copy_(tensor)

    def pack_for_cpu(self) -> bool:
        """Pre-pack the weight for the CPU GEMM (fp32 on CPU; see `loraplex.kernels.linear_cpu`). The plain copy
        is released: the forward pass reads only the packed one, and the model's memory stays one copy
        of the weights. Loading weights into a packed projection is refused."""
        from loraplex.kernels.linear_cpu import pack_weight

        if self._packed is not None:
            return True
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self._packed = packed
        self.weight = nn.Parameter(self.weight.new_empty(0, self.in_features), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            y = packed_linear(x, self._packed, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        ctx = fctx._current
        if ctx is not None and ctx.lora is not None:
            y = ctx.lora.apply(self.layer_idx, self.module_names, x, y, self.output_sizes)
        return y


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: adds it first and returns (normed, new residual), saving a pass over memory.
        fp32 CPU rows take the fused kernel, which does both in place: x and residual are overwritten."""
        if residual is not None:
            if ops_cpu.fused_add_rms_norm_(x, residual, self.weight, self.eps):
                return x, residual
            x = x + residual
            residual = x
        else:
            out = ops_cpu.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out if residual is None else (out, residual)


def rope_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of the `dim` rotated dims of a head (all of them, or partial_rotary_factor's share).
    LongRoPE gives its short factors: the engine serves up to its original_max_position_embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":
        # as transformers computes it: fp32 factors times fp32 powers of the base
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return (1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)).double()
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope)")


def rope_attention_scaling(scaling: dict | None) -> float:
    """The factor LongRoPE multiplies cos and sin by (so attention logits grow by its square); 1 otherwise."""
    if (scaling or {}).get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (halves, as Hugging Face's Llama), cos/sin precomputed for every position.

    The model looks up cos/sin once per step; each layer rotates q and k together, in place, in the qkv
    projection's output. `dim` is the rotated part of a head (its leading dims, where partial_rotary_factor
    leaves the rest unrotated).
    """

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        inv_freq = rope_inv_freq(dim, theta, scaling).float()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        attention_scaling = rope_attention_scaling(scaling)
        self.register_buffer("cos", (freqs.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [num_tokens, heads, head_dim] in place; cos/sin: [num_tokens, 1, head_dim / 2]."""
    if not ops_cpu.rotary_(x, cos, sin):
        apply_rotary_torch_(x, cos, sin)


def apply_rotary_torch_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """apply_rotary_ in plain torch."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    new_x1 = x1 * cos
    new_x1 -= x2 * sin
    x2.mul_(cos).add_(x1_sin)
    x1.copy_(new_x1)


# Steps whose prefill chunks all have contexts up to this long attend in one call of the CPU decode kernel,
# each new token a row with its own context length (its K/V is in the cache by then): the chunks' K/V stay
# in cache across their rows, and one call per layer replaces a torch call per sequence. Longer contexts
# go to scaled_dot_product_attention per chunk, whose blocked products scale better with length.
SHORT_PREFILL_CONTEXT = 256


def token_tables(meta: fctx.AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of the step as a decode row: int64 block tables [T, W] and context lengths [T], the
    decodes' own rows first, then each prefill chunk's tokens (token i of a chunk sees the context up to
    and including itself). Built once per step, on the first layer's call."""
    if meta.token_tables is None:
        widths = [seg.block_table.numel() for seg in meta.prefills]
        if meta.num_decode_tokens:
            widths.append(meta.decode_block_tables.shape[1])
        tables = torch.zeros(meta.slot_mapping.numel(), max(widths), dtype=torch.int64)
        lens = torch.zeros(meta.slot_mapping.numel(), dtype=torch.int64)
        n = meta.num_decode_tokens
        if n:
            tables[:n, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
            lens[:n] = meta.decode_context_lens
        for seg in meta.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.query_len)
            tables[rows, : seg.block_table.numel()] = seg.block_table
            first = seg.context_len - seg.query_len + 1
            torch.arange(first, first + seg.query_len, out=lens[rows])
        meta.token_tables = (tables, lens)
    return meta.token_tables


class PagedAttention(nn.Module):
    """Writes the step's new K/V into this layer's cache, then attends over each sequence's blocks: the whole
    context, or with a sliding `window` the last `window` positions up to each token."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.window = window
        self.k_cache: torch.Tensor | None = None  # bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def _decode_inputs(self, meta: fctx.AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decodes' block tables, context lengths and torch-path mask for this layer: with a window, cut to
        it once per step and window, and shared with the layers like it."""
        if self.window is None or meta.decode_block_tables is None:
            return meta.decode_block_tables, meta.decode_context_lens, meta.decode_mask
        cut = meta.decode_windows.get(self.window)
        if cut is None:
            block_size = self.k_cache.shape[2]
            tables, lens = window_tables(meta.decode_block_tables, meta.decode_context_lens, block_size, self.window)
            cut = (tables, lens, decode_mask(tables, lens, block_size, self.window))
            meta.decode_windows[self.window] = cut
        return cut

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H * D]."""
        meta = fctx.get_forward_context().attn
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        num_decodes = meta.num_decode_tokens
        if not meta.prefills:
            tables, lens, mask = self._decode_inputs(meta)
            out = decode_attention(q, self.k_cache, self.v_cache, tables, lens, self.scale, mask, self.window)
            return out.reshape(q.shape[0], -1)
        if (q.dtype == torch.float32 and q.device.type == "cpu" and ops_cpu.available()
                and max(seg.context_len for seg in meta.prefills) <= SHORT_PREFILL_CONTEXT):
            tables, lens = token_tables(meta)
            out = ops_cpu.paged_decode_attention(q, self.k_cache, self.v_cache, tables, lens, self.scale, self.window)
            if out is not None:
                return out.reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        if num_decodes:
            tables, lens, mask = self._decode_inputs(meta)
            out[:num_decodes] = decode_attention(
                q[:num_decodes], self.k_cache, self.v_cache, tables, lens, self.scale, mask, self.window
            )
        for seg in meta.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.query_len)
            out[rows] = prefill_attention(
                q[rows], self.k_cache, self.v_cache, seg.block_table, seg.context_len, self.scale,
                k_new=k[rows], v_new=v[rows], window=self.window,
            )
        return out.reshape(q.shape[0], -1)
