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

    def __post_init__(self) -> None:
        """Wrong types and values are refused here, naming the argument, before anything is loaded."""
        from pathlib import Path

        from loraplex.engine.errors import InvalidRequestError

        def whole(name: str, least: int, *, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = "None or " if optional else ""
                raise InvalidRequestError(f"{name} must be {what}an integer of at least {least}, got {value!r}",
                                          param=name)

        if not isinstance(self.model, str) or not self.model.strip():
            raise InvalidRequestError(f"model must be a non-empty string, got {self.model!r}", param="model")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", param="seed")
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "max_lora_rank",
                     "max_queue_len"):
            whole(name, 1)
        for name in ("num_kv_blocks", "max_model_len"):
            whole(name, 1, optional=True)
        for name in ("max_loras", "max_cpu_loras"):
            whole(name, 0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidRequestError(f"enable_prefix_caching must be True or False, got "
                                      f"{self.enable_prefix_caching!r}", param="enable_prefix_caching")
        if self.adapter_store is not None:
            if not isinstance(self.adapter_store, (str, Path)) or not str(self.adapter_store).strip():
                raise InvalidRequestError(f"adapter_store must be a directory path, got {self.adapter_store!r}",
                                          param="adapter_store")
            if Path(self.adapter_store).exists() and not Path(self.adapter_store).is_dir():
                raise InvalidRequestError(f"adapter_store {str(self.adapter_store)!r} is a file, not a directory",
                                          param="adapter_store")


@dataclass(frozen=True)
class EngineLimits:
    """Values derived from the config and the loaded model, computed once."""

    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
