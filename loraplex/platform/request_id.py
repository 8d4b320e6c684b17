"""Every response carries x-request-id, errors included; the id also keys the request's usage record."""

from __future__ import annotations

import json
import logging
import uuid

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import error_body, server_error_page

log = logging.getLogger(__name__)
HEADER = b"x-request-id"


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


class RequestIdMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            # the client left while its body was being read (a cut upload): nobody to answer, nothing failed
            log.info("request %s: the client disconnected before its body was read", request_id)
        except Exception:
            log.exception("unhandled error in request %s", request_id)
            if started:
                raise
            message = f"The server had an error processing request {request_id}."
            page = server_error_page(scope, message)  # a console page asked for by a browser gets a page
            if page is not None:
                await page(scope, receive, send_with_id)
                return
            body = json.dumps(error_body(message, "server_error")).encode()
            await send_with_id({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
