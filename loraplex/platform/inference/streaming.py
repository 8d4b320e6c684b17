"""SSE response that closes its generator, shielded, however the stream ends, so a client that goes away
aborts its engine request at once instead of whenever the generator is garbage-collected."""

from __future__ import annotations

import asyncio

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Send


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, headers: dict[str, str] | None = None, on_close=None):
        super().__init__(content, headers={"cache-control": "no-cache", **(headers or {})},
                         media_type=self.media_type)
        self.on_close = on_close  # runs even when the body never started (client gone before the first byte)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                if self.on_close is not None:
                    await self.on_close()


class ClientDisconnected(Exception):
    pass


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Await `work` (a coroutine); cancel it (and so abort the engine request) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
