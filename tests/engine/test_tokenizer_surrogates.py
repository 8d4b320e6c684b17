"""Lone surrogates (what JSON's "\\ud800" decodes to) are refused as invalid text, not a crash."""

import pytest

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


def test_prompt_with_a_lone_surrogate_is_an_invalid_request(tokenizer):
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        tokenizer.encode("ok \ud800 then")
    assert info.value.param == "prompt"
    assert "U+D800" in str(info.value) and "character 3" in str(info.value)


def test_chat_message_with_a_lone_surrogate_names_the_messages(tokenizer):
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi \udfff"}])
    assert info.value.param == "messages"
    assert str(info.value).startswith("a message is not valid Unicode") and "character" not in str(info.value)


def test_paired_surrogates_decoded_by_json_are_ordinary_text(tokenizer):
    import json

    text = json.loads('"\\ud83d\\ude00"')  # a valid pair: one emoji
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
