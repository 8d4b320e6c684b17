"""A client that leaves while its body is read (a cut upload) is no server error: nothing is sent, no
traceback is logged as one."""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect

from loraplex.platform.request_id import RequestIdMiddleware


async def test_a_client_that_leaves_mid_body_is_not_logged_as_a_server_error(caplog):
    async def app(scope, receive, send):
        raise ClientDisconnect()

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    with caplog.at_level(logging.INFO, logger="loraplex.platform.request_id"):
        await RequestIdMiddleware(app)({"type": "http", "method": "POST", "path": "/v1/adapters", "headers": []},
                                       receive, send)
    assert sent == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("disconnected before its body was read" in r.getMessage() for r in caplog.records)
