"""How loraplex's servers stop: a signal's clean stop exits 0, and the API server's running requests get
`shutdown_timeout` seconds to finish, then end cleanly."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger(__name__)


class SignalStopServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM or Ctrl-C followed by a completed graceful shutdown is a clean
    stop: the process exits 0. uvicorn raises the signal again once it has shut down, so such a process
    died of SIGTERM (status 143, which supervisors count as a failure) or showed click's "Aborted!" with
    status 1. A second Ctrl-C, which forces the exit, still raises it."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if not self.force_exit:
            self._captured_signals.clear()


class StoppingServer(SignalStopServer):
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
