"""The playground: an operator chats with a tenant's adapter (or the base model) from the console.

The request runs through the same inference path as /v1/chat/completions, on behalf of the chosen tenant:
its quotas apply and its usage record is written (with no API key and end user "console"), so it shows up
in usage and on the statement like any other request. No key is minted and none leaves the server.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import select

from loraplex.platform import strict_json
from loraplex.platform.auth import TenantContext
from loraplex.platform.billing.models import NO_KEY
from loraplex.platform.console.deps import ConsoleDep, ConsolePostDep
from loraplex.platform.console.templating import render
from loraplex.platform.deps import RowId, ServicesDep
from loraplex.platform.ids import parse_row_id
from loraplex.platform.inference.service import chat_completion
from loraplex.platform.models import ALL_SCOPES, Tenant, TenantStatus
from loraplex.platform.registry import list_model_ids
from loraplex.platform.schemas.messages import plain_errors
from loraplex.platform.schemas.openai import ChatCompletionRequest
from loraplex.platform.schemas.text import DbText
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import TenantError, effective_limits, get_tenant

router = APIRouter(route_class=StrictJsonRoute)
CONSOLE_USER = "console"


class PlaygroundMessage(BaseModel):
    role: str = Field(pattern="^(system|user|assistant)$")
    content: str = Field(max_length=32_000)


class PlaygroundChat(BaseModel):
    tenant_id: RowId
    model: DbText = Field(min_length=1, max_length=200)
    messages: list[PlaygroundMessage] = Field(min_length=1, max_length=100)
    max_tokens: int = Field(default=64, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)


@router.get("/playground", response_class=HTMLResponse)
def playground_page(request: Request, context: ConsoleDep, services: ServicesDep) -> HTMLResponse:
    with services.sessions() as session:
        tenants = list(session.scalars(select(Tenant).where(Tenant.status == TenantStatus.active.value)
                                       .order_by(Tenant.name)))
    selected = request.query_params.get("tenant_id")
    return render(request, "playground.html", context, tenants=tenants,
                  selected=parse_row_id(selected),
                  engine_ready=services.engine is not None)


@router.get("/api/models")
def playground_models(_context: ConsoleDep, services: ServicesDep, tenant_id: RowId) -> JSONResponse:
    with services.sessions() as session:
        try:
            tenant = get_tenant(session, tenant_id)
        except TenantError as exc:
            raise HTTPException(404, str(exc)) from exc
        adapters = list_model_ids(session, tenant.id, services.base_model_name)
    base = services.base_model_name
    models = [{"id": base, "label": f"{base} (base model)"}]
    models += [{"id": model_id, "label": model_id} for model_id, _created, _name in adapters if "@" not in model_id]
    models += [{"id": model_id, "label": model_id} for model_id, _created, _name in adapters if "@" in model_id]
    return JSONResponse({"models": models})


@router.post("/api/playground/chat", response_model=None)
async def playground_chat(request: Request, _context: ConsolePostDep, services: ServicesDep) -> Response:
    raw = await request.body()
    try:
        strict_json.loads(raw)  # NaN and Infinity are not JSON; pydantic's parser would read them
        body = PlaygroundChat.model_validate_json(raw)
    except json.JSONDecodeError as exc:
        raise HTTPException(400, f"We could not parse the JSON body of your request: {exc.msg}") from exc
    except ValidationError as exc:
        raise HTTPException(400, plain_errors(exc)) from exc
    with services.sessions() as session:
        try:
            tenant = get_tenant(session, body.tenant_id)
        except TenantError as exc:
            raise HTTPException(404, str(exc)) from exc
        if tenant.status != TenantStatus.active.value:
            raise HTTPException(403, f"Tenant {tenant.name!r} is {tenant.status}.")
        caller = TenantContext(tenant_id=tenant.id, tenant_name=tenant.name, key_id=NO_KEY,
                               scopes=frozenset(ALL_SCOPES), limits=effective_limits(tenant, services.settings))
    chat = ChatCompletionRequest(
        model=body.model, messages=[m.model_dump() for m in body.messages], max_tokens=body.max_tokens,
        temperature=body.temperature, stream=True, stream_options={"include_usage": True}, user=CONSOLE_USER,
    )
    return await chat_completion(services, caller, request, chat)
