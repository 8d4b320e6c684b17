"""The in-process engine of `loraplex serve`, configured from Settings."""

from __future__ import annotations

from loraplex.config import Settings
from loraplex.engine.client import EngineClient


def engine_config(settings: Settings):
    from loraplex.engine.config import EngineConfig

    store = settings.resolved_adapter_store_dir
    store.mkdir(parents=True, exist_ok=True)
    return EngineConfig(
        model=settings.model, dtype=settings.dtype, kv_cache_memory=settings.kv_cache_memory,
        max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
        max_loras=settings.max_loras, max_cpu_loras=settings.max_cpu_loras,
        max_lora_rank=settings.max_lora_rank, lora_dtype=settings.lora_dtype, max_model_len=settings.max_model_len,
        adapter_store=str(store.resolve()),
    )


def build_engine(settings: Settings) -> EngineClient:
    from loraplex.engine.async_engine import AsyncEngine

    return AsyncEngine(engine_config(settings))
