"""Sampling parameters, validated on construction so a bad request fails before it reaches a step."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from loraplex.engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_OPTIONAL = frozenset({"top_k", "seed", "max_tokens", "logprobs", "prompt_logprobs"})
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_FIELDS = ("max_tokens_is_ceiling", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    # max_tokens is a ceiling the server set for a request that left it unset, not the client's number: the
    # engine lowers it to what its KV cache holds for the n completions, as it would for an unset one
    max_tokens_is_ceiling: bool = False
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives to return per token (0: chosen token only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop_list = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        self._validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _check_types(self) -> None:
        """Python callers pass anything: a bool is not a count (logprobs=True), a string not a flag
        (ignore_eos="no" is truthy), a float not a seed. Refused here, naming the field, so that a bad request
        never reaches a step (where it would fail its whole batch)."""
        def bad(field_name: str, what: str) -> InvalidRequestError:
            value = getattr(self, field_name)
            return InvalidRequestError(f"{field_name} must be {what}, got {value!r} ({type(value).__name__})",
                                       param=field_name)

        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise bad(name, "an integer" + (" or None" if name in _OPTIONAL else ""))
            setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise bad(name, "a number")
            setattr(self, name, float(value))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        stop = self.stop
        if not (stop is None or isinstance(stop, str) or (
                isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop))):
            raise bad("stop", "a string or a list of strings")
        ids = self.stop_token_ids
        if not (ids is None or (isinstance(ids, (list, tuple)) and all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids))):
            raise bad("stop_token_ids", "a list of integers")

    def _validate(self) -> None:
        def bad(msg: str, param: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be at least 1, got {self.n}", "n")
        if self.n > 128:
            raise bad(f"n must be at most 128, got {self.n}", "n")
        # NaN fails every comparison, so the check is written to let only finite, non-negative values through.
        if not (0 <= self.temperature < math.inf):
            raise bad(f"temperature must be a finite non-negative number, got {self.temperature}", "temperature")
        # 0 keeps only the most likely token, as OpenAI's API reads it
        if not (0.0 <= self.top_p <= 1.0):
            raise bad(f"top_p must be in [0, 1], got {self.top_p}", "top_p")
        if self.top_k is None:
            self.top_k = -1
        if self.top_k < -1:
            raise bad(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}", "top_k")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be at least 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}", "min_tokens")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}", "prompt_logprobs")
        if len(self._stop_list) > 16:
            raise bad("at most 16 stop strings are allowed", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative", "stop_token_ids")
        # A per-choice generator is seeded with seed + index, and torch takes only 64-bit seeds.
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            raise bad(f"seed must be a 64-bit signed integer, got {self.seed}", "seed")
