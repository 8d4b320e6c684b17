"""A prompt whose size alone shows that it cannot fit in the context is refused before it is tokenized."""

from __future__ import annotations

import pytest

from loraplex.engine.errors import PromptTooLongError
from loraplex.engine.tokenizer import Tokenizer
from loraplex.testing import Untokenizable

LIMIT = 64


@pytest.fixture
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


def test_the_longest_token_bounds_every_token(tokenizer):
    # the tiny vocabulary's longest entry is a special token's text, <|endoftext|>
    assert tokenizer.max_token_bytes == len(b"<|endoftext|>")
    assert all(len(tokenizer.token_bytes(i)) <= tokenizer.max_token_bytes for i in range(tokenizer.vocab_size))


def test_an_oversize_prompt_is_refused_without_tokenizing(tokenizer):
    tokenizer.backend = Untokenizable(tokenizer.backend)
    # each copy of the longest token's text is one token: LIMIT of them leave no room for a generated one
    with pytest.raises(PromptTooLongError, match="too long") as info:
        tokenizer.encode("<|endoftext|>" * LIMIT, max_model_len=LIMIT)
    assert (info.value.param, info.value.min_tokens, info.value.max_model_len) == ("prompt", LIMIT, LIMIT)
    with pytest.raises(PromptTooLongError, match="reduce the length of the messages") as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "word " * 1000}], max_model_len=LIMIT)
    assert info.value.param == "messages"
    # special-token text in a message is counted as well
    with pytest.raises(PromptTooLongError):
        tokenizer.apply_chat_template([{"role": "user", "content": "<|im_end|>" * 1000}], max_model_len=LIMIT)
    # multi-byte characters count for their bytes
    with pytest.raises(PromptTooLongError):
        tokenizer.encode("🙂" * (LIMIT * tokenizer.max_token_bytes // 4), max_model_len=LIMIT)


def test_a_prompt_just_inside_the_bound_is_tokenized(tokenizer):
    ids = tokenizer.encode("<|endoftext|>" * (LIMIT - 1), max_model_len=LIMIT)
    assert len(ids) == LIMIT - 1
    # without a limit nothing is refused here
    assert len(tokenizer.encode("<|endoftext|>" * LIMIT)) == LIMIT
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, max_model_len=LIMIT) == tokenizer.apply_chat_template(messages)


def test_bytes_the_vocabulary_cannot_spell_do_not_count(tmp_path):
    """A byte-level BPE drops bytes none of its entries spells: they make no token, so they make no bound."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello world"] * 4, trainer=trainers.BpeTrainer(vocab_size=40, show_progress=False))
    tokenizer = Tokenizer(backend, [])
    assert tokenizer.max_token_bytes and b"\x04" in tokenizer._unspelled_bytes
    text = "\x04" * 10_000 + "hello"
    assert tokenizer.encode(text, max_model_len=LIMIT) == backend.encode(text).ids


def test_no_bound_where_a_normalizer_may_shrink_the_text(tiny_llama_dir):
    from tokenizers import normalizers

    tokenizer = Tokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.backend.normalizer = normalizers.NFKC()
    assert Tokenizer(tokenizer.backend, []).max_token_bytes is None
