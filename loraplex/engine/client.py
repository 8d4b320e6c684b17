"""The contract between the control plane and an engine.

`AsyncEngine` (in-process) implements it; so can a client for a remote engine process. The control plane
codes against this protocol only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams


@dataclass
class EngineStats:
    """A snapshot for the dashboard and /metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_preempted_total: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # free but still holding a reusable prefix
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0  # in tokens
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    lora_slots_total: int = 0
    lora_slots_used: int = 0
    lora_resident: list[str] = field(default_factory=list)  # content hashes in device slots
    lora_host_cached: list[str] = field(default_factory=list)  # content hashes in the host LRU
    lora_loads_total: int = 0
    lora_evictions_total: int = 0
    lora_hits_total: int = 0
    lora_misses_total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    max_model_len: int

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        adapter: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs: each carries cumulative text/token_ids and the delta since the last one.
        Raises InvalidRequestError (before the first yield) for a request that can never run. Cancelling
        the iterator (client disconnect) aborts the request and frees its blocks at once."""
        ...

    async def abort(self, request_id: str) -> int | None:
        """End the request if it still runs. Returns how many of its prompt tokens the engine processed (0:
        it never left the queue; what a dropped request is billed), or None where the engine cannot tell."""
        ...

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """Apply the model's chat template and tokenize; the messages' text is plain text (special-token text
        in it is not read as special tokens). Raises InvalidRequestError on bad messages, PromptTooLongError
        for a conversation whose size alone shows that it cannot fit in max_model_len (before tokenizing it)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Tokenize a raw prompt, special-token text read as special tokens. Raises PromptTooLongError for a
        text whose size alone shows that it cannot fit in max_model_len (before tokenizing it)."""
        ...

    async def prefetch_adapter(self, adapter: LoRARequest, *, pin: bool = False) -> None:
        """Load the adapter into a device slot ahead of traffic (host cache if all slots are busy)."""
        ...

    async def remove_adapter(self, content_hash: str) -> None:
        """Drop an adapter from every cache level once no running request uses it."""
        ...

    def stats(self) -> EngineStats: ...
