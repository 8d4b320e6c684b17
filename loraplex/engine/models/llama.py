"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2) with fused qkv and gate_up projections.

Qwen3 adds a per-head RMSNorm on q and k before the rotary embedding; Phi-3's checkpoints hold qkv_proj and
gate_up_proj fused already (the layout the engine uses), and may rotate only part of each head.

Input is a flat batch of tokens from many sequences; the forward context says which tokens belong to
which sequence and where their K/V live.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine import forward_context as fctx
from loraplex.engine.lora_layers import LoraStep, top_projections
from loraplex.engine.models.arch import ModelArch
from loraplex.engine.models.layers import (
    SHORT_PREFILL_CONTEXT,
    LoraLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary_,
    token_tables,
)
from loraplex.kernels import lora_cpu, ops_cpu
from loraplex.kernels.linear_cpu import BLAS_MIN_ROWS, PackedWeight, linear_address, packed_linear
from loraplex.kernels.linear_cpu import MIN_PARALLEL_COST as GEMM_COST
from loraplex.kernels.lora_cpu import MIN_PARALLEL_COST as LORA_COST

# PEFT module name -> (our fused module, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.qkv_proj = LoraLinear(
            arch.hidden_size, (arch.q_size, arch.kv_size, arch.kv_size), bias=arch.qkv_bias,
            layer_idx=layer_idx, module_names=("q_proj", "k_proj", "v_proj"), dtype=dtype,
        )
        self.o_proj = LoraLinear(
            arch.q_size, (arch.hidden_size,), bias=arch.o_bias, layer_idx=layer_idx, module_names=("o_proj",),
            dtype=dtype,
        )
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.layer_windows[layer_idx])
        self.rotary_dim = arch.rotary_dim or arch.head_dim
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_tokens = x.shape[0]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Qwen3: each head of q and of k normed over head_dim before the rotation
            q = self.q_norm(qkv[:, :q_end].reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, -1)
            k = self.k_norm(qkv[:, q_end:k_end].reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, -1)
            apply_rotary_(q[..., : self.rotary_dim], *rope)
            apply_rotary_(k[..., : self.rotary_dim], *rope)
            return self.o_proj(self.attn(q, k, v))
        apply_rotary_(qkv[:, :k_end].view(num_tokens, -1, self.head_dim)[..., : self.rotary_dim], *rope)
        q = qkv[:, :q_end].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = LoraLinear(
            arch.hidden_size, (arch.intermediate_size, arch.intermediate_size), bias=arch.mlp_bias,
            layer_idx=layer_idx, module_names=("gate_proj", "up_proj"), dtype=dtype,
        )
        self.down_proj = LoraLinear(
            arch.intermediate_size, (arch.hidden_size,), bias=arch.mlp_bias, layer_idx=layer_idx,
            module_names=("down_proj",), dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = ops_cpu.silu_and_mul(gate_up)  # fp32 CPU: one pass; otherwise None
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate).mul_(up)
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx, dtype)
        self.mlp = LlamaMLP(arch, layer_idx, dtype)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, rope, x, residual):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


_LORA_PROJECTIONS = ("q_proj", "o_proj", "gate_proj", "down_proj")  # each layer's LoraLinear, by first name


