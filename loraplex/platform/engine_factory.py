"""The in-process engine of `loraplex serve`, configured from Settings."""

from __future__ import annotations

from loraplex.config import Settings
from loraplex.engine.client import EngineClient


def engine_config(settings: Settings):
    from loraplex.engine.config import EngineConfig

    store = settings.resolved_adapter_store_dir
    store.mkdir(parents=True, exist_ok=True)
    return EngineConfig(model=settings.model, **settings.engine_options, adapter_store=str(store.resolve()))


def build_engine(settings: Settings) -> EngineClient:
    from loraplex.engine.async_engine import AsyncEngine

    return AsyncEngine(engine_config(settings))
