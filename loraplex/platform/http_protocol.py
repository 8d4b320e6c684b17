"""uvicorn's HTTP/1.1 protocol, answering a request it cannot parse with the API's JSON error shape.

A request line or header block that the HTTP parser refuses (a bare LF where CRLF belongs, a header without a
colon, a Content-Length that is no number...) never reaches the application: uvicorn answers it by itself, with
a plain-text 400. Clients of an OpenAI-compatible API read the `error` object of every non-2xx answer, so
these 400s carry it too.
"""

from __future__ import annotations

import json

from loraplex.platform.errors import error_body

PARSE_ERROR_CODE = "invalid_http_request"


def parse_error_body(msg: str) -> bytes:
    """The body of the 400 for a request uvicorn could not parse; `msg` is uvicorn's own sentence."""
    message = (f"{msg.rstrip('.')}: the request line, headers or framing are not valid HTTP/1.1. "
               "Check the client, or a proxy between it and this server.")
    return json.dumps(error_body(message, "invalid_request_error", code=PARSE_ERROR_CODE)).encode()


def _httptools_class():
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    class JSONErrorHttpToolsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            body = parse_error_body(msg)
            content = [STATUS_LINE[400]]
            for name, value in self.server_state.default_headers:
                content.extend([name, b": ", value, b"\r\n"])
            content.extend([b"content-type: application/json\r\n",
                            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                            b"connection: close\r\n", b"\r\n", body])
            self.transport.write(b"".join(content))
            self.transport.close()

    return JSONErrorHttpToolsProtocol


def _h11_class():
    import h11
    from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

    class JSONErrorH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = parse_error_body(msg)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=STATUS_PHRASES[400]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return JSONErrorH11Protocol


def http_protocol_class(kind: str = "auto"):
    """The protocol class for uvicorn.Config(http=...): httptools where it is installed (uvicorn's own
    choice for "auto"), h11 otherwise."""
    if kind not in ("auto", "httptools", "h11"):
        raise ValueError(f"http protocol must be auto, httptools or h11; got {kind!r}")
    if kind in ("auto", "httptools"):
        try:
            import httptools  # noqa: F401
        except ImportError:
            if kind == "httptools":
                raise
        else:
            return _httptools_class()
    return _h11_class()
