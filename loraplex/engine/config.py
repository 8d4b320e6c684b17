"""Engine configuration: frozen as the user gave it; derived values live in `EngineLimits`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str  # local HF directory, GGUF file, Hub id, or a known demo name such as "smollm2-135m"
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit number of KV blocks; otherwise from kv_cache_memory
    kv_cache_memory: int = 512 * 1024 * 1024  # bytes for the KV cache when num_kv_blocks is None
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # LoRA
    max_loras: int = 8  # device slots
    max_cpu_loras: int = 64  # host LRU
    max_lora_rank: int = 64
    # how adapter weights are held in slots: auto (the model's dtype) | float32 | float16 | bfloat16. On the
    # CPU, half precision halves the bytes a step streams per adapter and the memory each adapter takes
    # (activations and sums stay fp32); the delta then carries the weights' rounding (fp16: about 5e-4 of each
    # weight, bf16: about 4e-3).
    lora_dtype: str = "auto"
    adapter_store: str | None = None  # directory of canonical adapter weights
    max_queue_len: int = 10_000


@dataclass(frozen=True)
class EngineLimits:
    """Values derived from the config and the loaded model, computed once."""

    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
