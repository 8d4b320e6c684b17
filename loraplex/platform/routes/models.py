"""/v1/models: the base model plus the caller's ready adapters (each as `name` and `name@version`)."""

from __future__ import annotations

from fastapi import APIRouter

from loraplex.platform.deps import InferenceKeyDep, ServicesDep, SessionDep
from loraplex.platform.errors import not_found
from loraplex.platform.inference.params import check_text
from loraplex.platform.registry import ModelNotFound, list_model_ids, resolve_model
from loraplex.platform.schemas.openai import ModelCard, ModelList
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute, prefix="/v1", tags=["openai"])


@router.get("/models", response_model=ModelList)
def list_models(*, tenant: InferenceKeyDep, services: ServicesDep, session: SessionDep) -> ModelList:
    cards = [ModelCard(id=services.base_model_name, created=services.started_at, owned_by="loraplex")]
    for model_id, created, _parent in list_model_ids(session, tenant.tenant_id, services.base_model_name):
        cards.append(ModelCard(id=model_id, created=created, owned_by=tenant.tenant_name,
                               parent=services.base_model_name))
    return ModelList(data=cards)


@router.get("/models/{model_id:path}", response_model=ModelCard)
def read_model(*, tenant: InferenceKeyDep, services: ServicesDep, session: SessionDep, model_id: str) -> ModelCard:
    check_text(model_id, "model")
    if model_id == services.base_model_name:
        return ModelCard(id=model_id, created=services.started_at, owned_by="loraplex")
    try:
        target = resolve_model(session, tenant.tenant_id, model_id, services.base_model_name)
    except ModelNotFound as exc:
        raise not_found(str(exc), param="model", code="model_not_found") from exc
    return ModelCard(id=model_id, created=target.created, owned_by=tenant.tenant_name,
                     parent=services.base_model_name)
