"""Engine outputs -> OpenAI response objects and SSE chunks (chat.completion and text_completion)."""

from __future__ import annotations

import json
import math
from typing import Any

from loraplex.engine.outputs import CompletionOutput, Logprob, TokenLogprobs


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(o: CompletionOutput) -> str | None:
    if o.finish_reason in ("stop", "length"):
        return o.finish_reason
    return "stop" if o.finish_reason else None


def _bytes(logprob: Logprob) -> list[int]:
    if logprob.token_bytes is not None:  # part of a UTF-8 character: its own bytes, not U+FFFD's
        return list(logprob.token_bytes)
    return list(logprob.token.encode("utf-8", errors="replace"))


def _lp(value: float) -> float:
    """A logprob JSON can carry: -inf (and NaN, which only a broken model gives) as OpenAI's -9999.0."""
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [
        {"token": e.chosen.token, "logprob": _lp(e.chosen.logprob), "bytes": _bytes(e.chosen),
         "top_logprobs": [{"token": t.token, "logprob": _lp(t.logprob), "bytes": _bytes(t)} for t in e.top]}
        for e in entries
    ]}


def legacy_token(logprob: Logprob) -> str:
    """A token as the legacy completions' logprobs name it: its text, or for part of a UTF-8 character
    "bytes:" and its bytes (as OpenAI does), so that such pieces are told apart instead of all reading
    U+FFFD and overwriting one another among the top alternatives."""
    if logprob.token_bytes is not None:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in logprob.token_bytes)
    return logprob.token


def text_width(logprob: Logprob) -> int:
    """How many characters of the completion's text a token starts (for text_offset): a piece of a UTF-8
    character counts only if it holds the character's first byte."""
    if logprob.token_bytes is None:
        return len(logprob.token)
    return sum(1 for b in logprob.token_bytes if b & 0xC0 != 0x80)


def completion_logprobs(entries: list[TokenLogprobs] | None, offset: int = 0) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets, pos = [], offset
    for e in entries:
        raw = e.chosen.token_bytes
        # a token that continues a character started before it points at that character
        offsets.append(pos - 1 if raw and raw[0] & 0xC0 == 0x80 and pos > 0 else pos)
        pos += text_width(e.chosen)
    top: list[dict[str, float]] = []
    for e in entries:
        alternatives: dict[str, float] = {}
        for t in e.top:  # most likely first: two tokens of the same text keep the likelier one's value
            alternatives.setdefault(legacy_token(t), _lp(t.logprob))
        # the sampled token always has its entry, as OpenAI's legacy API (and vLLM) give it: up to logprobs + 1
        # entries, one with logprobs 0
        alternatives.setdefault(legacy_token(e.chosen), _lp(e.chosen.logprob))
        top.append(alternatives)
    return {
        "tokens": [legacy_token(e.chosen) for e in entries],
        "token_logprobs": [_lp(e.chosen.logprob) for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_response(response_id: str, created: int, model: str, outputs: list[CompletionOutput],
                  usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": o.index,
                     "message": {"role": "assistant", "content": o.text},
                     "logprobs": chat_logprobs(o.logprobs),
                     "finish_reason": finish_reason(o) or "stop"} for o in outputs],
        "usage": usage,
    }


def chat_chunk(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
               include_usage: bool) -> dict[str, Any]:
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_response(response_id: str, created: int, model: str,
                        choices: list[tuple[int, CompletionOutput]], usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": response_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": o.text, "logprobs": completion_logprobs(o.logprobs),
                     "finish_reason": finish_reason(o) or "stop"} for index, o in choices],
        "usage": usage,
    }


def completion_chunk(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                     include_usage: bool) -> dict[str, Any]:
    chunk = {"id": response_id, "object": "text_completion", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = None
    return chunk
