"""RemoteEngine: an EngineClient for one `loraplex engine` process; tokenizes locally (same model files)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from loraplex.engine.client import EngineStats
from loraplex.engine.errors import (
    AdapterLoadError,
    EngineOverloadedError,
    EngineUnreachableError,
    InvalidRequestError,
)
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.remote.protocol import (
    SECRET_HEADER,
    adapter_to_json,
    engine_token,
    output_from_json,
    params_to_json,
)
from loraplex.platform.remote.server import ABORT_REQUEST_SECONDS, STREAM_READ_TIMEOUT

log = logging.getLogger(__name__)
HTTP_TIMEOUT = 10.0  # seconds to connect to an engine, send it a request, or wait for a pooled connection


class RemoteEngine:
    def __init__(self, url: str, secret_key: str, *, model_name: str, max_model_len: int, tokenizer,
                 http: httpx.AsyncClient | None = None):
        self.url = url.rstrip("/")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        # an engine stream sends a blank line at least every STREAM_HEARTBEAT_SECONDS while it works
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(HTTP_TIMEOUT, read=STREAM_READ_TIMEOUT))
        self._headers = {SECRET_HEADER: engine_token(secret_key)}
        self.inflight = 0  # requests this API process has on the engine now

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        await self._http.aclose()

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       adapter: LoRARequest | None = None, tenant: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        body = {"prompt": prompt, "params": params_to_json(params), "request_id": request_id,
                "adapter": adapter_to_json(adapter), "tenant": tenant}
        self.inflight += 1
        started = False
        try:
            try:
                async with self._http.stream("POST", f"{self.url}/engine/generate", json=body,
                                             headers=self._headers) as response:
                    if response.status_code == 400:
                        detail = json.loads(await response.aread())
                        raise InvalidRequestError(detail.get("message", "invalid request"), param=detail.get("param"))
                    if response.status_code in (502, 503, 504):  # shutting down, or a proxy without it
                        raise EngineUnreachableError(f"engine {self.url} answered {response.status_code}")
                    if response.status_code != 200:
                        raise EngineOverloadedError(f"engine {self.url} answered {response.status_code}")
                    async for line in response.aiter_lines():
                        if line:
                            data = json.loads(line)
                            if "invalid_request" in data:
                                raise InvalidRequestError(data["invalid_request"], param=data.get("param"))
                            output = output_from_json(data)
                            started = True
                            yield output
            except httpx.TransportError as exc:
                if not started:  # nothing was served: another engine may take the request
                    raise EngineUnreachableError(f"engine {self.url} is unreachable: {_why(exc)}") from exc
                raise EngineOverloadedError(f"engine {self.url} went away mid-request: {exc}") from exc
        finally:
            self.inflight -= 1

    async def abort(self, request_id: str) -> int | None:
        """Abort it on the engine; the prompt tokens the engine processed for it, or None where that is not
        known: an engine process of an older version (its answer has no count), or one that did not answer."""
        try:
            r = await self._http.post(f"{self.url}/engine/abort", json={"request_id": request_id},
                                      headers=self._headers, timeout=ABORT_REQUEST_SECONDS)
        except httpx.TimeoutException:
            log.warning("abort of request %s: engine %s did not answer within ABORT_REQUEST_SECONDS=%g s", request_id,
                        self.url, ABORT_REQUEST_SECONDS)
            return None
        except httpx.TransportError:
            return None  # a closed stream already aborted it, or the engine is gone with it
        return _prompt_tokens_processed(r)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, max_model_len=self.max_model_len)

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  max_model_len=self.max_model_len)

    async def prefetch_adapter(self, adapter: LoRARequest, *, pin: bool | None = None) -> None:
        try:
            r = await self._http.post(f"{self.url}/engine/prefetch", json={"adapter": adapter_to_json(adapter),
                                                                            "pin": pin}, headers=self._headers)
        except httpx.TransportError as exc:
            raise EngineUnreachableError(f"engine {self.url} is unreachable: {_why(exc)}") from exc
        if r.status_code >= 500:
            raise EngineUnreachableError(f"engine {self.url} answered {r.status_code}")
        if r.status_code == 400:  # the engine refused it (an adapter it cannot load): its error, by kind
            try:
                detail = r.json()
            except ValueError:
                detail = {}
            message = detail.get("message") or f"engine {self.url} refused the adapter"
            if detail.get("error") == "AdapterLoadError":
                raise AdapterLoadError(message)
            raise InvalidRequestError(message, param=detail.get("param"))
        r.raise_for_status()

    async def unpin_adapter(self, content_hash: str) -> None:
        try:
            r = await self._http.post(f"{self.url}/engine/unpin", json={"content_hash": content_hash},
                                      headers=self._headers)
        except httpx.TransportError as exc:
            raise EngineUnreachableError(f"engine {self.url} is unreachable: {_why(exc)}") from exc
        if r.status_code >= 500:
            raise EngineUnreachableError(f"engine {self.url} answered {r.status_code}")
        r.raise_for_status()

    async def remove_adapter(self, content_hash: str) -> None:
        r = await self._http.post(f"{self.url}/engine/remove", json={"content_hash": content_hash},
                                  headers=self._headers)
        r.raise_for_status()

    async def fetch_stats(self) -> EngineStats:
        r = await self._http.get(f"{self.url}/engine/stats", headers=self._headers)
        r.raise_for_status()
        return EngineStats(**r.json())


def _prompt_tokens_processed(response: httpx.Response) -> int | None:
    """The count in an engine's answer to an abort, or None for an error answer or one without it."""
    if response.status_code != 200:
        return None
    try:
        value = response.json().get("prompt_tokens_processed")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _why(exc: BaseException) -> str:
    """What went wrong, never empty: httpx's timeouts carry no message of their own; they are named by the
    timeout that ran out."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ReadTimeout):
        return f"{text} (nothing read within STREAM_READ_TIMEOUT={STREAM_READ_TIMEOUT:g} s)"
    if isinstance(exc, httpx.TimeoutException):  # connect, write, pool
        return f"{text} (its {_TIMEOUT_KIND.get(type(exc), 'HTTP')} timeout, HTTP_TIMEOUT={HTTP_TIMEOUT:g} s)"
    return text


_TIMEOUT_KIND = {httpx.ConnectTimeout: "connect", httpx.WriteTimeout: "write", httpx.PoolTimeout: "pool"}
