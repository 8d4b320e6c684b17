"""The API server's shutdown: running requests get `shutdown_timeout` seconds to finish, then end cleanly."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger(__name__)


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM lets running requests finish for `grace` seconds and then ends
    the inference requests still running the service's way (a 503 or an error event, usage recorded as
    failed) rather than cancelling their tasks mid-response."""

    def __init__(self, config, services, grace: float):
        super().__init__(config)
        self.services, self.grace = services, grace

    async def shutdown(self, sockets=None) -> None:
        def stop() -> None:
            if count := self.services.stop_requests():
                log.warning("stopped %d requests still running %g s after the shutdown began "
                            "(LORAPLEX_SHUTDOWN_TIMEOUT=%g s)", count, self.grace, self.grace)

        timer = asyncio.get_running_loop().call_later(self.grace, stop)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
