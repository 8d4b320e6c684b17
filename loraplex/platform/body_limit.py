"""A size limit on request bodies other than uploads: a JSON body of gigabytes would otherwise be read into
memory and parsed before any check could refuse it. Multipart bodies sent to the upload routes stream to
disk under their own limit, `max_upload_bytes` (loraplex.platform.uploads); a multipart body sent anywhere
else is read whole like any other, so it gets this limit too."""

from __future__ import annotations

import asyncio
import json
import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import REQUEST_TOO_LARGE, APIError

# the routes that parse multipart uploads themselves: POST /v1/adapters, /admin/api/tenants/{id}/adapters and
# the console's /console/api/tenants/{id}/adapters
UPLOAD_PATHS = re.compile(r"^/(v1/adapters|admin/api/tenants/\d+/adapters|console/api/tenants/\d+/adapters)/?$")


def _message(limit: int) -> str:
    return f"The request body is larger than the limit of {limit} bytes (LORAPLEX_MAX_REQUEST_BYTES)."


def _too_large(limit: int) -> HTTPException:
    # raised from inside the body read, where FastAPI passes an HTTPException through (any other error
    # becomes "There was an error parsing the body"); the error handlers give 413 its code
    return HTTPException(413, _message(limit))


class BodyLimitMiddleware:
    """Plain ASGI, so streaming responses and disconnect detection pass through untouched. A declared
    Content-Length over the limit is refused before the body is read; a body without one (chunked) is
    counted as it arrives and refused once it passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self._is_multipart(scope) and UPLOAD_PATHS.match(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        declared = self._content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        received = 0
        limit = self.max_bytes

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit)
            return message

        await self.app(scope, counting_receive, send)

    @staticmethod
    def _is_multipart(scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"content-type":
                return value.lower().startswith(b"multipart/")
        return False

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(APIError(413, _message(self.max_bytes), code=REQUEST_TOO_LARGE).body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _timeout_message(seconds: float) -> str:
    return (f"The request body stopped arriving: nothing came for {seconds:g} s "
            "(LORAPLEX_REQUEST_BODY_TIMEOUT). Send the whole body without pausing.")


class BodyTimeoutMiddleware:
    """A client that sends its headers and then stalls, or stops before the Content-Length it declared, would
    hold its connection and its request's task for as long as it likes (the server has no other timeout on a
    body being read). Each part of a body must arrive within `seconds` of the one before (of the headers, for
    the first): a slow upload that keeps sending is never cut, a stalled one gets 408 and its connection
    closed. Plain ASGI: once the body is in, `receive` is passed through untouched (a streaming response waits
    on it for the client's hang-up)."""

    def __init__(self, app: ASGIApp, seconds: float):
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.seconds <= 0:
            await self.app(scope, receive, send)
            return
        body_done = False
        seconds = self.seconds

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), seconds)
            except TimeoutError:
                body_done = True  # what comes later is the hang-up, if anything
                raise HTTPException(408, _timeout_message(seconds), headers={"connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)
