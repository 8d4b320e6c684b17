"""One admitted inference request: quota reservation, engine streams, and exactly-once settlement.

`run()` yields (prompt_index, RequestOutput). Whatever ends it (completion, engine error, client
disconnect, cancellation), its cleanup aborts unfinished engine requests, settles the quota with the real
token count and journals the usage record, shielded from cancellation, before the caller can respond.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from loraplex.engine.errors import (
    AdapterLoadError,
    AdapterMissingError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.auth import TenantContext
from loraplex.platform.errors import APIError, from_engine_error, unavailable
from loraplex.platform.quotas import QuotaExceeded, Reservation
from loraplex.platform.registry import ModelTarget
from loraplex.platform.services import Services
from loraplex.platform.usage import UsageEvent
from loraplex.platform.usage.inflight import CHECKPOINT_SECONDS, CHECKPOINT_TOKENS

log = logging.getLogger(__name__)
# how long a request that ends unfinished (its client left, the server stops) waits for the engine to confirm
# its aborts: an engine that does not answer (hung, or going away) must not hold the request's settlement,
# nor the server's shutdown, which waits for every settlement
ABORT_TIMEOUT_SECONDS = 10.0


@dataclass
class InferenceJob:
    services: Services
    tenant: TenantContext
    request_id: str
    endpoint: str  # chat.completions | completions
    target: ModelTarget
    prompts: list[list[int]]
    params: SamplingParams
    max_new_tokens: int
    user: str | None = None
    reservation: Reservation | None = None
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    generated: dict[int, int] = field(default_factory=dict)  # prompt index -> tokens generated so far
    # prompt index -> prompt tokens the engine processed, as its abort answered (None: it could not tell)
    prefilled: dict[int, int | None] = field(default_factory=dict)
    settled_tokens: int | None = None  # what the reservation was settled with (None: not settled yet)
    finished_ok: bool = False
    failed: bool = False
    refused: bool = False  # the engine refused it as a client error (InvalidRequestError): not usage
    stopped: bool = False  # ended by the server's shutdown (Services.stop_requests)
    _closed: bool = False
    _leased: str | None = None  # the adapter content this request holds in the store until it settles
    _consumer: asyncio.Task | None = None  # the task iterating run() now
    _ledger: object | None = None  # the in-flight ledger this request is open in (InflightLedger)
    _checkpointed_at: float = 0.0  # time.perf_counter() of its last checkpoint there
    _checkpointed_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def billed_prompt_tokens(self) -> int:
        """Prompts count for what the engine processed of them: a prompt with an output counts whole, one
        dropped in its prefill for the tokens the engine ran through (which the engine spent whether or not
        the client stayed), one dropped while it waited in the queue, or refused, for nothing. Where the
        engine could not tell (an older engine process, or an abort that failed) the prompt counts whole:
        free prefills are what a client that hangs up on purpose would be after."""
        return sum(self._billed_prompt(i) for i in range(len(self.prompts)))

    def _billed_prompt(self, index: int) -> int:
        size = len(self.prompts[index])
        if index in self.generated:
            return size
        if index not in self.prefilled:
            return 0
        processed = self.prefilled[index]
        return size if processed is None else min(processed, size)

    @property
    def completion_tokens(self) -> int:
        return sum(self.generated.values())

    @property
    def reserve_tokens(self) -> int:
        return self.prompt_tokens + len(self.prompts) * self.params.n * self.max_new_tokens

    @property
    def rate_headers(self) -> dict[str, str]:
        """The x-ratelimit-* headers. Before the request settles (a stream's, whose headers go out before its
        first token) they count its whole reservation, its prompt plus max_tokens (or the budget an unset
        max_tokens was given), as OpenAI counts max_tokens; once it has settled (a response that is not
        streamed), the tokens it really used, as its reservation was given back in part."""
        if self.reservation is None:
            return {}
        headers = dict(self.reservation.headers)
        remaining = headers.get("x-ratelimit-remaining-tokens")
        if self.settled_tokens is not None and remaining is not None:
            unused = self.reservation.reserved_tokens - self.settled_tokens
            limit = int(headers.get("x-ratelimit-limit-tokens", remaining))
            headers["x-ratelimit-remaining-tokens"] = str(max(0, min(limit, int(remaining) + unused)))
        return headers

    def engine_request_id(self, index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"

    async def admit(self) -> None:
        if self.target.adapter is not None:
            # from here to its settlement a delete leaves the version's weights in the store for it
            self._leased = self.target.adapter.content_hash
            self.services.leases.acquire(self._leased)
        try:
            self.reservation = await self.services.limiter.acquire(
                self.tenant.tenant_id, self.tenant.limits, self.request_id, self.reserve_tokens)
            self.services.running[self.request_id] = self
            self._open_in_ledger()
        except QuotaExceeded as exc:
            await self._release_lease()
            self._record_metrics("rejected", 0, None)
            over_budget = exc.kind == "monthly_budget"
            raise APIError(429, exc.message, type="insufficient_quota" if over_budget else exc.kind,
                           code="insufficient_quota" if over_budget else "rate_limit_exceeded",
                           headers=exc.headers) from exc
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._release_lease()
            raise

    def _usage_event(self, status: str, prompt_tokens: int, completion_tokens: int, ttft_ms: int | None,
                     latency_ms: int) -> UsageEvent:
        return UsageEvent(
            request_id=self.request_id, tenant_id=self.tenant.tenant_id, api_key_id=self.tenant.key_id,
            model=self.target.model, adapter_name=self.target.adapter_name,
            adapter_version=self.target.adapter.content_hash if self.target.adapter else None,
            endpoint=self.endpoint, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            ttft_ms=ttft_ms, latency_ms=latency_ms, status=status, end_user=self.user,
            created_at=UsageEvent.now_iso(),
        )

    def _open_in_ledger(self) -> None:
        """From admission to its usage record, the request is in the in-flight ledger, so that a process
        killed meanwhile still bills the tokens it produced (usage/inflight.py)."""
        usage = self.services.usage
        ledger = getattr(usage, "ledger", None)
        if ledger is None:
            return
        try:
            ledger.open(self._usage_event("interrupted", 0, 0, None, 0), self.reservation.month)
        except OSError:
            log.exception("request %s could not be entered in the in-flight usage ledger", self.request_id)
            return
        self._ledger = ledger
        self._checkpointed_at = time.perf_counter()

    def _checkpoint(self) -> None:
        """The counts so far, into the ledger: at the first token (the prompt then counts whole), then every
        CHECKPOINT_TOKENS tokens or CHECKPOINT_SECONDS, whichever comes first; a line, not a database write."""
        if self._ledger is None:
            return
        tokens = self.completion_tokens
        now = time.perf_counter()
        if not (self._checkpointed_tokens == 0 and tokens
                or tokens - self._checkpointed_tokens >= CHECKPOINT_TOKENS
                or tokens > self._checkpointed_tokens and now - self._checkpointed_at >= CHECKPOINT_SECONDS):
            return
        self._checkpointed_at, self._checkpointed_tokens = now, tokens
        ttft_ms = int((self.first_token_at - self.started) * 1000) if self.first_token_at else None
        try:
            self._ledger.checkpoint(self.request_id, self.billed_prompt_tokens, tokens, ttft_ms,
                                    int((now - self.started) * 1000))
        except OSError:
            log.exception("checkpoint of request %s in the in-flight usage ledger failed", self.request_id)

    def _close_in_ledger(self) -> None:
        ledger, self._ledger = self._ledger, None
        if ledger is not None:
            try:
                ledger.close(self.request_id)
            except OSError:
                log.exception("request %s could not be closed in the in-flight usage ledger", self.request_id)

    async def run(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            engine = self.services.require_engine()
        except APIError:
            # the engine went away since the request was admitted (its last engine process found down): a
            # failure of the server's, settled here, as nothing below runs to settle it
            self.failed = True
            with anyio.CancelScope(shield=True):
                await self.finish("error")
            raise
        streams = [engine.generate(p, self.params, self.engine_request_id(i), adapter=self.target.adapter,
                                   tenant=str(self.tenant.tenant_id)) for i, p in enumerate(self.prompts)]
        self._consumer = asyncio.current_task()
        try:
            merged = streams[0] if len(streams) == 1 else None
            if merged is not None:
                async for out in merged:
                    self._observe(0, out)
                    yield 0, out
                    self._consumer = asyncio.current_task()
            else:
                async for index, out in _merge(streams):
                    self._observe(index, out)
                    yield index, out
                    self._consumer = asyncio.current_task()
            self.finished_ok = True
        except asyncio.CancelledError:
            if not self.stopped:
                raise
            asyncio.current_task().uncancel()  # this cancellation was stop_requests' and ends here
            self.failed = True
            raise unavailable(f"The server is shutting down and stopped request {self.request_id} after "
                              f"{self.completion_tokens} tokens; it is not billed. Retry it.", retry_after=1) from None
        except (InvalidRequestError, AdapterMissingError) as exc:
            # the engine refused the request as it stands (n above what it runs at once, say): the client's
            # error, answered 400 like any other, neither a failed request nor usage; or its adapter was
            # deleted (and its weights swept) before it could load it: the tenant's doing, answered 404
            self.refused = True
            raise from_engine_error(exc) from exc
        except EngineError as exc:
            self.failed = True
            if isinstance(exc, EngineOverloadedError):
                log.warning("request %s (tenant %s) not served: %s", self.request_id, self.tenant.tenant_id, exc)
            raise from_engine_error(exc) from exc
        except Exception:
            self.failed = True
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(streams)

    def cut(self) -> None:
        """End this request now (Services.stop_requests): its consumer is cancelled inside run(), which
        turns that into a 503 / an error event; one consuming elsewhere (writing to a slow client) ends
        there, recorded as failed all the same."""
        if self._closed or self.stopped:
            return
        self.stopped = True
        if self._consumer is not None and not self._consumer.done():
            self._consumer.cancel(msg="loraplex: the server is shutting down")

    def _observe(self, index: int, out: RequestOutput) -> None:
        if out.error is not None:
            # the engine ended the request with an error rather than an answer; an empty completion with
            # finish_reason "stop" would pass for one. The cause can name the server's files: it goes to the
            # log, the client gets what failed and the request id to quote.
            log.log(logging.WARNING if out.error_kind == "adapter_missing" else logging.ERROR,
                    "request %s (tenant %s, model %r) failed in the engine: %s", self.request_id,
                    self.tenant.tenant_id, self.target.model, out.error)
            if out.error_kind == "adapter_missing":
                raise AdapterMissingError(repr(self.target.model))
            if out.error_kind == "adapter_load":
                raise AdapterLoadError(f"{self.target.model!r} (the server log has the cause under request id "
                                       f"{self.request_id})")
            raise EngineError(f"the engine could not complete the request; the server log has the cause "
                              f"under request id {self.request_id}")
        n = out.num_generated_tokens
        if n and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.generated[index] = n
        self._checkpoint()

    async def _close(self, streams) -> None:
        if self._closed:
            return
        self._closed = True
        for i, stream in enumerate(streams):
            try:
                await stream.aclose()
            except Exception:
                log.exception("closing engine stream %s failed", self.engine_request_id(i))
        if not self.finished_ok:
            processed = await self._abort(len(streams))
            if not (self.failed or self.stopped):
                self.prefilled.update(processed)  # a dropped request: billed the prompt tokens the engine processed
        status = "ok" if self.finished_ok else ("error" if self.failed or self.stopped else "cancelled")
        await self.finish(status)

    async def _abort(self, count: int) -> dict[int, int | None]:
        """Abort the request's engine requests, all at once and for ABORT_TIMEOUT_SECONDS at most; the prompt
        tokens the engine says it processed of each, None where it could not say (or did not in time)."""
        engine = self.services.engine
        if engine is None or not count:
            return dict.fromkeys(range(count))

        async def one(index: int) -> int | None:
            try:
                return await engine.abort(self.engine_request_id(index))
            except Exception:
                log.exception("abort of %s failed", self.engine_request_id(index))
                return None

        tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
        done, pending = await asyncio.wait(tasks, timeout=ABORT_TIMEOUT_SECONDS)
        for task in pending:
            task.cancel()  # not awaited: an engine call that ignores its cancellation must not hold us either
        if pending:
            log.warning("request %s: the engine did not confirm %d of its aborts within ABORT_TIMEOUT_SECONDS=%g s; "
                        "settling without them (prompts it could not report on are billed whole)",
                        self.request_id, len(pending), ABORT_TIMEOUT_SECONDS)
        return {i: task.result() if task in done else None for i, task in enumerate(tasks)}

    async def _release(self) -> None:
        """A refused request's end: its reservation given back in full, its place in the per-minute request
        count too (as for requests refused before the quota check), no usage record."""
        try:
            await self.services.limiter.settle(self.reservation, 0, count_request=False)
        except Exception:
            log.exception("quota settle failed for %s", self.request_id)
        self._record_metrics("rejected", 0, None)

    async def finish(self, status: str) -> None:
        """Settle the reservation and journal the usage record. Both happen once, whatever calls this."""
        try:
            await self._finish("error" if self.stopped and status == "cancelled" else status)
        finally:
            self.services.running.pop(self.request_id, None)
            await self._release_lease()

    async def _release_lease(self) -> None:
        content_hash, self._leased = self._leased, None
        if content_hash is not None and self.services.leases.release(content_hash):
            await self.services.sweep_retired([content_hash])

    async def _finish(self, status: str) -> None:
        if self.reservation is None or self.reservation.settled:
            return
        if self.refused and not self.completion_tokens:
            await self._release()
            self._close_in_ledger()  # not usage: nothing for a recovery to record
            return
        # a request that failed on the server's side is neither counted in usage nor billed: its tokens
        # come back to the tenant's limits too (what the month counts is what the usage records bill)
        used = 0 if status == "error" else self.billed_prompt_tokens + self.completion_tokens
        try:
            await self.services.limiter.settle(self.reservation, used)
            self.settled_tokens = used
        except Exception:
            log.exception("quota settle failed for %s", self.request_id)
        now = time.perf_counter()
        ttft_ms = int((self.first_token_at - self.started) * 1000) if self.first_token_at else None
        event = self._usage_event(status, self.billed_prompt_tokens, self.completion_tokens, ttft_ms,
                                  int((now - self.started) * 1000))
        if self.services.usage is not None:
            await self.services.usage.record(event)
        self._close_in_ledger()  # after the record is journaled: a kill between the two still bills it once
        self._record_metrics(status, self.completion_tokens, ttft_ms / 1000 if ttft_ms is not None else None)

    def _record_metrics(self, status: str, completion_tokens: int, ttft_s: float | None) -> None:
        hook = self.services.on_request_finished
        if hook is None:
            return
        try:
            hook(endpoint=self.endpoint, status=status, tenant=self.tenant.tenant_name,
                 adapter=self.target.adapter_name, prompt_tokens=self.billed_prompt_tokens,
                 completion_tokens=completion_tokens, ttft_s=ttft_s, e2e_s=time.perf_counter() - self.started)
        except Exception:
            log.exception("metrics hook failed")


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as their outputs arrive."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as exc:  # surfaced to the consumer below
            await queue.put((index, exc))
            return
        await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
