"""The legacy completions' logprobs: pieces of a UTF-8 character are named by their bytes (as OpenAI names
them), so that the top alternatives keep one entry each, and text_offset points into the text."""

from __future__ import annotations

from loraplex.engine.outputs import Logprob, TokenLogprobs
from loraplex.platform.inference import format as fmt

FFFD = "\ufffd"


def _piece(token_id: int, raw: bytes, logprob: float) -> Logprob:
    return Logprob(token_id, FFFD, logprob, token_bytes=list(raw))


def _entries() -> list[TokenLogprobs]:
    # "Party 🎉": the emoji's four bytes come as three tokens, each position with byte-piece alternatives
    party = Logprob(1, "Party", -0.1)
    space = Logprob(2, " ", -0.2)
    first = _piece(3, b"\xf0\x9f", -1.3)
    top = [first, _piece(4, b"\xf0", -1.9), _piece(5, b"\xe2\x80", -2.2), Logprob(6, "!", -2.5),
           _piece(7, b"\xe2", -3.0)]
    return [TokenLogprobs(party, [party]), TokenLogprobs(space, [space]), TokenLogprobs(first, top),
            TokenLogprobs(_piece(8, b"\x8e", -0.4), [_piece(8, b"\x8e", -0.4), _piece(9, b"\x8f", -1.0)]),
            TokenLogprobs(_piece(10, b"\x89", -0.01), [_piece(10, b"\x89", -0.01)])]


def test_pieces_of_a_character_keep_one_alternative_each():
    out = fmt.completion_logprobs(_entries())
    assert out["tokens"] == ["Party", " ", "bytes:\\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89"]
    assert out["top_logprobs"][2] == {"bytes:\\xf0\\x9f": -1.3, "bytes:\\xf0": -1.9, "bytes:\\xe2\\x80": -2.2,
                                      "!": -2.5, "bytes:\\xe2": -3.0}
    assert len(out["top_logprobs"][3]) == 2
    # the chosen token is among its position's alternatives, with the same value
    for token, value, top in zip(out["tokens"], out["token_logprobs"], out["top_logprobs"], strict=True):
        assert top[token] == value


def test_text_offset_points_at_the_character_a_piece_belongs_to():
    out = fmt.completion_logprobs(_entries())
    text = "Party 🎉"
    assert out["text_offset"] == [0, 5, 6, 6, 6]
    assert text[out["text_offset"][2]] == "🎉"


def test_streamed_offsets_equal_the_whole_responses():
    entries = _entries()
    whole = fmt.completion_logprobs(entries)["text_offset"]
    for cut in range(1, len(entries)):
        offset = 0
        streamed = []
        for chunk in (entries[:cut], entries[cut:]):
            streamed += fmt.completion_logprobs(chunk, offset)["text_offset"]
            offset += sum(fmt.text_width(e.chosen) for e in chunk)
        assert streamed == whole, cut


def test_two_tokens_of_the_same_text_keep_the_likelier_value():
    a, b = Logprob(1, "a", -0.5), Logprob(2, "a", -2.0)
    out = fmt.completion_logprobs([TokenLogprobs(a, [a, b, Logprob(3, "b", -3.0)])])
    assert out["top_logprobs"] == [{"a": -0.5, "b": -3.0}]


def test_the_sampled_token_has_an_entry_even_outside_the_top():
    """OpenAI's legacy completions (and vLLM) always give the sampled token's logprob among the alternatives:
    up to `logprobs` + 1 entries, and one (not none) with `logprobs: 0`."""
    chosen = Logprob(9, "rare", -7.5)
    out = fmt.completion_logprobs([TokenLogprobs(chosen, [Logprob(1, "a", -0.5), Logprob(2, "b", -1.0)]),
                                   TokenLogprobs(chosen, [])])
    assert out["top_logprobs"] == [{"a": -0.5, "b": -1.0, "rare": -7.5}, {"rare": -7.5}]
