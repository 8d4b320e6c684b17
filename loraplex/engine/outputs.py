"""Results handed back by the engine, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    token: str
    logprob: float
    # the token's bytes where its text cannot show them (part of a UTF-8 character, read as U+FFFD)
    token_bytes: list[int] | None = None


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-k alternatives at one position."""

    chosen: Logprob
    top: list[Logprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Increments since the previous RequestOutput of the same stream (AsyncEngine); whole for LLM.generate.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    # with error: "adapter_load" (its adapter failed to load) | "adapter_missing" (its weights were deleted
    # before it could load them) | "engine"
    error_kind: str | None = None
    # prompt tokens the engine has run through so far (all of them once a token is generated; part of them
    # in a chunked prefill; 0 while the request waits in the queue)
    num_prompt_tokens_processed: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
