"""The architecture facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
# rope scaling types the engine computes as transformers does (Phi-3's older names "su" and "yarn" are LongRoPE)
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


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
    qk_norm: bool = False  # Qwen3: a per-head RMSNorm on q and on k before the rotary embedding
    rotary_dim: int | None = None  # the leading dims of each head that rotate (partial_rotary_factor); None: all
    # LongRoPE (Phi-3): transformers rotates with the short factors up to this many positions and with the long
    # ones in forward passes that go past them; the engine serves the short regime
    rope_short_positions: int | None = None

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
        # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads
        head_dim = cfg.get("head_dim") or (128 if model_type == "qwen3" else hidden // num_heads)
        max_positions = cfg.get("max_position_embeddings", 2048)
        # Llama's and Qwen3's attention_bias put a bias on q, k, v and o; Qwen2 has one on q, k and v always;
        # Mistral and Phi-3 none.
        attention_bias = model_type in ("llama", "qwen3") and bool(cfg.get("attention_bias", False))
        rotary_dim = _rotary_dim(cfg, rope, head_dim)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_checked_scaling(scaling, cfg, rotary_dim or head_dim),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            layer_windows=_layer_windows(cfg, model_type, num_layers),
            o_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rotary_dim=rotary_dim,
            rope_short_positions=_short_positions(scaling, cfg),
        )


def _rope_kind(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    return "longrope" if kind in ("su", "yarn") and "short_factor" in (scaling or {}) else kind


def _rotary_dim(cfg: dict, rope: dict, head_dim: int) -> int | None:
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor is None or factor == 1.0:
        return None
    if not (isinstance(factor, int | float) and 0 < factor < 1):
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} rotates {dim} of {head_dim} dims per head; "
                         f"an even number of at least 2 is needed")
    return dim


def _checked_scaling(scaling: dict | None, cfg: dict, rotary_dim: int) -> dict | None:
    """The rope scaling, refused here (before any weight is read) where the engine does not compute it."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object, got {scaling!r}")
    kind = _rope_kind(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    scaling = dict(scaling, rope_type=kind)
    if kind in ("linear", "llama3") and not isinstance(scaling.get("factor"), int | float):
        raise ValueError(f"rope scaling {kind!r} needs a numeric factor, got {scaling.get('factor')!r}")
    if kind == "llama3" and not isinstance(scaling.get("original_max_position_embeddings"), int):
        raise ValueError("rope scaling 'llama3' needs original_max_position_embeddings")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not (isinstance(factors, list) and len(factors) == rotary_dim // 2
                    and all(isinstance(f, int | float) for f in factors)):
                raise ValueError(f"LongRoPE's {key} must be a list of {rotary_dim // 2} numbers (one per rotated "
                                 f"pair), got {factors!r:.80}")
        original = _short_positions(scaling, cfg)
        if not isinstance(original, int) or original < 1:
            raise ValueError("LongRoPE needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original
        scaling["max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    return scaling


def _short_positions(scaling: dict | None, cfg: dict) -> int | None:
    if _rope_kind(scaling) != "longrope":
        return None
    return scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")


def _layer_windows(cfg: dict, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window where transformers applies one: Mistral's and Phi-3's `sliding_window` in
    every layer; Qwen2's and Qwen3's in the layers `layer_types` names (by default those from `max_window_layers`
    on, and only with `use_sliding_window`); Llama never."""
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"sliding_window must be a non-negative integer or null, got {window!r}")
    if not window or model_type == "llama":
        return (None,) * num_layers
    if model_type in ("mistral", "phi3"):
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
