"""Tokenizer wrapper, chat templates, incremental detokenisation and stop strings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraplex.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.tokenizer import Tokenizer

UNICODE = "Grüße 東京 🙂 aus München"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


def test_encode_decode_round_trip(tokenizer):
    ids = tokenizer.encode(UNICODE)
    assert tokenizer.decode(ids) == UNICODE
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_token_bytes_rebuild_characters_split_over_tokens(tokenizer):
    """A token holding part of a UTF-8 character reads as U+FFFD; its bytes are its own (as OpenAI's logprobs
    give them), so joining the tokens' bytes gives back the text."""
    ids = tokenizer.encode(UNICODE)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == UNICODE
    partial = [i for i in ids if "\ufffd" in tokenizer.token_text(i)]
    assert partial  # the tiny vocabulary splits the emoji and the CJK characters into bytes
    assert all(tokenizer.token_bytes(i) != "\ufffd".encode() for i in partial)
    special = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.token_bytes(special) == b"<|im_end|>"


def test_matches_transformers(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer.from_pretrained(tiny_qwen2_dir), AutoTokenizer.from_pretrained(str(tiny_qwen2_dir))
    assert ours.vocab_size == len(theirs)
    # the tokenizer.json's special flag decides what decoding skips; transformers lists only named ones
    assert ours.special_ids >= set(theirs.all_special_ids)
    for text in [UNICODE, "<|im_start|>user\nhi<|im_end|>", "  two  spaces\n\nand lines "]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": UNICODE}]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == theirs.encode(expected, add_special_tokens=False)


def test_template_from_tokenizer_config(tiny_llama_dir, tmp_path):
    model = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(model).chat_template == template


def test_missing_tokenizer_is_a_load_error(tiny_llama_dir, tmp_path):
    from loraplex.engine.errors import ModelLoadError

    model = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        Tokenizer.from_pretrained(model)


def test_token_strings_for_logprobs(tokenizer):
    ids = tokenizer.encode(" brown")
    pieces = [tokenizer.id_to_token(i) for i in ids]
    assert pieces[0].startswith("Ġ")  # byte-level BPE spells the space as Ġ in the vocabulary
    texts = [tokenizer.token_text(i) for i in ids]
    assert texts[0].startswith(" ") and "".join(texts) == " brown"
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.token_text(im_end) == "<|im_end|>"
    with pytest.raises(InvalidRequestError):
        tokenizer.id_to_token(tokenizer.vocab_size + 10)


def test_eos_ids_come_from_generation_config_and_tokenizer(tiny_llama_dir, tmp_path):
    model = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    im_end = Tokenizer.from_pretrained(model).token_to_id("<|im_end|>")
    assert Tokenizer.from_pretrained(model).eos_token_ids == (im_end,)

    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [7, im_end, 9]
    (model / "generation_config.json").write_text(json.dumps(generation))
    assert Tokenizer.from_pretrained(model).eos_token_ids == (7, im_end, 9)


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected + "<|im_start|>assistant\n"
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert tokenizer.decode(no_prompt, skip_special_tokens=False) == expected
    # special tokens in the template are single tokens, not spelled out
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "messages\\[0\\] must be an object"),
        ([{"content": "hi"}], "role must be one of"),
        ([{"role": "wizard", "content": "hi"}], "role must be one of"),
        ([{"role": "user", "content": 3}], "content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only hold text"),
        ([{"role": "user", "content": []}], "at least one part"),
    ],
)
def test_bad_messages(tokenizer, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        tokenizer.apply_chat_template(messages)


def test_developer_messages_take_the_place_of_system_messages(tokenizer, tiny_llama_dir):
    """OpenAI's developer role replaces the system role; a template without a developer role renders it as
    the system turn, not as an unknown turn after the template's default system prompt."""
    def rendered(tok, role):
        return tok.render_chat([{"role": role, "content": "Be terse."}, {"role": "user", "content": "Hi"}])

    assert rendered(tokenizer, "developer") == rendered(tokenizer, "system")
    assert "<|im_start|>system\nBe terse." in rendered(tokenizer, "developer")
    aware = Tokenizer.from_pretrained(tiny_llama_dir)  # a template that knows the role keeps it
    aware.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{# developer #}"
    assert rendered(aware, "developer").startswith("[developer] Be terse.")


def test_template_errors_and_missing_template(tiny_llama_dir):
    strict = Tokenizer.from_pretrained(tiny_llama_dir)
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])
    strict.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_detokenizer_never_splits_characters(tokenizer, chunk):
    ids = tokenizer.encode(UNICODE)
    # the test is only meaningful if some characters really span several tokens
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    deltas = _stream(detok, ids, chunk)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == UNICODE == detok.text
    assert "" in deltas or chunk > 1  # held back at least once while a character was incomplete