class DecoderStack:
    """Runs a step's decoder layers in one C++ call (`ops_cpu.decoder_stack`) where the module path would call
    the same CPU kernels one by one: fp32 on the CPU, every projection packed as panels, the compiled kernels
    present, and steps whose attention is the paged decode kernel's (decodes, short prefill chunks; each
    layer's sliding window, if it has one, is the kernel's argument as on the module path) and
    whose products stay on the panels (fewer than BLAS_MIN_ROWS rows). It expresses the family's variants: any
    projection's bias (Qwen2's qkv, Llama's attention_bias and mlp_bias), Qwen3's per-head q/k norms, and a
    rotation of each head's leading rotary_dim dims only (partial_rotary_factor). Same kernels, same order, same
    arguments: the outputs are the module path's bit for bit. Any other step returns None and the modules
    run. On a 2-core EPYC a 32-row decode step of SmolLM2 spent about a tenth of its time in the Python
    around its 30 layers' kernels."""

    def __init__(self, model: LlamaModel, linear_fn: int):
        self.model = model
        self.linear_fn = linear_fn
        self._static: tuple | None = None
        self._lora_key: tuple | None = None  # (slot weights, width) that _lora_static was made for
        self._lora_static: tuple | None = None

    @classmethod
    def for_model(cls, model: LlamaModel) -> DecoderStack | None:
        if os.environ.get("LORAPLEX_CPU_DECODER_STACK", "1") == "0" or not ops_cpu.available():
            return None
        linears = [m for m in model.modules() if isinstance(m, LoraLinear)]
        if not linears or any(m._packed is None or m._packed.kind != "panels" for m in linears):
            return None
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        tensors = [model.embed_tokens.weight, *(m.weight for m in norms), *(m.bias for m in linears if m.bias is not None)]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            return None
        if any(m.eps != model.norm.eps for m in norms):  # the C++ stack takes one eps for every norm
            return None
        address = linear_address()
        return None if address is None else cls(model, address)

    def _static_args(self) -> tuple:
        """The per-layer tensors, once the runner has bound the KV caches (rebuilt if it binds others)."""
        layers = self.model.layers
        first = layers[0].self_attn.attn.k_cache
        if self._static is None or self._static[0] is not first:
            flat, biases, qk_norms, caches = [], [], [], []
            none = torch.empty(0)  # a projection without a bias
            for layer in layers:
                attn, mlp = layer.self_attn, layer.mlp
                projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                flat += [layer.input_layernorm.weight, attn.qkv_proj._packed.data, attn.o_proj._packed.data,
                         layer.post_attention_layernorm.weight, mlp.gate_up_proj._packed.data,
                         mlp.down_proj._packed.data]
                biases += [none if p.bias is None else p.bias for p in projections]
                if attn.q_norm is not None:
                    qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
                caches += [attn.attn.k_cache, attn.attn.v_cache]
            if all(b is none for b in biases):
                biases = []
            if any(c is None or not c.is_contiguous() for c in caches):
                raise RuntimeError("the KV caches are not bound")
            a = layers[0].self_attn
            sizes = [a.num_heads, a.num_kv_heads, a.head_dim, a.o_proj.output_sizes[0],
                     layers[0].mlp.intermediate_size, a.rotary_dim]
            windows = [layer.self_attn.attn.window or 0 for layer in layers]  # 0: the whole context
            self._static = (first, flat, biases, qk_norms, caches, sizes, a.attn.scale,
                            windows if any(windows) else [])
        return self._static

    def _lora_args(self, lora) -> tuple[list, list, list, int] | None:
        if not isinstance(lora, LoraStep) or lora._cpu is None:
            return None
        cpu = lora._cpu
        # The per-projection part depends only on the slot weights (whose slot tables are updated in place
        # as adapters load) and the step's shrunk-values width: made once per adapter cache, not per step
        # (120 projections' lookups were about 0.2 ms of every decode step).
        key = (lora.weights, cpu.width)
        if self._lora_key is None or self._lora_key[0] is not key[0] or self._lora_key[1] != key[1]:
            self._lora_key, self._lora_static = key, self._lora_static_args(lora.weights, cpu)
        if self._lora_static is None:
            return None
        tensors, dims, address = self._lora_static
        return tensors, dims, cpu.step_tensors(), address

    def _lora_static_args(self, weights, cpu) -> tuple[list, list, int] | None:
        tensors, dims = [], []
        for i in range(len(self.model.layers)):
            for name in _LORA_PROJECTIONS:
                w = weights.get((i, name))
                code = None if w is None else cpu.weight_code(w)
                if code is None:
                    return None
                tensors += [w.a_ptrs, w.b_ptrs, w.ranks_t, w.rank_offsets_t, w.out_meta]
                dims += [w.in_features, w.out_features, code]
        address = lora_cpu.lora_groups_address()
        return None if address is None else (tensors, dims, address)

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        ctx = fctx._current
        if ctx is None or x.dim() != 2 or x.shape[0] == 0 or x.shape[0] >= BLAS_MIN_ROWS:
            return None
        meta = ctx.attn
        if meta.prefills:
            if max(seg.context_len for seg in meta.prefills) > SHORT_PREFILL_CONTEXT:
                return None
            tables, lens = token_tables(meta)
        else:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None or tables.dtype != torch.int64 or lens.dtype != torch.int64 or tables.stride(-1) != 1:
            return None
        lora_tensors, lora_dims, lora_shared, lora_fn = [], [], [], 0
        if ctx.lora is not None:
            lora = self._lora_args(ctx.lora)
            if lora is None:
                return None
            lora_tensors, lora_dims, lora_shared, lora_fn = lora
        _, flat, biases, qk_norms, caches, sizes, scale, windows = self._static_args()
        cos, sin = rope
        return ops_cpu.decoder_stack(
            x.contiguous(), cos, sin, flat, biases, caches, self.model.norm.weight, sizes,
            self.model.norm.eps, scale, meta.slot_mapping, tables, lens, lora_tensors, lora_dims, lora_shared,
            self.linear_fn, lora_fn, [GEMM_COST, ops_cpu.MIN_PARALLEL_COST, LORA_COST, ops_cpu.MIN_PARALLEL_ELEMENTS],
            windows, qk_norms,
        )


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(
            arch.rotary_dim or arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, dtype) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self._stack: DecoderStack | None = None  # set by LlamaForCausalLM.pack_for_cpu where it applies

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        ctx = fctx._current
        if ctx is not None and ctx.lora is not None:
            x = ctx.lora.apply_embedding(input_ids, x)  # LoRA on embed_tokens, before either path below
        rope = self.rotary.lookup(positions)  # once per step, shared by every layer
        out = self._stack.run(x, rope) if self._stack is not None else None
        if out is not None:
            return out
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, dtype)
        self._packed_head: PackedWeight | None = None
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
            self.lm_head.weight.requires_grad_(False)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_for_cpu(self) -> bool:
        """On CPU in fp32, pre-pack every projection and the LM head for the CPU GEMM (loraplex's AVX-512
        kernel, or oneDNN's inner product; `loraplex.kernels.linear_cpu`). A decode step streams all these
        weights once for a few dozen rows, and a packed layout streams them faster than `F.linear` on
        row-major weights (on a 2-core EPYC, 32 rows: the 120 projections 154 -> 88 ms with oneDNN, the
        49152-row head 49 -> 20 ms). The projections' plain copies are released; the head keeps its plain
        weight, which is also the embedding table when tied."""
        from loraplex.kernels.linear_cpu import pack_weight

        packed_any = False
        for module in self.modules():
            if isinstance(module, LoraLinear):
                packed_any |= module.pack_for_cpu()
        self._packed_head = pack_weight(self.lm_head_weight)
        self.model._stack = DecoderStack.for_model(self.model)
        return packed_any or self._packed_head is not None

    def lora_top_projections(self) -> list:
        """LoRA on the LM head and the input embedding (tied or not: LoRA on lm_head changes the logits only)."""
        return top_projections(self.arch.vocab_size, self.arch.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of `hidden`, the final hidden states of the forward context's `sample_rows` (the LM head's
        LoRA, if the step has adapters, needs to know whose rows they are)."""
        if self._packed_head is not None:
            logits = packed_linear(hidden, self._packed_head, None)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        ctx = fctx._current
        if ctx is not None and ctx.lora is not None and ctx.sample_rows is not None:
            logits = ctx.lora.apply_logits(ctx.sample_rows, hidden, logits)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face tensors by name; fused projections take their shards. Every parameter must
        be covered exactly, or a ValueError names what is missing or unexpected."""
        if any(isinstance(m, LoraLinear) and m._packed is not None for m in self.modules()):
            raise ValueError("this model's weights are packed for inference; load the checkpoint into a new model")
        params = dict(self.named_parameters())
        expected = {name for name in params}
        loaded: set[str] = set()
        shards_seen: dict[str, set[int]] = {}
        for hf_name, tensor in weights:
            name = hf_name
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy of the embedding
            m = re.match(r"^(model\.layers\.\d+\.(?:self_attn|mlp))\.(\w+)\.(weight|bias)$", name)
            if m and m.group(2) in _FUSED:
                fused, shard = _FUSED[m.group(2)]
                module_name = f"{m.group(1)}.{fused}"
                module = self.get_submodule(module_name)
                module.load_shard(shard, m.group(3), tensor)
                key = f"{module_name}.{m.group(3)}"
                shards_seen.setdefault(key, set()).add(shard)
                if len(shards_seen[key]) == len(module.output_sizes):
                    loaded.add(key)
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.model_type}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{hf_name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        missing = expected - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")
