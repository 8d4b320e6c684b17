"""A small deterministic EngineClient for control-plane tests that need sharp control over timing.

Tokens are bytes of UTF-8 on the way in; generated token t in [0, 26] decodes to 'a'..'z' or ' ', and
EOS_ID ends a completion. Which token comes next is a hash of (prompt, adapter, seed, choice, step), so
the same request always gives the same text, and a different adapter gives different text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from loraplex.engine.client import EngineStats
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from loraplex.engine.sampling_params import SamplingParams

EOS_ID = 27
_ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def _token_text(token_id: int) -> str:
    return _ALPHABET[token_id] if token_id < len(_ALPHABET) else ""


def _snapshot(out: CompletionOutput) -> CompletionOutput:
    copy = dataclasses.replace(out, token_ids=list(out.token_ids))
    if out.logprobs is not None:
        copy.logprobs = list(out.logprobs)
    return copy


class FakeEngine:
    def __init__(self, *, model_name: str = "fake-base", max_model_len: int = 256, token_delay: float = 0.0,
                 eos_rate: int = 0, first_token_delay: float = 0.0, prefill_delay: float = 0.0):
        self.model_name = model_name
        self.first_token_delay = first_token_delay  # a request waiting in the queue: none of its prompt processed
        self.prefill_delay = prefill_delay  # then in its prefill: abort reports its whole prompt processed
        self.prompt_processed: dict[str, int] = {}  # request id -> prompt tokens processed, as abort reports
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.eos_rate = eos_rate  # 1 in eos_rate steps emits EOS; 0: never
        self.fail_at_step: int | None = None  # raise at this step, as a failing device would
        self.adapter_error: str | None = None  # when set, requests naming an adapter fail to load it
        # when set, requests naming an adapter wait for it before loading it, as ones queued for a device
        # slot do; and they load it as the engine does, from its store file, when it is set
        self.slot_free: asyncio.Event | None = None
        self.waiting_for_slot: list[str] = []
        self.started = False
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.prefetched: list[tuple[str, bool | None]] = []
        self.pinned: set[str] = set()
        self.unpinned: list[str] = []
        self.removed: list[str] = []
        self.generated_tokens = 0
        self.requests: list[dict[str, Any]] = []
        self.running_by_tenant: dict[str | None, int] = {}
        self.max_running_by_tenant: dict[str | None, int] = {}

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    def encode(self, text: str) -> list[int]:
        try:
            return list(text.encode())
        except UnicodeEncodeError:
            raise InvalidRequestError("the prompt is not valid Unicode text", param="prompt") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        parts = []
        for i, m in enumerate(messages):
            if m.get("role") not in {"system", "user", "assistant", "tool", "developer"}:
                raise InvalidRequestError(f"messages[{i}].role {m.get('role')!r} is not a known role",
                                          param=f"messages[{i}].role")
            if not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}].content must be text", param=f"messages[{i}].content")
            parts.append(f"<{m['role']}>{m['content']}\n")
        if add_generation_prompt:
            parts.append("<assistant>")
        return self.encode("".join(parts))

    def _next_token(self, prompt: list[int], adapter: LoRARequest | None, seed: int | None, choice: int,
                    step: int) -> int:
        key = f"{prompt}|{adapter.content_hash if adapter else ''}|{seed}|{choice}|{step}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        if self.eos_rate and step > 0 and h % self.eos_rate == 0:
            return EOS_ID
        return h % len(_ALPHABET)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       adapter: LoRARequest | None = None, tenant: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                                      f"{self.max_model_len}", param="messages")
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt_ids))
        max_tokens = min(max_tokens, self.max_model_len - len(prompt_ids))
        self.requests.append({"request_id": request_id, "adapter": adapter, "tenant": tenant, "params": params,
                              "prompt_ids": prompt_ids})
        metrics = RequestMetrics(arrival_time=time.time())
        outs = [CompletionOutput(index=i, text="", token_ids=[], logprobs=[] if params.logprobs is not None
                                 else None) for i in range(params.n)]
        if adapter is not None and self.adapter_error is not None:
            # as the engine reports an adapter that failed to load: one finished output carrying the error
            outs[0].finish_reason = "error"
            yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_ids, outputs=outs,
                                finished=True, metrics=metrics, error=self.adapter_error,
                                error_kind="adapter_load")
            return
        if adapter is not None and self.slot_free is not None:
            self.waiting_for_slot.append(request_id)
            await self.slot_free.wait()
            if not Path(adapter.path).exists():
                outs[0].finish_reason = "error"
                yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_ids,
                                    outputs=outs, finished=True, metrics=metrics,
                                    error=f"adapter {adapter.name!r} could not be loaded: {adapter.path} does "
                                          "not exist", error_kind="adapter_missing")
                return
        self.running.add(request_id)
        self.running_by_tenant[tenant] = self.running_by_tenant.get(tenant, 0) + 1
        self.max_running_by_tenant[tenant] = max(self.max_running_by_tenant.get(tenant, 0),
                                                 self.running_by_tenant[tenant])
        done = False
        try:
            if self.first_token_delay:
                await asyncio.sleep(self.first_token_delay)
            self.prompt_processed[request_id] = len(prompt_ids)
            if self.prefill_delay:
                await asyncio.sleep(self.prefill_delay)
            for step in range(max_tokens):
                if step == self.fail_at_step:
                    raise RuntimeError("engine step failed: device lost")
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                else:
                    await asyncio.sleep(0)
                for o in outs:
                    o.delta_text, o.delta_token_ids = "", []
                    o.delta_logprobs = [] if params.logprobs is not None else None
                    if o.finished:
                        continue
                    tok = self._next_token(prompt_ids, adapter, params.seed, o.index, step)
                    self.generated_tokens += 1
                    o.token_ids.append(tok)
                    o.delta_token_ids = [tok]
                    if params.logprobs is not None:
                        lp = TokenLogprobs(chosen=Logprob(tok, _token_text(tok), -0.5),
                                           top=[Logprob(t, _token_text(t), -0.5 - k)
                                                for k, t in enumerate(range(params.logprobs))])
                        o.logprobs.append(lp)
                        o.delta_logprobs = [lp]
                    if tok == EOS_ID:
                        o.finish_reason, o.stop_reason = "stop", EOS_ID
                        continue
                    piece = _token_text(tok)
                    o.text += piece
                    o.delta_text = piece
                    hit = next((s for s in params.stop_strings if s in o.text), None)
                    if hit is not None:
                        cut = o.text.index(hit)
                        o.delta_text = piece[: max(0, len(piece) - (len(o.text) - cut))]
                        o.text = o.text[:cut]
                        o.finish_reason, o.stop_reason = "stop", hit
                    elif len(o.token_ids) >= max_tokens:
                        o.finish_reason = "length"
                if metrics.first_token_time is None:
                    metrics.first_token_time = time.time()
                finished = all(o.finished for o in outs)
                if finished:
                    metrics.finished_time = time.time()
                    done = True
                # a snapshot, as the engine gives: a consumer that queues outputs (several prompts merged)
                # must not see later steps overwrite the deltas it has not read yet
                yield RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                                    prompt_token_ids=prompt_ids, outputs=[_snapshot(o) for o in outs],
                                    finished=finished,
                                    metrics=metrics)
                if finished:
                    self.finished.append(request_id)
                    return
        finally:
            self.running.discard(request_id)
            self.running_by_tenant[tenant] -= 1
            if not done:
                self.aborted.append(request_id)

    async def abort(self, request_id: str) -> int:
        if request_id in self.running:
            self.running.discard(request_id)
            self.aborted.append(request_id)
        return self.prompt_processed.get(request_id, 0)

    async def prefetch_adapter(self, adapter: LoRARequest, *, pin: bool | None = None) -> None:
        self.prefetched.append((adapter.content_hash, pin))
        if pin:
            self.pinned.add(adapter.content_hash)
        elif pin is False:
            self.pinned.discard(adapter.content_hash)

    async def unpin_adapter(self, content_hash: str) -> None:
        self.unpinned.append(content_hash)
        self.pinned.discard(content_hash)

    def pinned_adapters(self) -> set[str]:
        return set(self.pinned)

    async def remove_adapter(self, content_hash: str) -> None:
        self.removed.append(content_hash)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), generation_tokens_total=self.generated_tokens)
