"""A real uvicorn server on a loopback port, in a thread, for tests that use real HTTP clients."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from loraplex.platform.http_protocol import http_protocol_class


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app, port: int | None = None, kind: str = "auto"):
    port = port or free_port()
    # idle connections outlive the clients' 5 s pool expiry, as in `loraplex serve`: a client never sends on
    # a connection the server is closing at that moment (an ECONNRESET)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            http=http_protocol_class(kind), timeout_keep_alive=75)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def send_raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are (no client would send them) and read the answer up to the server's close:
    (status, headers with lowercase names, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body
