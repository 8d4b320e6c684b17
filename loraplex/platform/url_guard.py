"""URLs carrying NUL (%00) are refused before routing: no id, name or filter holds one, and PostgreSQL
cannot compare text with one (the lookup would fail as a 500 there while SQLite answered 404)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.platform.errors import APIError, error_page


class NulInUrlMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ("\x00" in scope.get("path", "") or b"%00" in scope.get("query_string", b"")):
            message = "The URL contains a NUL (%00) character, which no path or query parameter may hold."
            page = error_page(scope, 400, message)  # a console page is answered with a console page
            if page is not None:
                await page(scope, receive, send)
                return
            body = json.dumps(APIError(400, message).body()).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
