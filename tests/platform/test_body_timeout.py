"""A body that stops arriving gets 408 and its connection closed, over a real socket (the test client has no
way to stall a body); one that keeps arriving slowly is served."""

from __future__ import annotations

import json
import socket
import time

import pytest
from fake_engine import FakeEngine
from live_server import live_server
from platform_helpers import make_settings

BODY = json.dumps({"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture
def served(make_tenant_factory, data_dir, tiny_llama_dir):
    settings = make_settings(data_dir, model=str(tiny_llama_dir), request_body_timeout=1.0)
    app, make_tenant = make_tenant_factory(settings, FakeEngine())
    with live_server(app) as url:
        yield url, make_tenant()


def _send(url: str, key: str, path: str, parts: list[bytes], pause: float, declared: int,
          content_type: str = "application/json") -> tuple[int, dict, bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: {content_type}\r\nContent-Length: {declared}\r\n\r\n".encode())
        for part in parts:
            time.sleep(pause)
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed already
                break
        chunks = []
        while chunk := sock.recv(65536):  # the server closes the connection after a 408
            chunks.append(chunk)
            if b"connection: close" not in b"".join(chunks).lower() and _complete(b"".join(chunks)):
                break
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _complete(raw: bytes) -> bool:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.decode().split("\r\n")[1:]:
        name, _, value = line.partition(": ")
        if name.lower() == "content-length":
            return len(body) >= int(value)
    return False


def test_a_body_that_stops_short_of_its_length_gets_408_and_the_connection_closes(served):
    url, tenant = served
    status, headers, body = _send(url, tenant.key, "/v1/chat/completions", [BODY[:10]], 0,
                                  declared=len(BODY))
    assert status == 408, body
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "LORAPLEX_REQUEST_BODY_TIMEOUT" in error["message"]
    assert headers.get("connection") == "close" and "x-request-id" in headers


def test_a_stalled_upload_gets_408_and_leaves_nothing_staged(served, data_dir):
    url, tenant = served
    start = b"--b\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nbot\r\n"
    status, _, body = _send(url, tenant.key, "/v1/adapters", [start], 0, declared=len(start) + 1000,
                            content_type="multipart/form-data; boundary=b")
    assert status == 408, body
    assert json.loads(body)["error"]["code"] == "request_timeout"
    uploads = data_dir / "uploads"
    assert not uploads.exists() or list(uploads.glob("incoming-*")) == []


def test_a_body_that_keeps_arriving_slowly_is_served(served):
    url, tenant = served
    parts = [BODY[i:i + 8] for i in range(0, len(BODY), 8)]
    # each part within the limit, the whole body well past it
    status, _, body = _send(url, tenant.key, "/v1/chat/completions", parts, 0.1, declared=len(BODY))
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["role"] == "assistant"
