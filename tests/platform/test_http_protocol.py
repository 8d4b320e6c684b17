"""Requests the HTTP parser refuses get the API's JSON error object, from either parser uvicorn may use."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from live_server import live_server, send_raw

from loraplex.platform.http_protocol import PARSE_ERROR_CODE, http_protocol_class, parse_error_body

MALFORMED = [
    pytest.param(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", id="header-without-colon"),
    pytest.param(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n", id="bad-length"),
    pytest.param(b"GET /v1/models HTTP/1.1 extra\r\nHost: x\r\n\r\n", id="bad-request-line"),
    pytest.param(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40, id="tls-to-plain-port"),
]


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": []}

    return app


@pytest.fixture(params=["httptools", "h11"])
def server(request):
    if request.param == "httptools":
        pytest.importorskip("httptools")
    with live_server(_app(), kind=request.param) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize("data", MALFORMED)
def test_unparseable_request_gets_a_json_error(server, data):
    status, headers, body = send_raw(server, data)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == PARSE_ERROR_CODE
    assert "not valid HTTP/1.1" in error["message"] and error["param"] is None


def test_valid_requests_are_unaffected(server):
    response = httpx.get(f"http://127.0.0.1:{server}/v1/models")
    assert response.status_code == 200 and response.json() == {"object": "list", "data": []}


def test_parse_error_body_keeps_uvicorn_sentence():
    error = json.loads(parse_error_body("Invalid HTTP request received."))["error"]
    assert error["message"].startswith("Invalid HTTP request received: ")


def test_unknown_protocol_kind_is_refused():
    with pytest.raises(ValueError, match="auto, httptools or h11"):
        http_protocol_class("h3")
