"""A completion cut in the middle of a UTF-8 character (by max_tokens or a stop token) ends before that
character instead of in U+FFFD, streamed or whole; its tokens and logprobs still count every token."""

from __future__ import annotations

import pytest

from loraplex.engine.request_state import RequestState
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


def _run(tokenizer: Tokenizer, tokens: list[int], params: SamplingParams):
    prompt = tokenizer.encode("Hi")
    seq = Sequence("r", prompt, params)
    state = RequestState("r", None, prompt, params, [seq], tokenizer, max_model_len=512)
    comp = state.completions[0]
    streamed = ""
    for token in tokens:
        seq.token_ids.append(token)
        finish = state.on_token(comp, token, (-0.5, [(token, -0.5)]))
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish
            seq.status = SequenceStatus.FINISHED
        out = state.make_output()
        streamed += out.outputs[0].delta_text
        if finish is not None:
            return out.outputs[0], streamed
    raise AssertionError("the completion did not finish")


def test_max_tokens_cutting_a_character_drops_it(tokenizer):
    ids = tokenizer.encode("ok 🔥🔥")
    fire = tokenizer.encode("🔥")
    assert len(fire) > 1
    tokens = ids[:-1]  # the last fire cut short by max_tokens
    out, streamed = _run(tokenizer, tokens, SamplingParams(max_tokens=len(tokens), logprobs=0))
    assert out.finish_reason == "length"
    assert out.text == streamed == "ok 🔥"
    assert out.token_ids == tokens and len(out.logprobs) == len(tokens)


def test_a_stop_token_after_a_cut_character_drops_it(tokenizer):
    stop = tokenizer.encode("!")[-1]
    tokens = tokenizer.encode("ok 🔥")[:-1] + [stop]
    out, streamed = _run(tokenizer, tokens, SamplingParams(max_tokens=50, stop_token_ids=[stop]))
    assert out.finish_reason == "stop" and out.text == streamed == "ok "
    assert out.token_ids == tokens


def test_a_real_replacement_character_at_the_end_is_kept(tokenizer):
    tokens = tokenizer.encode("ok \ufffd")
    out, streamed = _run(tokenizer, tokens, SamplingParams(max_tokens=len(tokens)))
    assert out.text == streamed == "ok \ufffd"
