"""The architecture facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    # per layer: the sliding window it attends over (a token at position p sees keys at positions
    # p - window < k <= p, as transformers' masks), or None for whole-context attention
    layer_windows: tuple[int | None, ...]
    o_bias: bool = False  # Llama's attention_bias: o_proj has a bias too
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down projections have biases

    @property
    def sliding_window(self) -> int | None:
        """The widest window of the layers that slide; None when every layer attends over the whole context."""
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def flops_per_token(self, context_len: int = 0, with_lm_head: bool = True) -> int:
        """Matmul FLOPs (2 per multiply-add) for one token; attention adds 4 * context * q_size per layer, the
        context of a sliding-window layer being at most its window."""
        proj = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = 2 * (proj + mlp)
        attended = sum(context_len if w is None else min(context_len, w) for w in self.layer_windows)
        head = 2 * self.hidden_size * self.vocab_size if with_lm_head else 0
        return self.num_layers * per_layer + 4 * attended * self.q_size + head

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        cfg = config if isinstance(config, dict) else config.to_dict()
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if not archs and model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unsupported model_type {model_type!r}")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        model_type = model_type or SUPPORTED_ARCHITECTURES[archs[0]]
        num_layers = cfg["num_hidden_layers"]
        # Llama's attention_bias puts a bias on q, k, v and o; Qwen2 has one on q, k and v always; Mistral none.
        attention_bias = model_type == "llama" and bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            layer_windows=_layer_windows(cfg, model_type, num_layers),
            o_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
        )


def _layer_windows(cfg: dict, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window where transformers applies one: Mistral's `sliding_window` in every layer;
    Qwen2's in the layers `layer_types` names (by default those from `max_window_layers` on, and only with
    `use_sliding_window`); Llama never."""
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"sliding_window must be a non-negative integer or null, got {window!r}")
    if not window or model_type == "llama":
        return (None,) * num_layers
    if model_type == "mistral":
        return (int(window),) * num_layers
    if not cfg.get("use_sliding_window", False):
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = cfg.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers; the model has {num_layers}")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
