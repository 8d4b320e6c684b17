"""/v1/chat/completions and /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loraplex.platform.deps import InferenceKeyDep, ServicesDep
from loraplex.platform.inference.service import chat_completion, text_completion
from loraplex.platform.schemas.openai import ChatCompletionRequest, CompletionRequest
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute, prefix="/v1", tags=["openai"])

# with "stream": true the answer is server-sent events, ending in `data: [DONE]`
JSON_OR_EVENTS = {200: {"content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}}}}


@router.post("/chat/completions", response_model=None, responses=JSON_OR_EVENTS)
async def create_chat_completion(*, tenant: InferenceKeyDep, services: ServicesDep, request: Request,
                                 body: ChatCompletionRequest) -> Response:
    return await chat_completion(services, tenant, request, body)


@router.post("/completions", response_model=None, responses=JSON_OR_EVENTS)
async def create_completion(*, tenant: InferenceKeyDep, services: ServicesDep, request: Request,
                            body: CompletionRequest) -> Response:
    return await text_completion(services, tenant, request, body)
