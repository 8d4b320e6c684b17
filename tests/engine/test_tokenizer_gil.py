"""Tokenizing a long text in a worker thread leaves the GIL to other threads (the server's event loop)."""

import threading
import time

import pytest

from loraplex.engine.tokenizer import RELEASE_GIL_CHARS, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


def test_long_text_tokens_equal_the_single_call(tokenizer):
    text = "Grüße aus München, 東京 🙂. " * (RELEASE_GIL_CHARS // 10)
    assert len(text) > RELEASE_GIL_CHARS
    for special in (True, False):
        assert tokenizer.encode(text, add_special_tokens=special) == \
            tokenizer.backend.encode(text, add_special_tokens=special).ids


def test_other_threads_run_while_a_long_text_is_tokenized(tokenizer):
    text = "word " * 150_000
    finished = threading.Event()
    worker = threading.Thread(target=lambda: (tokenizer.encode(text), finished.set()))
    turns = 0
    worker.start()
    while not finished.is_set():
        time.sleep(0.001)  # each wake-up needs the GIL back; a held GIL leaves only a handful of turns
        turns += 1
    worker.join()
    assert turns >= 50, f"the main thread ran only {turns} times while the text was tokenized"
