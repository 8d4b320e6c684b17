from __future__ import annotations

from fastapi import APIRouter

from loraplex.platform.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(*, services: ServicesDep) -> dict:
    return {"status": "ok", "model": services.base_model_name, "engine": services.engine is not None}