def test_detokenizer_special_tokens(tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [im_end]
    skipping = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(_stream(skipping, ids)) == "Hi there"
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(_stream(keeping, ids)) == "Hi there<|im_end|>"


def test_detokenizer_flush_drops_an_incomplete_character(tokenizer):
    """A sequence cut in the middle of a character ends before it, as vLLM's does, not in U+FFFD."""
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    for cut in range(1, len(ids)):
        detok = IncrementalDetokenizer(tokenizer)
        assert detok.step(ids[:cut]) == ""
        assert detok.flush() == "" and detok.text == ""
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(_stream(detok, tokenizer.encode("Hi ") + ids[:-1])) + detok.flush()
    assert text == detok.text == "Hi "


def test_detokenizer_emits_a_real_replacement_character(tokenizer):
    """U+FFFD the model writes (its three bytes complete) is text like any other: emitted when its last
    byte comes, and kept at the end; only an incomplete character is held back and dropped."""
    ids = tokenizer.encode("a\ufffd")
    assert len(ids) > 2  # the tiny vocabulary spells U+FFFD in bytes: held while incomplete
    detok = IncrementalDetokenizer(tokenizer)
    deltas = _stream(detok, ids)
    assert deltas[-1] == REPLACEMENT_CHAR and "".join(deltas) == "a\ufffd"
    assert detok.flush() == "" and detok.text == "a\ufffd"
    detok = IncrementalDetokenizer(tokenizer)
    _stream(detok, ids + tokenizer.encode("🙂")[:1])  # then a character cut short
    assert detok.text + detok.flush() == "a\ufffd"


def test_incomplete_utf8_suffix():
    from loraplex.engine.detokenizer import incomplete_utf8_suffix

    fire = "🔥".encode()
    assert [incomplete_utf8_suffix(b"ab" + fire[:k]) for k in range(5)] == [0, 1, 2, 3, 0]
    assert incomplete_utf8_suffix("\ufffd".encode()) == 0
    assert incomplete_utf8_suffix(b"\xe0\x80") == 0  # no continuation makes this valid: not held
    assert incomplete_utf8_suffix(b"\x9f\x94") == 0  # continuation bytes without their start
    assert incomplete_utf8_suffix(b"") == 0


def test_detokenizer_window_stays_short(tokenizer):
    ids = tokenizer.encode(UNICODE + " The quick brown fox jumps over the lazy dog.") * 40
    detok = IncrementalDetokenizer(tokenizer)
    longest_window = 0
    for token in ids:
        detok.step([token])
        longest_window = max(longest_window, len(detok.token_ids) - detok._prefix_offset)
    assert detok.text == tokenizer.decode(ids)
    assert longest_window <= 6  # bounded by the longest multi-token character, not the sequence


def test_stop_string_split_across_deltas():
    matcher = StopStringMatcher(["STOP"])
    emitted = []
    for delta in ["Hello S", "T", "O", "P and more"]:
        text, stop = matcher.feed(delta)
        emitted.append(text)
    assert emitted == ["Hello ", "", "", ""]
    assert stop == "STOP"
    assert matcher.feed("ignored") == ("", "STOP")
    assert matcher.flush() == ""


def test_stop_string_false_start_is_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", None)
    assert matcher.feed("ART") == ("START", None)
    assert matcher.feed("x S") == ("x ", None)
    assert matcher.flush() == "S"


def test_earliest_stop_wins_and_can_be_included():
    matcher = StopStringMatcher(["world", "lo w"], include_stop_str_in_output=True)
    assert matcher.feed("hello world") == ("hello w", "lo w")
    plain = StopStringMatcher(["\n\n", "."])
    assert plain.feed("One. Two\n\n") == ("One", ".")


def test_no_stop_strings_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", None)
    assert matcher.flush() == ""


def test_stop_strings_are_not_matched_until_asked_to_be():
    """Before min_tokens a stop string ends nothing and its text is released; a stop string that begins
    before and ends after matching resumes is still caught whole."""
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a STOP b", match=False) == ("a STOP b", None)
    assert matcher.feed(" ST", match=False) == (" ", None)
    assert matcher.feed("OP c", match=True) == ("", "STOP")
    assert matcher.flush() == ""
