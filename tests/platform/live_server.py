"""A real uvicorn server on a loopback port, in a thread, for tests that use real HTTP clients."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app, port: int | None = None):
    port = port or free_port()
    # idle connections outlive the clients' 5 s pool expiry, as in `loraplex serve`: a client never sends on
    # a connection the server is closing at that moment (an ECONNRESET)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            timeout_keep_alive=75)
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
