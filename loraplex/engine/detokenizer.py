"""Incremental detokenisation and stop-string matching for streamed output.

Decoding a token on its own is wrong in general: byte-level BPE may split one UTF-8 character over
several tokens, and SentencePiece decodes a leading space differently at the start of a text. So each
step decodes a short window of recent tokens twice (without and with the new ones) and emits the
difference, holding text back while it ends in an incomplete character (which decodes as U+FFFD). The
window slides forward as text is emitted, so each step costs O(window), not O(sequence).

Whether a trailing U+FFFD is an incomplete character or one the model really wrote is told from the
tokens' bytes, not from the text: a real U+FFFD is emitted at once, and at the end of a sequence an
incomplete character is dropped (as vLLM drops it) rather than shown as U+FFFD. The tokens that made it
still count as generated.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# prompt tokens kept as left context for the first decode (vLLM uses the same number)
_INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._backend = tokenizer.backend
        self._token_bytes = tokenizer.token_bytes
        self._skip_special = skip_special_tokens
        self._special = tokenizer.special_ids
        self.token_ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self._prefix_offset = 0  # window start: context that is decoded but never emitted again
        self._read_offset = len(self.token_ids)  # tokens before this are already emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they complete (possibly empty)."""
        if self._skip_special:
            new_token_ids = [t for t in new_token_ids if t not in self._special]
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        window = self.token_ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or (
            full_text.endswith(REPLACEMENT_CHAR) and self._incomplete_tail(window)
        ):
            return ""  # nothing visible yet, or an incomplete character: wait for more tokens
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._pieces.append(delta)
        return delta

    def held_text(self) -> str:
        """The text of the tokens stepped but not yet emitted (an incomplete character reads U+FFFD), left
        held."""
        if self._read_offset == len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        return self._decode(window)[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a sequence: emit whatever was held back, except an incomplete character at the end
        (its remaining bytes will not come): that is dropped, not shown as U+FFFD."""
        if self._read_offset == len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        delta = self._decode(window)[len(prefix_text) :]
        cut = self._incomplete_tail(window)
        if cut:
            delta = delta[: len(delta) - min(self._tail_replacements(window, cut), _trailing_replacements(delta))]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        if delta:
            self._pieces.append(delta)
        return delta

    def _incomplete_tail(self, ids: Sequence[int]) -> int:
        """How many bytes at the end of these tokens' bytes begin a character they do not finish (0: none)."""
        tail = b""
        for token in reversed(ids):
            tail = self._token_bytes(token) + tail
            if len(tail) >= 4:  # the longest UTF-8 character
                break
        return incomplete_utf8_suffix(tail)

    def _tail_replacements(self, ids: Sequence[int], cut: int) -> int:
        """How many U+FFFD the decoder writes for the last `cut` (incomplete) bytes: one for a byte-level
        decoder, one per byte for SentencePiece byte-fallback tokens."""
        covered = count = 0
        while covered < cut and count < len(ids):
            count += 1
            covered += len(self._token_bytes(ids[-count]))
        return min(_trailing_replacements(self._decode(list(ids[-count:]))), cut)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)


def incomplete_utf8_suffix(data: bytes) -> int:
    """The length of the UTF-8 character `data` ends in the middle of (1 to 3 bytes), or 0 where it ends on a
    character boundary or in bytes that no continuation could make valid."""
    for size in range(1, min(3, len(data)) + 1):
        if data[-size] & 0xC0 == 0x80:
            continue  # a continuation byte: the character, if any, starts further back
        try:
            data[-size:].decode("utf-8")
        except UnicodeDecodeError as exc:
            return size if exc.start == 0 and exc.reason == "unexpected end of data" else 0
        return 0
    return 0


def _trailing_replacements(text: str) -> int:
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR))


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back any tail that could still become one.

    Only text that cannot be part of a stop string is released, so a stop string split over several
    deltas is still caught and never partly shown to the client.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self._pending = ""
        self.matched: str | None = None

    def feed(self, delta: str, match: bool = True) -> tuple[str, str | None]:
        """Add new text. Returns (text safe to emit now, the stop string matched or None). After a
        match the text is cut at the stop string and further input is ignored. With `match` False (before
        min_tokens) no stop string ends the text; a tail that could begin one is still held back, so one that
        ends once matching is on is caught whole."""
        if self.matched is not None:
            return "", self.matched
        self._pending += delta
        if not self.stop:
            emit, self._pending = self._pending, ""
            return emit, None
        hits = [(self._pending.find(s), s) for s in self.stop] if match else []
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            end = pos + len(stop) if self.include_stop else pos
            emit, self._pending, self.matched = self._pending[:end], "", stop
            return emit, stop
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._pending) - keep
        emit, self._pending = self._pending[:cut], self._pending[cut:]
        return emit, None

    def flush(self) -> str:
        """When the sequence ends for another reason: release the held-back tail."""
        emit, self._pending = self._pending, ""
        return emit if self.matched is None else ""

    def _longest_stop_prefix_suffix(self) -> int:
        text = self._pending
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
