"""JSON bodies as the JSON standard has them: Python's json.loads (which Starlette and FastAPI use) also reads
the tokens NaN, Infinity and -Infinity, so `"temperature": NaN` would reach validation and be refused as "out of
range", or pass where a field has no bounds. Every router of the service uses StrictJsonRoute, whose requests
refuse those tokens as an unparsable body: the API's usual invalid-JSON error, naming the token."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


def _refuse_constant(token: str) -> Any:
    raise ValueError(token)


def loads(text: str | bytes) -> Any:
    """json.loads without NaN and the infinities; a JSONDecodeError names the token and where it is."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        token = str(exc)
        doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        raise json.JSONDecodeError(f"{token} is not valid JSON (JSON has no NaN or Infinity; send a number)",
                                   doc, max(doc.find(token), 0)) from None


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJsonRoute(APIRoute):
    """A route whose endpoint, and FastAPI's body parsing for it, see a StrictJsonRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler
