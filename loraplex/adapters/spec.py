"""What an adapter must fit: the base model's layers, projection shapes and PEFT module names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from .errors import AdapterValidationError, ErrorCode

# The seven projections LoRA may target, in the order canonical weights are serialized.
MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# LoRA on the model's input embedding and on its LM head (PEFT's Embedding and Linear LoRA). They sit outside
# the decoder layers: canonical weights key them by layer TOP_LEVEL. The embedding's A is [r, vocab] (PEFT's
# lora_embedding_A) and B [hidden, r], so a token's delta is column `token` of A times B^T; the head's A is
# [r, hidden] and B [vocab, r], as any projection.
TOP_LEVEL = -1
TOP_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
_TOP_PATHS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
           "gate_up_proj": "mlp"}

_SEPARATE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# architecture -> the PEFT module names its decoder layers expose
ARCHITECTURES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "LlamaForCausalLM": _SEPARATE,
    "MistralForCausalLM": _SEPARATE,
    "Qwen2ForCausalLM": _SEPARATE,
    "Qwen3ForCausalLM": _SEPARATE,
    "GemmaForCausalLM": _SEPARATE,
    "Gemma2ForCausalLM": _SEPARATE,
    "Phi3ForCausalLM": _FUSED,
})
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "phi3": "Phi3ForCausalLM"}


@dataclass(frozen=True)
class ModuleShape:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModuleSlice:
    """Rows [start, stop) of a (possibly fused) PEFT module's output that belong to `module`."""

    module: str
    start: int
    stop: int


@dataclass(frozen=True)
class BaseModelSpec:
    """The shape of a base model as far as LoRA is concerned.

    modules: logical projection name (q_proj ... down_proj) -> in/out features (GQA included).
    peft_modules: PEFT module name used by this architecture -> the logical projections it feeds, as
    slices of its output (one slice for a plain projection; q/k/v or gate/up for fused ones).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    modules: Mapping[str, ModuleShape]
    peft_modules: Mapping[str, tuple[ModuleSlice, ...]]
    layer_prefix: str = "model.layers"
    vocab_size: int = 0
    # lm_head shares the embedding's weight (SmolLM2); LoRA on lm_head is still a delta on the logits only
    tie_word_embeddings: bool = False

    def parent(self, peft_module: str) -> str:
        return _PARENT[peft_module]

    def module_path(self, layer: int, peft_module: str) -> str:
        """The module's name inside the HF model, as PEFT sees it: model.layers.3.self_attn.q_proj (and
        model.embed_tokens, lm_head for layer TOP_LEVEL)."""
        if layer == TOP_LEVEL:
            return _TOP_PATHS[peft_module]
        return f"{self.layer_prefix}.{layer}.{_PARENT[peft_module]}.{peft_module}"

    def top_shape(self, module: str) -> ModuleShape:
        """in/out features of embed_tokens (in: the vocabulary, as its one-hot input) or lm_head."""
        if module == "embed_tokens":
            return ModuleShape(self.vocab_size, self.hidden_size)
        return ModuleShape(self.hidden_size, self.vocab_size)

    def shape(self, layer: int, module: str) -> ModuleShape | None:
        """in/out features of a canonical (layer, module) entry; None where the model has no such module."""
        if layer == TOP_LEVEL:
            return self.top_shape(module) if module in TOP_MODULES and self.vocab_size > 0 else None
        if not 0 <= layer < self.num_layers:
            return None
        return self.modules.get(module)

    def peft_shape(self, peft_module: str) -> ModuleShape:
        if peft_module in TOP_MODULES:
            return self.top_shape(peft_module)
        slices = self.peft_modules[peft_module]
        return ModuleShape(self.modules[slices[0].module].in_features, slices[-1].stop)

    def max_adapter_bytes(self, max_rank: int) -> int:
        """The most the weights of a LoRA adapter of rank <= max_rank can take for this model: A and B of all
        seven projections in every layer, of embed_tokens and lm_head, in fp32 (the widest dtype accepted);
        fused names cover no more. PEFT also saves copies of the embedding and head weights beside LoRA on
        them (save_embedding_layers): two [vocab, hidden] matrices more."""
        per_layer = sum(shape.in_features + shape.out_features for shape in self.modules.values())
        top = 2 * (self.vocab_size + self.hidden_size) * max_rank + 2 * self.vocab_size * self.hidden_size
        return (self.num_layers * per_layer * max_rank + top) * 4

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> BaseModelSpec:
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise AdapterValidationError(f"cannot read base model config {path}: {exc}",
                                         ErrorCode.BASE_MODEL_MISMATCH) from exc
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config) -> BaseModelSpec:
        """From a HF config: a dict (config.json) or a transformers `PretrainedConfig`."""
        cfg = config if isinstance(config, Mapping) else config.to_dict()
        architecture = _architecture(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads
            head_dim = int(cfg.get("head_dim") or (128 if architecture == "Qwen3ForCausalLM" else hidden // heads))
            intermediate = int(cfg["intermediate_size"])
            num_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg.get("vocab_size") or 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterValidationError(f"base model config lacks a usable {exc}",
                                         ErrorCode.BASE_MODEL_MISMATCH) from exc
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        modules = {
            "q_proj": ModuleShape(hidden, q_out),
            "k_proj": ModuleShape(hidden, kv_out),
            "v_proj": ModuleShape(hidden, kv_out),
            "o_proj": ModuleShape(q_out, hidden),
            "gate_proj": ModuleShape(hidden, intermediate),
            "up_proj": ModuleShape(hidden, intermediate),
            "down_proj": ModuleShape(intermediate, hidden),
        }
        peft_modules: dict[str, tuple[ModuleSlice, ...]] = {}
        for name in ARCHITECTURES[architecture]:
            if name == "qkv_proj":
                peft_modules[name] = (ModuleSlice("q_proj", 0, q_out), ModuleSlice("k_proj", q_out, q_out + kv_out),
                                      ModuleSlice("v_proj", q_out + kv_out, q_out + 2 * kv_out))
            elif name == "gate_up_proj":
                # Phi-3 splits the fused output with chunk(2): gate first, then up.
                peft_modules[name] = (ModuleSlice("gate_proj", 0, intermediate),
                                      ModuleSlice("up_proj", intermediate, 2 * intermediate))
            else:
                peft_modules[name] = (ModuleSlice(name, 0, modules[name].out_features),)
        return cls(architecture=architecture, num_layers=num_layers, hidden_size=hidden,
                   modules=MappingProxyType(modules), peft_modules=MappingProxyType(peft_modules),
                   vocab_size=vocab, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def _architecture(cfg: Mapping) -> str:
    for arch in cfg.get("architectures") or ():
        if arch in ARCHITECTURES:
            return arch
    by_type = _MODEL_TYPES.get(cfg.get("model_type", ""))
    if by_type:
        return by_type
    named = cfg.get("architectures") or cfg.get("model_type")
    raise AdapterValidationError(
        f"base model architecture {named!r} is not supported for LoRA; supported: {', '.join(ARCHITECTURES)}",
        ErrorCode.ARCHITECTURE_UNSUPPORTED,
    )
