"""Chat and text completions: resolve the model, admit under quota, run, and shape the answer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraplex.engine.client import EngineClient
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.platform.auth import TenantContext
from loraplex.platform.errors import APIError, not_found
from loraplex.platform.inference import format as fmt
from loraplex.platform.inference.job import InferenceJob
from loraplex.platform.inference.params import (
    chat_sampling,
    check_context,
    completion_prompts,
    completion_sampling,
    encode_chat,
    fit_unset_max_tokens,
)
from loraplex.platform.inference.streaming import ClientDisconnected, EventStreamResponse, unless_disconnected
from loraplex.platform.registry import ModelNotFound, ModelTarget, resolve_latest_fast
from loraplex.platform.schemas.openai import ChatCompletionRequest, CompletionRequest
from loraplex.platform.services import Services
from loraplex.platform.usage import UsageEvent

log = logging.getLogger(__name__)


async def resolve_target(services: Services, tenant: TenantContext, model: str) -> ModelTarget:
    """`model` comes from a body whose schema already refused text no database can store (DbText)."""
    base = services.base_model_name
    if model == base:  # the common case needs no database round trip
        return ModelTarget(model=model)

    def lookup() -> ModelTarget:
        return resolve_latest_fast(services.db, tenant.tenant_id, model, base, services.store_dir)

    try:
        if services.db.dialect.name == "sqlite":  # local and indexed: cheaper than a threadpool hop
            return lookup()
        return await asyncio.to_thread(lookup)
    except ModelNotFound as exc:
        raise not_found(str(exc), param="model", code="model_not_found") from exc


# Tokenizing a prompt of megabytes takes seconds and would stall every other request on the event loop;
# a short one is cheaper inline than a thread hop, which the gateway's latency budget cares about.
INLINE_TOKENIZE_BYTES = 16 * 1024


async def _tokenize(request: Request, fn, *args):
    if len(await request.body()) <= INLINE_TOKENIZE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _used_now(services: Services, tenant: TenantContext, params) -> tuple[int, int]:
    """What the tenant's current minute and month have used, for a request that leaves max_tokens to the
    limits (others: nothing to look up)."""
    if params.max_tokens is not None:
        return 0, 0
    used_now = getattr(services.limiter, "used_now", None)
    return await used_now(tenant.tenant_id) if used_now is not None else (0, 0)


async def _require_engine(services: Services, tenant: TenantContext, request: Request, endpoint: str,
                          body, target: ModelTarget) -> EngineClient:
    """The engine, or the 503 that says none serves; such a refusal is the server's failure, counted in the
    metrics (status "unavailable") and as a failed request of the tenant's usage, with no tokens and nothing
    taken from its quotas (it is refused before them)."""
    try:
        return services.require_engine()
    except APIError:
        hook = services.on_request_finished
        if hook is not None:
            try:
                hook(endpoint=endpoint, status="unavailable", tenant=tenant.tenant_name, adapter=target.adapter_name,
                     prompt_tokens=0, completion_tokens=0, ttft_s=None, e2e_s=0.0)
            except Exception:
                log.exception("metrics hook failed")
        if services.usage is not None:
            await services.usage.record(UsageEvent(
                request_id=request.state.request_id, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id,
                model=target.model, adapter_name=target.adapter_name,
                adapter_version=target.adapter.content_hash if target.adapter else None, endpoint=endpoint,
                prompt_tokens=0, completion_tokens=0, ttft_ms=None, latency_ms=0, status="error",
                end_user=body.user, created_at=UsageEvent.now_iso()))
        raise


async def chat_completion(services: Services, tenant: TenantContext, request: Request,
                          body: ChatCompletionRequest) -> Response:
    # the client's errors first (a field refused: 400; a model it has not: 404), whether an engine serves or not:
    # they are neither the server's failure nor usage
    params = chat_sampling(body)
    target = await resolve_target(services, tenant, body.model)
    engine = await _require_engine(services, tenant, request, "chat.completions", body, target)
    prompt = await _tokenize(request, encode_chat, engine, body)
    max_new = check_context(engine, len(prompt), params, "messages",
                            "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    max_new, params = fit_unset_max_tokens(tenant.limits, len(prompt), params.n, params, max_new,
                                           *await _used_now(services, tenant, params))
    job = InferenceJob(services, tenant, request.state.request_id, "chat.completions", target, [prompt], params,
                       max_new, user=body.user)
    await job.admit()
    response_id = "chatcmpl-" + job.request_id.removeprefix("req_")
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        outputs = job.run()
        try:
            first = await _prime_unless_disconnected(job, outputs, request)
        except ClientDisconnected:
            return Response(status_code=499)
        return EventStreamResponse(_chat_events(job, outputs, first, response_id, created, body.model,
                                                include_usage), headers=job.rate_headers, on_close=outputs.aclose)
    last = await _collect_unless_disconnected(job, request)
    if last is None:
        return Response(status_code=499)
    outs = last[0].outputs if 0 in last else []
    usage = fmt.usage_dict(job.prompt_tokens, job.completion_tokens)
    return JSONResponse(fmt.chat_response(response_id, created, body.model, outs, usage), headers=job.rate_headers)


async def text_completion(services: Services, tenant: TenantContext, request: Request,
                          body: CompletionRequest) -> Response:
    params = completion_sampling(body)  # the client's errors first, as for chat completions
    target = await resolve_target(services, tenant, body.model)
    engine = await _require_engine(services, tenant, request, "completions", body, target)
    prompts = await _tokenize(request, completion_prompts, engine, body)
    max_new = min(check_context(engine, len(p), params, "prompt") for p in prompts)
    max_new, params = fit_unset_max_tokens(
        tenant.limits, sum(len(p) for p in prompts), len(prompts) * params.n, params, max_new,
        *await _used_now(services, tenant, params))
    job = InferenceJob(services, tenant, request.state.request_id, "completions", target, prompts, params,
                       max_new, user=body.user)
    await job.admit()
    response_id = "cmpl-" + job.request_id.removeprefix("req_")
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        outputs = job.run()
        try:
            first = await _prime_unless_disconnected(job, outputs, request)
        except ClientDisconnected:
            return Response(status_code=499)
        return EventStreamResponse(_completion_events(job, outputs, first, response_id, created, body.model,
                                                      include_usage), headers=job.rate_headers,
                                   on_close=outputs.aclose)
    last = await _collect_unless_disconnected(job, request)
    if last is None:
        return Response(status_code=499)
    n = params.n
    choices: list[tuple[int, CompletionOutput]] = []
    for index in sorted(last):
        choices.extend((index * n + o.index, o) for o in last[index].outputs)
    usage = fmt.usage_dict(job.prompt_tokens, job.completion_tokens)
    return JSONResponse(fmt.completion_response(response_id, created, body.model, choices, usage),
                        headers=job.rate_headers)


async def _collect_unless_disconnected(job: InferenceJob, request: Request) -> dict[int, RequestOutput] | None:
    """The outputs, or None when the client left first. The reservation is settled on every path, even
    when the work was cancelled before it could start."""
    try:
        return await unless_disconnected(request, _collect(job))
    except ClientDisconnected:
        return None
    finally:
        with anyio.CancelScope(shield=True):
            await job.finish("cancelled")  # a no-op when the run settled it already


async def _collect(job: InferenceJob) -> dict[int, RequestOutput]:
    last: dict[int, RequestOutput] = {}
    async for index, out in job.run():
        last[index] = out
    return last


async def _prime_unless_disconnected(job: InferenceJob, outputs: AsyncIterator,
                                     request: Request) -> tuple[int, RequestOutput] | None:
    """The stream's first output, awaited while watching the client: one that leaves while its request
    waits in the queue or in its prefill aborts it there (ClientDisconnected), as a request that is not
    streamed does, instead of leaving the engine to run it for nobody."""
    try:
        return await unless_disconnected(request, _prime(outputs))
    except ClientDisconnected:
        with anyio.CancelScope(shield=True):
            await outputs.aclose()
            await job.finish("cancelled")  # a no-op when the run settled it already
        raise


async def _prime(outputs: AsyncIterator) -> tuple[int, RequestOutput] | None:
    """Wait for the first output before answering, so a request the engine refuses gets a proper status."""
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None
    except BaseException:
        await outputs.aclose()
        raise


async def _replay(first, outputs: AsyncIterator) -> AsyncIterator[tuple[int, RequestOutput]]:
    if first is not None:
        yield first
        async for item in outputs:
            yield item


async def _chat_events(job: InferenceJob, outputs, first, response_id: str, created: int, model: str,
                       include_usage: bool) -> AsyncIterator[bytes]:
    try:
        # one choice per chunk, each with its own index, as OpenAI and vLLM stream n > 1
        for i in range(job.params.n):
            role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield fmt.sse(fmt.chat_chunk(response_id, created, model, [role], include_usage))
        finished: set[int] = set()
        async for _index, out in _replay(first, outputs):
            for o in out.outputs:
                if o.index in finished:
                    continue
                reason = fmt.finish_reason(o)
                if not (o.delta_text or reason or o.delta_logprobs):
                    continue
                if reason:
                    finished.add(o.index)
                choice = {"index": o.index, "delta": {"content": o.delta_text} if o.delta_text else {},
                          "logprobs": fmt.chat_logprobs(o.delta_logprobs), "finish_reason": reason}
                yield fmt.sse(fmt.chat_chunk(response_id, created, model, [choice], include_usage))
        if include_usage:
            yield fmt.sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [],
                           "usage": fmt.usage_dict(job.prompt_tokens, job.completion_tokens)})
        yield fmt.SSE_DONE
    except Exception as exc:  # headers are sent: report the failure in the stream, as OpenAI does
        yield _stream_error(exc, job.request_id)
    finally:
        await outputs.aclose()


async def _completion_events(job: InferenceJob, outputs, first, response_id: str, created: int, model: str,
                             include_usage: bool) -> AsyncIterator[bytes]:
    try:
        n = job.params.n
        finished: set[int] = set()
        offsets: dict[int, int] = {}
        async for index, out in _replay(first, outputs):
            for o in out.outputs:  # one choice per chunk, as for chat
                choice_index = index * n + o.index
                if choice_index in finished:
                    continue
                reason = fmt.finish_reason(o)
                if not (o.delta_text or reason or o.delta_logprobs):
                    continue
                if reason:
                    finished.add(choice_index)
                # text_offset counts the tokens' own texts, as the whole response's does (the text itself
                # may lag behind them: a stop string held back, a character's UTF-8 pieces)
                offset = offsets.get(choice_index, 0)
                offsets[choice_index] = offset + sum(fmt.text_width(e.chosen) for e in o.delta_logprobs or ())
                choice = {"index": choice_index, "text": o.delta_text,
                          "logprobs": fmt.completion_logprobs(o.delta_logprobs, offset), "finish_reason": reason}
                yield fmt.sse(fmt.completion_chunk(response_id, created, model, [choice], include_usage))
        if include_usage:
            yield fmt.sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": fmt.usage_dict(job.prompt_tokens, job.completion_tokens)})
        yield fmt.SSE_DONE
    except Exception as exc:
        yield _stream_error(exc, job.request_id)
    finally:
        await outputs.aclose()


def _stream_error(exc: Exception, request_id: str) -> bytes:
    # the cause is for the server's log, not for the tenant (it may name internals)
    log.error("stream of request %s failed after it started: %r", request_id, exc)
    error = exc if isinstance(exc, APIError) else APIError(
        500, f"The server had an error processing request {request_id}; the stream ended early.",
        type="server_error")
    body = error.body()
    if error.status >= 500 and request_id not in body["error"]["message"]:
        # a stream has no x-request-id to read once it has begun: its error event names the request
        body["error"]["message"] = f"{body['error']['message'].rstrip()} (request {request_id}; the stream ended early)"
    return fmt.sse(body) + fmt.SSE_DONE
